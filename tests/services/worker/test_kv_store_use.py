"""The fetch-or-recompute decision (services/worker/kv_store_use.py)."""
from __future__ import annotations

import pytest

from common.cost_model import load_cost_model
from services.worker.kv_store_use import Decision, FetchCosts, Link, decide

FAST = [Link(10e9, 1e-4), Link(1e9, 1e-3)]
BLOCK = 10**6  # a MB per block: 0.1 ms from DRAM, 1 ms from SSD on FAST


def test_fetch_when_the_bytes_move_faster_than_the_tokens_compute():
    got = decide("auto", [0, 0, 0], BLOCK, 16, FAST, prefill_s=1e-3)
    assert got.fetch and got.num_blocks == 3
    assert got.fetch_s == pytest.approx(3 * 1e-4 + 1e-4) and got.compute_s == pytest.approx(3e-3)


def test_recompute_when_prefill_is_faster():
    got = decide("auto", [0, 0], BLOCK, 16, FAST, prefill_s=1e-5)
    assert got == Decision(False, 0, got.fetch_s, got.compute_s, "slower_than_prefill")


def test_latency_dominates_a_short_prefix():
    slow_start = [Link(10e9, 5e-3), Link(1e9, 5e-3)]
    assert not decide("auto", [0], BLOCK, 16, slow_start, prefill_s=1e-3).fetch
    assert decide("auto", [0] * 10, BLOCK, 16, slow_start, prefill_s=1e-3).num_blocks == 10


def test_only_the_prefix_worth_fetching_is_fetched():
    # DRAM blocks pay (0.1 ms < 0.5 ms of prefill each); the SSD tail does not (1 ms).
    got = decide("auto", [0, 0, 0, 0, 1, 1, 1, 1], BLOCK, 16, [Link(10e9, 1e-4), Link(1e9, 1e-4)], 5e-4)
    assert got.fetch and got.num_blocks == 4


def test_overrides_and_bad_input():
    assert decide("always", [1, 1], BLOCK, 16, FAST, prefill_s=0.0).num_blocks == 2
    assert not decide("never", [0], BLOCK, 16, FAST, prefill_s=1.0).fetch
    assert decide("always", [], BLOCK, 16, FAST, 1.0) == Decision(False, 0, 0.0, 0.0, "not_stored")
    with pytest.raises(ValueError, match="kvstore_fetch"):
        decide("sometimes", [0], BLOCK, 16, FAST, 1.0)
    with pytest.raises(ValueError, match="tiers"):
        decide("auto", [2], BLOCK, 16, FAST, 1.0)


def test_measurements_move_the_decision():
    costs = FetchCosts(load_cost_model(""), block_size=16)
    seeded = costs.block_prefill_s()
    assert seeded == pytest.approx(load_cost_model("").recompute_s(16))
    costs.observe_prefill(8, 1.0)  # too short to say anything
    assert costs.block_prefill_s() == seeded
    for _ in range(50):
        costs.observe_prefill(1600, 1.0)  # 1,600 tokens/s: 10 ms a block
    assert costs.block_prefill_s() == pytest.approx(0.01, rel=1e-3)
    assert not costs.decide("auto", [1] * 4, 64 << 20).fetch  # 64 MiB a block from a seeded 200 MB/s SSD
    for _ in range(50):
        costs.observe_fetch([1], 4 * (64 << 20), 0.02)  # measured: ~13 GB/s
        costs.observe_call(1, 1e-4)
    got = costs.decide("auto", [1] * 4, 64 << 20)
    assert got.fetch and got.num_blocks == 4
    costs.observe_fetch([], 10, 1.0)  # ignored: nothing fetched
    costs.observe_fetch([5], 10, 1.0)  # ignored: no such tier
