"""A failed KV pull re-placed on another decode worker (docs/disaggregation.md §3), on
real processes over loopback, compared with the in-process engine (float32, greedy).

`svc up --prefill 1 --decode 1` where every pull of decode-1 times out on its side: its
deadline (`--kv-transfer-timeout-s 0.1`) passes before the prefill worker's first KV
piece (`--kv-send-pause-s 0.2`). With a second decode worker (decode-2, started on its own
by `svc start decode --index 2`, with a 10 s deadline and a smaller pool, so that pairing
picks decode-1 first) the router re-places the request there with the same lease, and
decode-2 pulls the KV; once decode-2 is gone, decode-1 recomputes as before. Engines:
prefill-0 is engine 0, decode-1 engine 1, decode-2 engine 2.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from services.client import Client
from services.local_cluster import REPO, child_env, stop_process
from tests.services.conftest import TEST_FLAGS
from tests.services.test_disaggregation import ALL_REMOTE, GREEDY, PD_FLAGS, expected, metric, wait_leases_freed

PREFILL, DECODE, SECOND = 0, 1, 2
FAILING_PULLS = ["--kv-send-pause-s", "0.2", "--kv-transfer-timeout-s", "0.1"]


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def failing(make_cluster):
    """One prefill worker and one decode worker whose pulls all time out, over ZeroMQ."""
    cluster = make_cluster(workers=0, prefill=1, decode=1,
                           extra=[*PD_FLAGS, *ALL_REMOTE, "--kv-transport", "zmq", *FAILING_PULLS])
    yield cluster
    cluster.stop()


@contextmanager
def second_decode_worker(cluster, model_dir) -> Iterator[None]:
    """decode-2 beside the cluster, its pulls with the default 10 s deadline, its pool
    smaller than decode-1's; stopped (and dropped by the router) on leaving."""
    argv = [sys.executable, "-m", "services.cli", "start", "decode", "--index", str(SECOND),
            "--port-base", str(cluster.port_base), "--model", str(model_dir), *TEST_FLAGS, *PD_FLAGS, *ALL_REMOTE,
            "--kv-transport", "zmq", "--kv-cache-gb", "0.03"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=child_env(PYTHONUNBUFFERED="1"), cwd=REPO, start_new_session=True)
    try:
        with Client(cluster.sdk, timeout_s=30) as client:
            cluster.wait_for(lambda: len(client.status().workers) == 3, 120, "decode-2 to join the router")
        yield
    finally:
        stop_process(process)
    with Client(cluster.sdk, timeout_s=30) as client:
        cluster.wait_for(lambda: len(client.status().workers) == 2, 30, "the router to drop decode-2")


def stream_tokens(cluster, prompt: list[int], max_tokens: int) -> list[int]:
    """Every token of the request's stream, chunk by chunk, as the client gets them."""
    tokens: list[int] = []
    with Client(cluster.sdk, timeout_s=60) as client:
        for chunk in client.stream(token_ids=prompt, max_tokens=max_tokens, **GREEDY):
            tokens.extend(chunk.token_ids)
    return tokens


def test_a_failed_pull_is_re_placed_on_another_decode_worker_and_streams_on_unbroken(failing, engine,
                                                                                    random_prompts, tiny_model_dir):
    """decode-1's pull times out; it hands the request back, the router sends it with the
    same lease to decode-2, which pulls the KV from the prefill worker and decodes: the
    client's one stream holds the engine's tokens, none twice, none missing."""
    [prompt] = random_prompts([40], seed=1201)
    with second_decode_worker(failing, tiny_model_dir):
        tokens = stream_tokens(failing, prompt, 8)
        assert tokens == expected(engine, prompt, 8)
        assert metric(failing, DECODE, "baton_kv_transfer_failures_total", cause="timeout") == 1
        assert metric(failing, DECODE, "baton_kv_imports_replaced_total") == 1
        assert metric(failing, DECODE, "baton_kv_imports_recomputed_total") == 0
        assert metric(failing, None, "baton_router_failed_pulls_total", outcome="moved") == 1
        assert metric(failing, SECOND, "baton_kv_transfer_bytes_total") > 0  # pulled under the same lease
        assert metric(failing, SECOND, "baton_kv_imports_recomputed_total") == 0
        failing.wait_for(lambda: metric(failing, PREFILL, "baton_kv_exposures_total", outcome="done") == 1, 10,
                         "the prefill worker to see the lease pulled")
        assert metric(failing, PREFILL, "baton_kv_exposures_total") == 1  # the failed pull did not end it
        wait_leases_freed(failing, 10)


def test_with_no_other_decode_worker_a_failed_pull_is_recomputed_as_before(failing, engine, random_prompts):
    """decode-2 is gone: the router has no other decode worker, so decode-1 releases the
    lease and computes the prompt itself (the engine's tokens)."""
    [prompt] = random_prompts([40], seed=1202)
    withdrawn = metric(failing, PREFILL, "baton_kv_exposures_total", outcome="withdrawn")
    assert stream_tokens(failing, prompt, 8) == expected(engine, prompt, 8)
    assert metric(failing, DECODE, "baton_kv_imports_recomputed_total") == 1
    assert metric(failing, DECODE, "baton_kv_imports_replaced_total") == 1  # the test above's
    assert metric(failing, None, "baton_router_failed_pulls_total", outcome="local") == 1
    failing.wait_for(lambda: metric(failing, PREFILL, "baton_kv_exposures_total", outcome="withdrawn") ==
                     withdrawn + 1, 10, "decode-1's release to end the exposure")
    wait_leases_freed(failing, 10)
