"""Fixtures of the network namespace cases (hosts.py builds the cluster). Skipped, with
the reason, where network namespaces cannot be made (not root, say)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.services.netns import network
from tests.services.netns.hosts import running_cluster

FIGURES: list[dict] = []


@pytest.fixture(scope="module")
def netns_cluster(tiny_model_dir, tmp_path_factory):
    reason = network.unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("netns")) as cluster:
        yield cluster


@pytest.fixture
def figures(request):
    """Record a case's figures: printed at once and again in the run's summary."""

    def record(**values) -> dict:
        entry = {"case": request.node.name, **values}
        FIGURES.append(entry)
        print("NETNS", json.dumps(entry), flush=True)
        return entry

    return record


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("network namespace cases: figures")
        for entry in FIGURES:
            terminalreporter.write_line(json.dumps(entry))
        path = os.environ.get("BATON_NETNS_FIGURES")
        if path:
            Path(path).write_text("\n".join(json.dumps(e) for e in FIGURES) + "\n", encoding="utf-8")
