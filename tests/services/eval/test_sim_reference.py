"""The simulator's results on small seeded runs equal what a reference commit produced.

Speed work on the simulator and the engine objects it drives must not change a single
result. Each case below is simulated and fingerprinted (a SHA-256 of every request
record, the step count, the run totals and the store report); sim_reference.json holds
the fingerprints commit f2ba184 gave, regenerated at 40a52a7, which rounds profile fits
to be the same on every CPU (common/cost_model.py: the last bits of every time moved, no
decision did), and again when finished requests began to reach the router at the end of
their step instead of on the next heartbeat (seven of the thirteen cases moved: their
policies read the requests in flight), and when the router began pricing a prefill longer
than the engines' step budget chunk by chunk (docs/router.md §3; toolbench-least_load
moved: its loads hold those prefill times). Regenerate them (only for a deliberate change of
results, and say so in the commit) with this module run as a script:

    git worktree add /tmp/base-sim <commit>
    PYTHONPATH=/tmp/base-sim python tests/services/eval/test_sim_reference.py --write
    git worktree remove /tmp/base-sim

(PYTHONPATH picks whose simulator runs; without --write the script prints the
fingerprints instead.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from common.cost_model import load_cost_model
from services.eval.disagg import LINKS, layout_for_model
from services.eval.report import Slo
from services.eval.sim_store import StoreModel
from services.eval.simulator import SimConfig, simulate
from services.eval.workloads import make_workload
from services.eval.workloads.arrivals import poisson

REFERENCE = Path(__file__).with_name("sim_reference.json")
POLICIES = ("round_robin", "least_load", "lpm", "cache_aware", "dynamo", "e2")


def _cases() -> dict[str, tuple[str, int, float, dict]]:
    """name -> (workload, requests, arrival rate, SimConfig fields beyond the common ones)."""
    mistral = layout_for_model("mistral-7b", 16).bytes_per_block
    cases: dict[str, tuple[str, int, float, dict]] = {
        f"toolbench-{policy}": ("toolbench", 150, 12.0, {"policy": policy, "kv_blocks": 600})
        for policy in POLICIES}
    cases |= {
        "chat-lpm-priority": ("chat", 120, 6.0, {"policy": "lpm", "kv_blocks": 500, "queue_policy": "priority"}),
        "programming-round_robin-small-budget": (
            "programming", 80, 4.0, {"policy": "round_robin", "max_num_batched_tokens": 64, "max_num_seqs": 6}),
        "toolbench-cache_aware-ttl-admission": (
            "toolbench", 150, 20.0, {"policy": "cache_aware", "index_ttl_s": 30.0, "admission": True,
                                     "slos": {"toolbench": Slo(ttft_s=1.0, tpot_s=0.05)}}),
        "toolbench-e2-stepped": ("toolbench", 100, 12.0, {"policy": "e2", "kv_blocks": 600,
                                                          "fuse_quiet_steps": False}),
        "programming-e2-disaggregated": (
            "programming", 80, 3.0, {"policy": "e2", "workers": 1, "prefill_workers": 1, "decode_workers": 2,
                                     "link": LINKS["tcp-25g"], "kv_bytes_per_block": mistral}),
        "chat-e2-store": (
            "chat", 150, 6.0, {"policy": "e2", "workers": 2, "kv_blocks": 600, "kv_bytes_per_block": mistral,
                               "store": StoreModel(dram_gb=0.5, ssd_gb=4.0, dram_gbps=25.0, ssd_gbps=7.0)}),
    }
    return cases


def fingerprint(name: str) -> dict:
    """The case's fingerprint: what sim_reference.json records for it."""
    workload, count, rate, fields = _cases()[name]
    requests = poisson(make_workload(workload, count, seed=7), rate=rate, seed=7)
    config = SimConfig(**({"workers": 3, "cost": load_cost_model("a6000/mistral-7b")} | fields))
    result = simulate(requests, config)
    records = json.dumps([dataclasses.astuple(record) for record in result.records])
    return {"records_sha256": hashlib.sha256(records.encode()).hexdigest(), "steps": result.steps,
            "totals": dataclasses.asdict(result.totals), "store": result.store,
            "completed": sum(record.finish_s is not None for record in result.records)}


@pytest.mark.parametrize("name", sorted(_cases()))
def test_results_equal_the_base_commits(name):
    expected = json.loads(REFERENCE.read_text())[name]
    assert fingerprint(name) == expected


def test_the_reference_covers_every_case_and_each_finishes_requests():
    reference = json.loads(REFERENCE.read_text())
    assert sorted(reference) == sorted(_cases())
    assert all(case["completed"] > 0 for case in reference.values())


if __name__ == "__main__":
    fingerprints = {name: fingerprint(name) for name in sorted(_cases())}
    if "--write" in sys.argv[1:]:
        REFERENCE.write_text(json.dumps(fingerprints, indent=1, sort_keys=True) + "\n")
    else:
        print(json.dumps(fingerprints, indent=1, sort_keys=True))
