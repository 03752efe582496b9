"""The fetch-or-recompute decision (services/worker/kv_store_use.py)."""
from __future__ import annotations

import pytest

from common.cost_model import load_cost_model
from services.worker.kv_store_use import Decision, FetchCosts, Link, cheapest_block_s, decide

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


def test_the_cheapest_prefix_cost_agrees_with_decide():
    """`cheapest_block_s` (what the store offers a load at) is below another way's cost
    per block exactly when `decide` fetches some blocks: seeded links, DRAM then SSD."""
    costs = FetchCosts(load_cost_model(""), block_size=16)
    tiers = [0, 0, 1, 1, 1]
    cheapest = cheapest_block_s(tiers, BLOCK, costs.links())
    assert cheapest == pytest.approx((2 * BLOCK / 1e9 + 2e-3) / 2)  # the DRAM pair: 1 ms each plus the latency
    for other_s in (cheapest * 0.9, cheapest * 1.1, 0.05, 1.0):
        assert decide("auto", tiers, BLOCK, 16, costs.links(), other_s).fetch == (cheapest < other_s)


def test_write_back_waits_for_a_batch_or_for_its_oldest_to_age(make_engine, monkeypatch):
    """A put costs round trips to the store's process: staged blocks wait until half the
    queue (at most WRITEBACK_BATCH_BLOCKS) is staged or the oldest has waited its time,
    then go in one batch, in the order they were staged."""
    import time

    import numpy as np

    from common.engine.kv_connector import KnownBlocks, StagedBlocks, WritebackQueue
    from services.worker import kv_store_use
    from services.worker.kv_store_use import StoreThread

    def staged(first: int, count: int) -> StagedBlocks:
        keys = tuple(range(first, first + count))
        return StagedBlocks((7,) * count, keys, (7, *keys[:-1]), np.full((count, 4), first, np.uint8))

    queue = WritebackQueue(capacity_blocks=8)
    thread = StoreThread(lambda: None, None, make_engine(max_model_len=64).kv_cache.layout, queue, KnownBlocks(100),
                         FetchCosts(load_cost_model(""), block_size=16), "auto")
    assert thread.writeback_batch == 4
    assert not thread._writeback_due() and queue.oldest_age_s() == 0.0
    queue.push(staged(0, 3))
    assert not thread._writeback_due()  # 3 of 4, and young
    queue.push(staged(3, 1))
    assert thread._writeback_due()
    thread.put_blocked_until = time.monotonic() + 60
    assert not thread._writeback_due()  # a failed put is waited out first
    merged = queue.pop_all()
    assert merged is not None and merged.keys == (0, 1, 2, 3) and merged.parents == (7, 0, 1, 7)
    assert merged.values[:, 0].tolist() == [0, 0, 0, 3] and queue.num_blocks == 0

    thread.put_blocked_until = 0.0
    monkeypatch.setattr(kv_store_use, "WRITEBACK_MAX_WAIT_S", 0.05)
    queue.push(staged(10, 1))
    assert not thread._writeback_due()
    time.sleep(0.06)
    assert thread._writeback_due()  # alone, but old enough
