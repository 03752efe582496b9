"""The KV store as a KvSource on the worker's loop (services/worker/store_source.py): a
real engine, the store thread never started, its job queue read directly."""
from __future__ import annotations

import pytest

from common.hashing import chain_hashes


def test_a_fetch_through_a_host_buffer_lands_in_the_right_blocks(make_engine, random_prompts):
    """A GPU engine's fetch lands in a host buffer laid out as a pool of the fetched blocks
    (plane-major); the loop copies it into the engine's blocks. Checked here on CPU."""
    from common.config import ClusterConfig
    from common.metrics import Registry
    from common.sampling_params import SamplingParams
    from services.worker.kv_store_use import FetchResult
    from services.worker.store_source import StoreSource

    source, engine = make_engine(max_model_len=128), make_engine(max_model_len=128)
    prompt = random_prompts([70], seed=41)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = source.generate([prompt], greedy)[0].token_ids
    blocks = source.block_manager.match_prefix(
        chain_hashes(source._root_hash(""), prompt, 16), prompt, 4)
    values = source.read_blocks(blocks)  # (4, bytes_per_block), plane-major per block
    planes = 2 * source.kv_cache.layout.num_layers
    bounce = values.reshape(4, planes, -1).transpose(1, 0, 2).copy().reshape(-1)  # as StoreClient.fetch fills it

    use = StoreSource(ClusterConfig(kvstore=True), engine, lambda: None, Registry())
    fetch = engine.begin_load("r", prompt, greedy)
    assert fetch is not None
    use.in_flight["r"] = fetch.dst_block_ids
    landed = use._land(FetchResult("r", 3, "fetch", (0, 0, 0), bounce))  # 4 asked, 3 landed
    assert landed.landed == 3 and landed.settled
    engine.complete_load("r", landed.landed)
    tokens = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
            if output.finished:
                assert output.num_cached_tokens == 48
    assert tokens == want


def test_a_decode_loads_store_offer_is_weighed_against_the_leases_measured_pulls(make_engine, random_prompts):
    """A lookup delays the pull of the rest: the store's offer to a decode worker's load
    (its fastest tier, as no hint names the tiers) loses to the lease's seeded pull, and
    wins once the pulls measured slow (services/worker/kv_loads.py then asks it first)."""
    from common.config import ClusterConfig
    from common.metrics import Registry
    from common.protocol import KvHandle
    from common.sampling_params import SamplingParams
    from services.decode.lease_source import LeaseSource
    from services.worker.store_source import StoreSource

    engine = make_engine(max_model_len=128)
    store = StoreSource(ClusterConfig(kvstore=True), engine, lambda: None, Registry())  # its thread never starts
    lease = LeaseSource(None, 1.0, engine.kv_cache.layout.bytes_per_block)  # type: ignore[arg-type]  # no pull here
    prompt = random_prompts([70], seed=43)[0]
    load = engine.begin_load("d", prompt, SamplingParams(max_tokens=4), first_token_id=5)
    assert load is not None and len(load.block_hashes) == 4 and len(load.dst_block_ids) == 5
    lease.expect("d", KvHandle("p", "tcp://127.0.0.1:1", "ab" * 16, "i", list(range(5)), list(load.block_hashes),
                               70, 5))
    stored, pulled = store.match(load, 0), lease.match(load, 0)
    assert (stored.blocks, stored.sure) == (4, False) and (pulled.blocks, pulled.sure) == (5, True)
    assert stored.block_s > pulled.block_s  # 64 KiB blocks at the seeded 1 GB/s: ~66 µs each
    for _ in range(50):
        lease.bandwidth.update(10 << 20)  # measured: 10 MiB/s, 6 ms a block
    assert lease.match(load, 0).block_s > stored.block_s
    assert store.match(load, 4).blocks == 0 and lease.match(load, 4).blocks == 1  # the partial block is the lease's
    engine.cancel_load("d")


def test_the_engines_prefill_rate_is_learnt_every_turn_without_a_fetch(make_engine, random_prompts):
    from common.config import ClusterConfig
    from common.metrics import Registry
    from common.sampling_params import SamplingParams
    from services.worker.store_source import StoreSource

    engine = make_engine(max_model_len=128)
    store = StoreSource(ClusterConfig(kvstore=True), engine, lambda: None, Registry())
    seeded = store.costs.block_prefill_s()
    engine.generate(random_prompts([100], seed=44), SamplingParams(max_tokens=1))
    store.observe_engine()
    assert store.costs.prefill_rate.samples == 1 and store.costs.block_prefill_s() != seeded
    store.observe_engine()  # nothing new prefilled: nothing learnt
    assert store.costs.prefill_rate.samples == 1


