"""The router with the cluster's KV store (docs/router.md §7): the prefix index on store
events, and placement pricing a store hit as its fetch time."""
import numpy as np
import pytest

from common.cost_model import DRAM_LINK, SSD_LINK, TINY_CPU, CostModel, LatencyFit, StorePricing, TierLink
from common.hashing import chain_hashes, root_hash
from common.protocol import StoreEvents
from services.router.cluster import ClusterState
from services.router.index import PrefixIndex
from services.router.policies.cache_aware import CacheAware
from services.router.policies.e2 import E2, E2Config
from services.router.service import store_events_problem

BLOCK = 16
ROOT = root_hash("model", "tokenizer", "", "bfloat16", BLOCK)
# Prefill 1 ms a token: recomputing what a worker lacks is what placement weighs.
HAND = CostModel("hand", prefill=LatencyFit(a=0.01, b=1e-3), decode=LatencyFit(a=1e-3, b=0.0))
SMALL_BLOCKS = StorePricing(bytes_per_block=64 * 1024)  # 4 KiB of KV a token: a small model's


def tokens(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, count).astype(np.uint32)


def hashes(prompt: np.ndarray) -> list[int]:
    return chain_hashes(ROOT, prompt, BLOCK)


def walk(index: PrefixIndex, prompt: np.ndarray):
    return index.walk(ROOT, index.block_keys(np.ascontiguousarray(prompt, dtype="<u4").tobytes()))


def cluster_of(*worker_ids: str, cost: CostModel = HAND, store: StorePricing | None = SMALL_BLOCKS) -> ClusterState:
    cluster = ClusterState(BLOCK, cost, store=store)
    for worker_id in worker_ids:
        cluster.add_worker(worker_id, 10_000)
    return cluster


def request_for(cluster: ClusterState, prompt: np.ndarray, request_id: str = "r"):
    return cluster.prepare(request_id, ROOT, prompt, 8, 0.0)


# ---- the index -------------------------------------------------------------------------


def test_store_events_name_blocks_apart_from_the_workers_holders():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK)
    names = hashes(prompt)
    index.store_stored(names, [0] * 10)
    path = walk(index, prompt)
    assert [node.block_hash for node in path] == names  # the walk goes through store-held blocks
    assert index.match(path) == {}  # but no worker holds them
    assert index.store_blocks == 10
    assert index.store_run(path, 0) == [10]
    assert index.store_run(path, 4) == [6]
    assert index.num_blocks("a") == 0


def test_moved_changes_a_blocks_tier_and_evicted_forgets_what_no_worker_holds():
    index = PrefixIndex(BLOCK)
    prompt = tokens(2, 6 * BLOCK)
    names = hashes(prompt)
    index.store_stored(names, [0] * 6)
    index.store_stored(names[4:], [1, 1])  # a moved event: the two leaves demoted to SSD
    assert index.store_blocks == 6
    assert index.store_run(walk(index, prompt), 0) == [4, 2]
    index.store_evicted(names[5:])
    assert index.store_blocks == 5 and len(index) == 5
    path = walk(index, prompt)
    assert len(path) == 5 and index.store_run(path, 0) == [4, 1]
    index.store_evicted(names[:5] + [12345])  # a block never known is ignored
    assert index.store_blocks == 0 and len(index) == 0


def test_a_block_held_by_a_worker_and_by_the_store_stays_until_both_let_it_go():
    index = PrefixIndex(BLOCK)
    prompt = tokens(3, 4 * BLOCK)
    names = hashes(prompt)
    index.stored("a", names, 0.0)
    index.store_stored(names[:2], [1, 1])
    path = walk(index, prompt)
    assert index.match(path) == {"a": 4}
    assert index.store_run(path, 0) == [0, 2]
    index.removed("a", names)  # the worker evicted all four: the store's two remain
    path = walk(index, prompt)
    assert len(path) == 2 and index.match(path) == {}
    index.stored("b", names[:1], 0.0)
    index.store_evicted(names[:2])  # the worker's one remains
    path = walk(index, prompt)
    assert len(path) == 1 and index.match(path) == {"b": 1}
    index.drop_worker("b")
    assert len(index) == 0


def test_the_worker_prefix_ends_where_its_blocks_end_even_where_the_store_goes_on():
    index = PrefixIndex(BLOCK)
    prompt = tokens(4, 8 * BLOCK)
    names = hashes(prompt)
    index.store_stored(names, [0] * 8)
    index.stored("a", names[:3], 0.0)
    index.stored("b", names[:5], 0.0)
    path = walk(index, prompt)
    assert index.match(path) == {"a": 3, "b": 5}
    assert index.store_run(path, 3) == [5] and index.store_run(path, 5) == [3]


