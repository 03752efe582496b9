"""The engine's side of the KV store (docs/architecture.md §8): a prompt's blocks fetched
into fresh blocks give the same greedy tokens as computing them (fp32) while only the rest
of the prompt is computed; evicted blocks are staged for write-back root-first, bounded."""
from __future__ import annotations

import numpy as np
import pytest

from common.engine.engine import Engine
from common.engine.kv_connector import KnownBlocks, Writeback, WritebackConfig, WritebackQueue
from common.hashing import chain_hashes
from common.sampling_params import SamplingParams

SIZE = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def source(make_engine):
    return make_engine()


@pytest.fixture
def fresh(make_engine):
    return make_engine(max_model_len=256)


def names(engine: Engine, prompt: list[int]) -> list[int]:
    return chain_hashes(engine._root_hash(""), prompt, SIZE)


def computed_values(engine: Engine, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Compute `prompt` on `engine`: its greedy tokens and its full blocks' values."""
    tokens = engine.generate([prompt], GREEDY)[0].token_ids
    full = len(prompt) // SIZE
    blocks = engine.block_manager.match_prefix(names(engine, prompt), prompt, full)
    assert len(blocks) == full
    return tokens, engine.read_blocks(blocks)


def run(engine: Engine, request_id: str) -> tuple[list[int], int]:
    """Step until the request ends: its tokens and its cached prompt tokens."""
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.new_token_ids
                if output.finished:
                    return tokens, output.num_cached_tokens
    raise AssertionError(f"{request_id} did not finish")


@pytest.mark.parametrize("landed", [4, 2, 0])
def test_fetched_blocks_give_the_computed_tokens_computing_only_the_rest(source, fresh, random_prompts, landed):
    prompt = random_prompts([70], seed=3)[0]  # 4 full blocks, the last token in block 4
    expected, values = computed_values(source, prompt)
    fetch = fresh.begin_load("f", prompt, GREEDY)
    assert fetch is not None and fetch.first_block == 0 and not fetch.through_prompt_end
    assert list(fetch.block_hashes) == names(fresh, prompt)[:4] and fetch.namespace == fresh._root_hash("")
    assert not fresh.has_unfinished()  # waiting for its KV, not schedulable
    fresh.check_integrity()
    fresh.write_blocks(fetch.dst_block_ids[:landed], values[:landed])
    assert fresh.complete_load("f", landed) == []
    tokens, cached = run(fresh, "f")
    assert tokens == expected
    assert cached == landed * SIZE
    # The prefill computed the prompt past the landed blocks; each decode step one token.
    assert fresh.stats.num_computed_tokens == (70 - landed * SIZE) + (GREEDY.max_tokens - 1)
    assert fresh.stats.num_fetched_tokens == landed * SIZE
    fresh.check_integrity()
    # Landed and computed blocks alike are in the prefix cache now.
    assert len(fresh.block_manager.match_prefix(names(fresh, prompt), prompt, 4)) == 4


def test_a_fetch_starts_after_the_local_prefix_hit(source, fresh, random_prompts):
    prompt = random_prompts([70], seed=4)[0]
    expected, values = computed_values(source, prompt)
    fresh.generate([prompt[:40]], GREEDY)  # caches blocks 0 and 1 locally
    fetch = fresh.begin_load("f", prompt, GREEDY)
    assert fetch is not None and fetch.first_block == 2
    assert list(fetch.block_hashes) == names(fresh, prompt)[2:4] and len(fetch.dst_block_ids) == 2
    computed_before = fresh.stats.num_computed_tokens
    fresh.write_blocks(fetch.dst_block_ids, values[2:4])
    fresh.complete_load("f", 2)
    assert run(fresh, "f") == (expected, 64)
    assert fresh.stats.num_computed_tokens - computed_before == 6 + GREEDY.max_tokens - 1


def test_no_fetch_without_a_block_past_the_cache_before_the_last_token(fresh, random_prompts):
    assert fresh.begin_load("short", random_prompts([16], seed=5)[0]) is None  # its one block holds the last token
    prompt = random_prompts([40], seed=6)[0]
    fresh.generate([prompt], GREEDY)
    assert fresh.begin_load("cached", prompt, plan=lambda load: 8) is None  # both full blocks are cached
    shown = []
    assert fresh.begin_load("none", random_prompts([40], seed=7)[0], plan=lambda load: shown.append(load) or 0) is None
    assert [(load.first_block, len(load.block_hashes), load.dst_block_ids) for load in shown] == [(0, 2, ())]
    fresh.check_integrity()
    assert fresh.block_manager.num_used == 0
    fresh.add_request("short", random_prompts([16], seed=5)[0], GREEDY)  # nothing was registered
    run(fresh, "short")


def test_an_abort_while_fetching_keeps_the_blocks_until_the_fetch_completes(fresh, random_prompts):
    prompt = random_prompts([70], seed=8)[0]
    fetch = fresh.begin_load("f", prompt, GREEDY)
    assert fetch is not None
    assert fresh.abort("f")
    assert fresh.block_manager.num_used == 4  # a late copy may still land in them
    fresh.check_integrity()
    with pytest.raises(ValueError):
        fresh.complete_load("f", 5)
    assert fresh.complete_load("f", 0) == []
    assert fresh.block_manager.num_used == 0 and not fresh.has_unfinished()
    with pytest.raises(KeyError):
        fresh.complete_load("f", 0)
    fresh.check_integrity()


def add_writeback(engine: Engine, config: WritebackConfig, known: KnownBlocks) -> WritebackQueue:
    """The KV store's write-back as the engine's sink, as StoreSource adds it; its queue."""
    sink = Writeback(config, known, engine.block_manager, engine.read_blocks)
    engine.add_sink(sink)
    return sink.queue


def test_evicted_blocks_are_staged_root_first_with_their_values(make_engine, random_prompts):
    engine = make_engine(max_model_len=64, num_kv_blocks=8)
    known = KnownBlocks(1000)
    queue = add_writeback(engine, WritebackConfig(queue_blocks=64), known)
    first, other = random_prompts([64, 100], seed=9)
    first = first[:63]  # 3 full blocks, and a partial one that is never named
    engine.generate([first], SamplingParams(max_tokens=1, temperature=0.0))
    chain = names(engine, first)
    held = engine.block_manager.match_prefix(chain, first, 3)
    values = engine.read_blocks(held)
    assert queue.pop_all() is None
    engine.generate([other[:60]], SamplingParams(max_tokens=4, temperature=0.0))  # needs 4 of 8 blocks
    engine.generate([other[60:100]], SamplingParams(max_tokens=20, temperature=0.0))  # more: evicts the rest
    staged = queue.pop_all()  # every eviction's batch, in order
    assert staged is not None
    root = engine._root_hash("")
    mine = [i for i, key in enumerate(staged.keys) if key in chain]
    assert [staged.keys[i] for i in mine] == chain  # root-first, each once
    assert [staged.parents[i] for i in mine] == [root, *chain[:2]]
    assert all(staged.namespaces[i] == root for i in mine)
    assert np.array_equal(staged.values[mine], values)
    assert all((root, key) in known for key in chain)  # not staged again
    assert queue.pop_all() is None and queue.oldest_age_s() == 0.0
    assert queue.num_blocks == 0 and queue.dropped_blocks == 0


def test_a_full_queue_drops_and_counts_and_min_hits_filters(make_engine, random_prompts):
    engine = make_engine(max_model_len=64, num_kv_blocks=8)
    queue = add_writeback(engine, WritebackConfig(queue_blocks=2), KnownBlocks(1000))
    prompts = random_prompts([48] * 5, seed=10)
    for prompt in prompts[:3]:
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert queue.num_blocks <= 2 and queue.dropped_blocks > 0
    assert queue.staged_blocks + queue.dropped_blocks >= 3  # the first prompt's 3 blocks were evicted
    staged = queue.pop_all()
    assert staged is not None and staged.parents[0] == staged.namespaces[0]  # a kept prefix starts at the root

    picky = make_engine(max_model_len=64, num_kv_blocks=8)
    queue = add_writeback(picky, WritebackConfig(queue_blocks=64, min_hits=1), KnownBlocks(1000))
    reused = prompts[0]
    picky.generate([reused], SamplingParams(max_tokens=1, temperature=0.0))
    picky.generate([reused[:40] + [5] * 8], SamplingParams(max_tokens=1, temperature=0.0))  # reuses 2 blocks
    for prompt in prompts[1:]:
        picky.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    batch = queue.pop_all()
    keys = list(batch.keys) if batch is not None else []
    chain = names(picky, reused)
    assert chain[0] in keys and chain[1] in keys  # reused once each
    assert chain[2] not in keys  # never reused, no descendant staged it
    picky.check_integrity()


class EvictionLog:
    """A sink that keeps the names of the blocks it is told were evicted."""

    name = "log"

    def __init__(self) -> None:
        self.names: list[int] = []

    def evicted(self, blocks) -> None:
        self.names += [block.name for block in blocks]

    def held(self, *args) -> None:
        return None


def test_every_sink_is_told_of_each_eviction_and_the_lease_still_holds(make_engine, random_prompts):
    """Two sinks beside the engine's leases: both see the same evictions (the write-back
    stages each, with its ancestors the store lacks), and a held request's prompt still
    goes under a lease, as the first sink that answers one."""
    engine = make_engine(max_model_len=64, num_kv_blocks=8)
    log = EvictionLog()
    engine.add_sink(log)
    queue = add_writeback(engine, WritebackConfig(queue_blocks=64), KnownBlocks(1000))
    prompts = random_prompts([48] * 4, seed=12)
    for prompt in prompts:
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    staged = queue.pop_all()
    assert staged is not None and log.names and set(log.names) <= set(staged.keys)  # with cached ancestors
    engine.add_request("held", prompts[0], SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    [lease] = [output.kv_lease for output in engine.step() if output.finished]
    assert lease is not None and len(lease.block_ids) == 3 and engine.leases.num_blocks == 3
    engine.release_lease(lease.lease_id, "held")
    engine.check_integrity()