def test_the_store_offers_no_blocks_the_routers_index_says_it_lacks(make_engine, random_prompts):
    """KvLoad.store_hint (the router's view): the store offers nothing for a load whose
    first block to fetch is where the store's run ends, or when there is no run at all,
    and the run's blocks at their tiers' cost; where the cache ends elsewhere than the
    router believes, it offers every block, known only by a lookup, as without a hint; a
    bad hint is refused by name."""
    import dataclasses

    from common.config import ClusterConfig
    from common.engine.kv_connector import Offer, StoreHint
    from common.metrics import Registry
    from common.protocol import Generate, Sampling
    from common.sampling_params import InvalidRequestError, SamplingParams
    from services.worker.store_source import StoreSource

    engine = make_engine(max_model_len=128)
    store = StoreSource(ClusterConfig(kvstore=True, kvstore_fetch="always"), engine, lambda: None, Registry())
    prompt = random_prompts([70], seed=45)[0]  # 4 full blocks
    load = engine.begin_load("w", prompt, SamplingParams(max_tokens=4))
    assert load is not None and load.first_block == 0 and len(load.block_hashes) == 4

    def offer(hint: StoreHint | None, start: int) -> Offer:
        return store.match(dataclasses.replace(load, store_hint=hint), start)

    assert offer(StoreHint(0, ()), 0).why == "known_miss"  # the store lacks block 0
    assert offer(StoreHint(1, (0, 0)), 3).why == "known_miss"  # blocks 1-2 stored, block 3 not
    assert offer(StoreHint(1, (0, 1)), 1) == Offer(2, 0.0)  # the run starts there ("always": no cost weighed)
    assert offer(StoreHint(2, (0,)), 0) == Offer(4, 0.0)  # the cache ends before the router thinks
    assert offer(StoreHint(0, (0,)), 2) == Offer(2, 0.0)  # ... or after it
    assert offer(StoreHint(2, ()), 0).why == "known_miss"  # no stored run at all: not asked wherever it ends
    assert offer(None, 0) == Offer(4, 0.0)  # no hint: a lookup tells
    assert store.start(load, 1, 0.0) and store.thread.jobs.get_nowait().keys == load.block_hashes[1:]
    store.in_flight.clear()
    engine.cancel_load("w")

    def hint(store_from: int, tiers: list[int] | None) -> StoreHint | None:
        return store.hint(Generate(request_id="g", sampling=Sampling(max_tokens=4),
                                   stream_address="tcp://127.0.0.1:1", store_from=store_from,
                                   store_tiers=tiers), 70)

    assert hint(1, [0, 1, 0]) == StoreHint(1, (0, 1, 0)) and hint(0, None) is None
    with pytest.raises(InvalidRequestError, match="store_from.*2 with 3 store_tiers; the prompt has 4 full blocks"):
        hint(2, [0, 0, 0])
    with pytest.raises(InvalidRequestError, match="store_from.*-1 with"):
        hint(-1, [])
    with pytest.raises(InvalidRequestError, match="store_tiers.*a tier must be 0 to 1"):
        hint(0, [0, -1])


def test_a_hinted_runs_offer_is_the_cheapest_prefix_of_its_tiers(make_engine, random_prompts):
    """With the router's hint the store's tiers are known before a lookup: the offer's
    cost per block is the cheapest leading run's, so it beats computing the blocks exactly
    when `decide` would fetch some of them (here: the SSD tier's latency against a fast
    prefill, then DRAM blocks first against a slow one)."""
    import dataclasses

    from common.config import ClusterConfig
    from common.engine.kv_connector import StoreHint
    from common.metrics import Registry
    from common.sampling_params import SamplingParams
    from services.worker.kv_store_use import decide
    from services.worker.store_source import StoreSource

    engine = make_engine(max_model_len=128)
    store = StoreSource(ClusterConfig(kvstore=True), engine, lambda: None, Registry())  # kvstore_fetch "auto"
    load = engine.begin_load("w", random_prompts([70], seed=46)[0], SamplingParams(max_tokens=4))
    assert load is not None and len(load.block_hashes) == 4
    layout = engine.kv_cache.layout
    for prefill_rate, tiers in ((100_000, (1, 1, 1, 1)), (100, (0, 0, 1, 1)), (100, (1, 1, 1, 1))):
        for _ in range(60):
            store.costs.observe_prefill(prefill_rate, 1.0)
        offer = store.match(dataclasses.replace(load, store_hint=StoreHint(0, tiers)), 0)
        computed_s = store.costs.block_prefill_s()
        fetches = decide("auto", tiers, layout.bytes_per_block, layout.block_size, store.costs.links(),
                         computed_s).fetch
        assert offer.blocks == 4 and (offer.block_s < computed_s) == fetches
        assert fetches == (prefill_rate == 100)
    engine.cancel_load("w")
