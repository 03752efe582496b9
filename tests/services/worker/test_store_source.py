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


def test_a_decode_load_asks_the_store_only_when_it_could_beat_the_pull(make_engine, random_prompts):
    """A lookup delays the pull of the rest: a decode worker's load skips the store while
    even its fastest tier could not fetch the blocks sooner than they are pulled."""
    from common.config import ClusterConfig
    from common.metrics import Registry
    from common.sampling_params import SamplingParams
    from services.worker.store_source import StoreSource

    engine = make_engine(max_model_len=128)
    store = StoreSource(ClusterConfig(kvstore=True), engine, lambda: None, Registry())  # its thread never starts
    prompt = random_prompts([70], seed=43)[0]
    load = engine.begin_load("d", prompt, SamplingParams(max_tokens=4), first_token_id=5)
    assert load is not None and len(load.block_hashes) == 4
    assert not store.start(load, 0) and not store.in_flight  # 4 blocks pulled at the seeded 1 GB/s: ~0.3 ms
    for _ in range(50):
        store.costs.observe_pull(10 << 20, 1.0)  # measured: 10 MiB/s, 6 ms a block
    assert store.start(load, 0) and store.in_flight["d"] == load.dst_block_ids[:4]
    assert store.thread.jobs.get_nowait().keys == load.block_hashes
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


def test_the_store_is_not_asked_for_blocks_the_routers_index_says_it_lacks(make_engine, random_prompts):
    """KvLoad.store_hint (the router's view): a load whose first block to fetch is where the
    store's run ends is not looked up, nor begun for a prompt with no run after the cache;
    where the cache ends elsewhere than the router believes, the store is asked as before;
    a bad hint is refused by name."""
    import dataclasses

    from common.config import ClusterConfig
    from common.engine.kv_connector import StoreHint
    from common.metrics import Registry
    from common.protocol import Generate, Sampling
    from common.sampling_params import InvalidRequestError, SamplingParams
    from services.worker.store_source import StoreSource

    engine = make_engine(max_model_len=128)
    registry = Registry()
    store = StoreSource(ClusterConfig(kvstore=True, kvstore_fetch="always"), engine, lambda: None, registry)
    prompt = random_prompts([70], seed=45)[0]  # 4 full blocks
    load = engine.begin_load("w", prompt, SamplingParams(max_tokens=4))
    assert load is not None and load.first_block == 0 and len(load.block_hashes) == 4

    def known_misses() -> float:
        return registry.collectors.get_sample_value("baton_worker_kvstore_fetch_decisions_total",
                                                    {"decision": "known_miss"}) or 0.0

    def asked(hint: StoreHint | None, start: int) -> tuple[int, ...] | None:
        """The keys the store thread was asked for (None: not asked)."""
        if not store.start(dataclasses.replace(load, store_hint=hint), start):
            return None
        store.in_flight.clear()
        return store.thread.jobs.get_nowait().keys

    assert asked(StoreHint(0, ()), 0) is None  # the store lacks block 0
    assert asked(StoreHint(1, (0, 0)), 3) is None  # blocks 1-2 stored, block 3 not
    assert known_misses() == 2
    assert asked(StoreHint(1, (0, 1)), 1) == load.block_hashes[1:]  # the run starts there: looked up
    assert asked(StoreHint(2, ()), 0) == load.block_hashes  # the cache ends before the router thinks
    assert asked(StoreHint(0, ()), 1) == load.block_hashes[1:]  # ... or after it
    assert asked(None, 0) == load.block_hashes  # no hint: looked up, as before
    engine.cancel_load("w")
    assert not store.may_hold(StoreHint(3, ())) and known_misses() == 3
    assert store.may_hold(None) and store.may_hold(StoreHint(0, (1,)))

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


def test_a_hinted_run_the_cost_model_would_not_fetch_is_not_looked_up(make_engine, random_prompts):
    """With the router's hint the store's tiers are known before a lookup: where `decide`
    would not fetch from them (here: the SSD tier's latency against a fast prefill), the
    store is not asked, and the decision is counted as the lookup would have counted it."""
    import dataclasses

    from common.config import ClusterConfig
    from common.engine.kv_connector import StoreHint
    from common.metrics import Registry
    from common.sampling_params import SamplingParams
    from services.worker.store_source import StoreSource

    engine = make_engine(max_model_len=128)
    registry = Registry()
    store = StoreSource(ClusterConfig(kvstore=True), engine, lambda: None, registry)  # kvstore_fetch "auto"
    load = engine.begin_load("w", random_prompts([70], seed=46)[0], SamplingParams(max_tokens=4))
    assert load is not None and len(load.block_hashes) == 4
    for _ in range(60):
        store.costs.observe_prefill(100_000, 1.0)  # measured: 100k tokens/s, 0.16 ms a block
    assert not store.start(dataclasses.replace(load, store_hint=StoreHint(0, (1, 1, 1, 1))), 0)
    assert not store.in_flight
    assert registry.collectors.get_sample_value("baton_worker_kvstore_fetch_decisions_total",
                                                {"decision": "recompute"}) == 1.0
    for _ in range(60):
        store.costs.observe_prefill(100, 1.0)  # measured: 100 tokens/s, 0.16 s a block
    assert store.start(dataclasses.replace(load, store_hint=StoreHint(0, (0, 0, 1, 1))), 0)
    assert store.thread.jobs.get_nowait().keys == load.block_hashes
    engine.cancel_load("w")