def test_drop_store_forgets_only_what_the_store_held():
    index = PrefixIndex(BLOCK)
    names = hashes(tokens(5, 4 * BLOCK))
    index.store_stored(names, [0] * 4)
    index.stored("a", names[:1], 0.0)
    index.drop_store()
    assert index.store_blocks == 0 and len(index) == 1


def test_store_events_are_checked_before_they_are_applied():
    good = StoreEvents(store_id="s", stored=[1, 2], stored_tiers=[0, 1], moved=[3], moved_tiers=[1], evicted=[4])
    assert store_events_problem(good, 2) == ""
    assert "stored_tiers" in store_events_problem(StoreEvents(store_id="s", stored=[1], stored_tiers=[]), 2)
    assert "tiers are 0..1" in store_events_problem(StoreEvents(store_id="s", moved=[1], moved_tiers=[2]), 2)
    assert "64-bit" in store_events_problem(StoreEvents(store_id="s", evicted=[-1]), 2)
    assert "64-bit" in store_events_problem(StoreEvents(store_id="s", stored=[2**64], stored_tiers=[0]), 2)
    assert "store_id" in store_events_problem(StoreEvents(store_id=""), 2)


# ---- pricing ---------------------------------------------------------------------------


def test_fetch_time_is_bytes_over_each_tiers_bandwidth_plus_its_latency():
    pricing = StorePricing(bytes_per_block=10**6, tiers=(TierLink(1e9, 1e-3), TierLink(1e8, 5e-3)))
    assert pricing.fetch_s([]) == 0.0
    assert pricing.fetch_s([4]) == pytest.approx(4e-3 + 1e-3)
    assert pricing.fetch_s([4, 2]) == pytest.approx(5e-3 + 2e-2 + 5e-3)
    assert StorePricing.for_model(TINY_CPU, BLOCK).tiers == (DRAM_LINK, SSD_LINK)
    sized = CostModel.from_json({**TINY_CPU.to_json(), "kv_bytes_per_token": 4096})
    assert StorePricing.for_model(sized, BLOCK).bytes_per_block == 4096 * BLOCK
    assert CostModel.from_json(sized.to_json()) == sized


def test_a_store_held_prefix_lowers_every_workers_cost_alike():
    prompt = tokens(6, 2048)
    plain, stored = cluster_of("a", "b", "c"), cluster_of("a", "b", "c")
    stored.store_stored(hashes(prompt)[:100], [0] * 100)  # evicted from every worker, kept by the store
    before = plain.explore_costs(request_for(plain, prompt), 0.0)
    after = stored.explore_costs(request_for(stored, prompt), 0.0)
    saved = {worker_id: before[worker_id] - after[worker_id] for worker_id in before}
    assert saved["a"] > 1.0  # 1,600 tokens not recomputed, at 1 ms each
    assert saved["a"] == saved["b"] == saved["c"]


def test_fetching_a_long_prefix_is_priced_below_recomputing_it():
    prompt = tokens(7, 2048)
    cluster = cluster_of("a")
    cluster.store_stored(hashes(prompt), [0] * 128)
    request = request_for(cluster, prompt)
    fetch_s = SMALL_BLOCKS.fetch_s([128])
    assert cluster.prefill_s(request, "a") == pytest.approx(fetch_s + HAND.prefill_s(1, 2047))
    assert cluster.prefill_s(request, "a") < HAND.prefill_s(2048) / 10


def test_recomputing_is_priced_when_fetching_would_be_slower():
    prompt = tokens(8, 2048)
    crawl = StorePricing(bytes_per_block=64 * 1024, tiers=(TierLink(1e6, 1e-3), TierLink(1e6, 1e-3)))
    cluster = cluster_of("a", store=crawl)  # 8 MB at 1 MB/s: 8 s against ~2 s of prefill
    cluster.store_stored(hashes(prompt), [1] * 128)
    request = request_for(cluster, prompt)
    assert cluster.prefill_s(request, "a") == HAND.prefill_s(2048)


def test_with_always_fetch_the_fetch_is_priced_even_where_recomputing_is_quicker():
    prompt = tokens(8, 2048)
    crawl = StorePricing(bytes_per_block=64 * 1024, tiers=(TierLink(1e6, 1e-3), TierLink(1e6, 1e-3)),
                         always_fetch=True)
    cluster = cluster_of("a", store=crawl)
    cluster.store_stored(hashes(prompt), [1] * 128)
    request = request_for(cluster, prompt)
    assert cluster.prefill_s(request, "a") == pytest.approx(crawl.fetch_s([0, 128]) + HAND.prefill_s(1, 2047))
    assert cluster.prefill_s(request, "a") > HAND.prefill_s(2048)


def test_only_the_store_run_right_after_the_workers_own_blocks_is_fetched():
    prompt = tokens(9, 1024)
    names = hashes(prompt)
    cluster = cluster_of("a", "b")
    cluster.kv_stored("a", names[:20], 0.0)
    cluster.store_stored(names[:40], [0] * 20 + [1] * 20)
    request = request_for(cluster, prompt)
    assert cluster.prefill_s(request, "a") == pytest.approx(SMALL_BLOCKS.fetch_s([0, 20])
                                                            + HAND.prefill_s(1024 - 640, 640))
    assert cluster.prefill_s(request, "b") == pytest.approx(SMALL_BLOCKS.fetch_s([20, 20])
                                                            + HAND.prefill_s(1024 - 640, 640))


def test_without_a_store_its_events_change_no_price():
    prompt = tokens(10, 2048)
    cluster = cluster_of("a", store=None)
    cluster.store_stored(hashes(prompt), [0] * 128)
    assert cluster.prefill_s(request_for(cluster, prompt), "a") == HAND.prefill_s(2048)


def _busy(cluster: ClusterState, worker_id: str) -> None:
    """One short request in flight on the worker: ~0.1 s of prefill and decode load."""
    cluster.place(cluster.prepare("busy", ROOT, tokens(99, 64), 8, 0.0), worker_id, 0.0)


def test_e2_stops_chasing_a_partial_holder_once_every_worker_can_fetch_the_prefix():
    prompt = tokens(11, 2048)
    names = hashes(prompt)
    choices = {}
    for store in (False, True):
        cluster = cluster_of("a", "b")
        cluster.kv_stored("a", names[:40], 0.0)  # 640 of 2,048 tokens: explore, not exploit
        _busy(cluster, "a")
        if store:
            cluster.store_stored(names, [0] * 128)
        choices[store] = E2(E2Config(rebalance=False)).choose(request_for(cluster, prompt), cluster, 0.0)[0]
    # Without the store a's 0.64 s of cached prefill outweighs its load; with it, b fetches
    # the whole prefix in a few ms, so the idle worker wins.
    assert choices == {False: "a", True: "b"}


def test_cache_aware_prices_the_holders_advantage_as_the_fetch_it_saves():
    prompt = tokens(12, 2048)
    names = hashes(prompt)
    choices = {}
    for store in (False, True):
        cluster = cluster_of("a", "b")
        cluster.kv_stored("a", names[:64], 0.0)  # half the prompt: over the 0.3 threshold
        _busy(cluster, "a")
        if store:
            cluster.store_stored(names, [0] * 128)
        choices[store] = CacheAware().choose(request_for(cluster, prompt), cluster, 0.0)[0]
    assert choices == {False: "a", True: "b"}


def test_evicting_blocks_the_store_holds_is_priced_as_their_fetch():
    old = tokens(13, 64 * BLOCK)
    names = hashes(old)
    costs = {}
    for store in (False, True):
        cluster = ClusterState(BLOCK, HAND, store=SMALL_BLOCKS)
        cluster.add_worker("a", 64)
        cluster.kv_stored("a", names, 0.0)
        cluster.place(request_for(cluster, old, "reuse"), "a", 0.0)  # a hit on each of its blocks
        cluster.finish("reuse")
        cluster.report("a", 0, 0, 0, 64)  # every block caches a prefix: nothing is free
        if store:
            cluster.store_stored(names, [0] * 64)
        costs[store] = cluster.eviction_cost_s(request_for(cluster, tokens(14, 32 * BLOCK), "new"), "a", 0.0)
    assert costs[False] == pytest.approx(32 * BLOCK * HAND.prefill.b)  # 32 blocks recomputed
    assert costs[True] == pytest.approx(32 * SMALL_BLOCKS.bytes_per_block / DRAM_LINK.bandwidth_bytes_s)


def test_the_engine_is_told_what_the_store_holds_right_after_its_own_blocks():
    """Generate.store_from and store_tiers: the blocks the worker holds, then the tiers of
    the store's run from there (it lacks the block after); (0, None) without a store."""
    cluster = cluster_of("a", "b")
    prompt = tokens(7, 6 * BLOCK + 5)
    names = hashes(prompt)
    assert cluster.store_hint(request_for(cluster, prompt), "a") == (0, [])  # nobody holds it: no lookup needed
    cluster.kv_stored("a", names[:2], 0.0)
    cluster.store_stored(names[1:4], [0, 1, 0])
    request = request_for(cluster, prompt)
    assert cluster.store_hint(request, "a") == (2, [1, 0])
    assert cluster.store_hint(request, "b") == (0, [])  # block 0 is a's alone
    cluster.store_stored(names[:1], [0])
    assert cluster.store_hint(request_for(cluster, prompt), "b") == (0, [0, 0, 1, 0])
    without = cluster_of("a", store=None)
    without.kv_stored("a", names[:2], 0.0)
    assert without.store_hint(request_for(without, prompt), "a") == (0, None)
