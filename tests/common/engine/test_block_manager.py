from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

from common.engine.block_manager import BlockManager, BlockManagerError
from common.hashing import chain_hashes

SIZE = 4


class RecordingSink:
    def __init__(self):
        self.stored_names: list[int] = []
        self.removed_names: list[int] = []

    def stored(self, block_hashes):
        self.stored_names.extend(block_hashes)

    def removed(self, block_hashes):
        self.removed_names.extend(block_hashes)


def fill(manager: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate and commit blocks for `tokens` as a sequence would."""
    hashes = chain_hashes(7, tokens, SIZE)
    blocks = manager.allocate(-(-len(tokens) // SIZE))
    manager.commit(blocks, hashes, tokens, 0, len(tokens) // SIZE)
    return blocks, hashes


def test_released_named_blocks_are_cached_and_matched_again():
    sink = RecordingSink()
    manager = BlockManager(8, SIZE, sink)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    blocks, hashes = fill(manager, tokens)
    assert sink.stored_names == hashes
    manager.release(blocks)
    assert manager.num_cached == 2 and manager.num_available == 8
    assert manager.match_prefix(hashes, tokens, max_blocks=10) == blocks[:2]
    manager.check_integrity([])


def test_allocation_prefers_free_blocks_then_evicts_lru_tail_first():
    sink = RecordingSink()
    manager = BlockManager(4, SIZE, sink)
    blocks, hashes = fill(manager, list(range(8)))
    manager.release(blocks)
    fresh = manager.allocate(2)
    assert set(fresh).isdisjoint(blocks) and not sink.removed_names
    manager.allocate(1)  # must evict: the tail block goes first, the prefix survives
    assert sink.removed_names == [hashes[1]]
    assert manager.match_prefix(hashes, list(range(8)), 10) == [blocks[0]]
    manager.check_integrity([fresh, [b for b in blocks if b != blocks[0]]])


def test_shared_block_reference_counting():
    manager = BlockManager(4, SIZE)
    blocks, hashes = fill(manager, list(range(4)))
    manager.take(blocks)
    assert manager.refs(blocks[0]) == 2
    manager.release(blocks)
    assert manager.num_cached == 0  # still referenced once
    manager.release(blocks)
    assert manager.num_cached == 1
    with pytest.raises(BlockManagerError):
        manager.release(blocks)


def test_hash_collision_is_a_miss_not_wrong_kv():
    manager = BlockManager(4, SIZE)
    blocks, hashes = fill(manager, [1, 2, 3, 4])
    manager.release(blocks)
    assert manager.match_prefix(hashes, [9, 9, 9, 9], 10) == []


def test_a_collision_deeper_in_the_prefix_ends_the_match_there():
    manager = BlockManager(8, SIZE)
    tokens = list(range(1, 3 * SIZE + 1))
    blocks, hashes = fill(manager, tokens)
    manager.release(blocks)
    assert manager.match_prefix(hashes, tokens, 10) == blocks
    forged = tokens[:SIZE] + [0] + tokens[SIZE + 1:]  # block 1's tokens differ, its name does not
    assert manager.match_prefix(hashes, forged, 10) == blocks[:1]
    assert manager.match_prefix(hashes, tokens, 2) == blocks[:2]


def test_duplicate_computation_keeps_one_name():
    manager = BlockManager(4, SIZE)
    first, hashes = fill(manager, [1, 2, 3, 4])
    second, _ = fill(manager, [1, 2, 3, 4])
    assert manager.named(hashes[0]).block_id == first[0]
    assert manager.record(second[0]) is None
    manager.release(second)
    manager.release(first)
    manager.check_integrity([])
    assert manager.num_cached == 1


def test_integrity_check_catches_corruption():
    manager = BlockManager(4, SIZE)
    blocks = manager.allocate(2)
    manager.check_integrity([blocks])
    with pytest.raises(BlockManagerError):
        manager.check_integrity([blocks[:1]])
    manager.free_blocks.append(blocks[0])
    with pytest.raises(BlockManagerError):
        manager.check_integrity([blocks])


def test_over_allocation_is_refused():
    manager = BlockManager(2, SIZE)
    with pytest.raises(BlockManagerError):
        manager.allocate(3)


operation = st.one_of(
    st.tuples(st.just("new"), st.integers(0, 3), st.integers(1, 14)),  # family, length
    st.tuples(st.just("release"), st.integers(0, 20), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=40))
def test_random_workloads_keep_integrity(ops):
    manager = BlockManager(12, SIZE, RecordingSink())
    live: list[list[int]] = []
    families = [[f * 100 + i for i in range(16)] for f in range(4)]
    for kind, a, b in ops:
        if kind == "new":
            tokens = families[a][:b]
            hashes = chain_hashes(7, tokens, SIZE)
            hits = manager.match_prefix(hashes, tokens, (len(tokens) - 1) // SIZE)
            fresh = -(-len(tokens) // SIZE) - len(hits)
            if manager.blocks_to_take(hits, fresh) > manager.num_available:
                continue
            manager.take(hits)
            blocks = hits + manager.allocate(fresh)
            manager.commit(blocks, hashes, tokens, len(hits), len(tokens) // SIZE)
            live.append(blocks)
        elif live:
            manager.release(live.pop(a % len(live)))
        manager.check_integrity(live)
        assert manager.num_used == len({b for table in live for b in table})


def test_blocks_named_over_several_commits_match_as_one_prefix():
    manager = BlockManager(8, SIZE)
    tokens = list(range(1, 3 * SIZE + 1))
    hashes = chain_hashes(7, tokens, SIZE)
    blocks = manager.allocate(3)
    manager.commit(blocks, hashes, tokens, 0, 1)  # a first chunk fills block 0
    manager.commit(blocks, hashes, tokens, 1, 3)  # the next fills blocks 1 and 2
    manager.release(blocks)
    assert manager.match_prefix(hashes, tokens, 10) == blocks


def test_named_blocks_record_their_chain_and_reuse_and_evictions_are_reported_intact():
    manager = BlockManager(4, SIZE)
    seen: list = []
    manager.on_evict = lambda blocks: seen.append([(b, manager.refs(b.block_id)) for b in blocks])
    tokens = list(range(1, 2 * SIZE + 1))
    hashes = chain_hashes(7, tokens, SIZE)
    blocks = manager.allocate(2)
    manager.commit(blocks, hashes, tokens, 0, 2, root=7)
    assert [manager.record(b).parent for b in blocks] == [7, hashes[0]]
    assert [manager.record(b).root for b in blocks] == [7, 7]
    manager.release(blocks)
    hit = manager.match_prefix(hashes, tokens, 1)
    manager.take(hit)
    assert manager.record(blocks[0]).hits == 1 and manager.record(blocks[1]).hits == 0
    manager.release(hit)
    assert manager.allocate(2) and seen == []  # free blocks first: no eviction
    manager.allocate(2)  # evicts block 1 (released last, so least recent), then block 0
    assert [[entry for entry, _ in batch] for batch in seen] == [[
        (blocks[1], hashes[1], hashes[0], 7, 0), (blocks[0], hashes[0], 7, 7, 1)]]
    assert manager.record(blocks[0]) is None  # handed out again, unnamed
    manager.check_integrity([[0], [1], [2], [3]])


class ReferenceManager:
    """The bookkeeping's contract kept block by block, the plainest way: a dict per block
    field and an OrderedDict LRU. The manager must make every decision this model makes,
    however it keeps its state (a manager that keeps it per run of blocks too)."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self.touched = num_blocks, 0
        self.refs: dict[int, int] = {}
        self.chain: dict[int, tuple[int, int | None, int | None, list[int]]] = {}  # name, parent, root, tokens
        self.hits: dict[int, int] = {}
        self.by_name: dict[int, int] = {}
        self.free: list[int] = []
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.stored: list[int] = []
        self.removed: list[int] = []
        self.evicted: list[tuple] = []

    def available(self) -> int:
        return self.num_blocks - self.touched + len(self.free) + len(self.lru)

    def match(self, hashes, tokens, max_blocks):
        found = []
        for index, name in enumerate(hashes[:max_blocks]):
            block = self.by_name.get(name)
            if block is None or self.chain[block][3] != list(tokens[index * SIZE:(index + 1) * SIZE]):
                break
            found.append(block)
        return found

    def take(self, blocks):
        for block in blocks:
            self.hits[block] = self.hits.get(block, 0) + 1
            if self.refs.get(block, 0) == 0:
                del self.lru[block]
            self.refs[block] = self.refs.get(block, 0) + 1

    def allocate(self, count):
        fresh = list(range(self.touched, self.touched + min(count, self.num_blocks - self.touched)))
        self.touched += len(fresh)
        while len(fresh) < count and self.free:
            fresh.append(self.free.pop(0))
        evicted = []
        while len(fresh) < count:
            block = self.lru.popitem(last=False)[0]
            name, parent, root, _ = self.chain.pop(block)
            evicted.append((block, name, parent, root, self.hits.pop(block, 0)))
            del self.by_name[name]
            fresh.append(block)
        if evicted:
            self.evicted.append(evicted)
            self.removed += [entry[1] for entry in evicted]
        for block in fresh:
            self.refs[block] = 1
        return fresh

    def retain(self, blocks):
        for block in blocks:
            self.refs[block] += 1

    def release(self, blocks):
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.chain:
                    self.lru[block] = None
                else:
                    self.free.append(block)

    def commit(self, blocks, hashes, tokens, first, last, root):
        for index in range(first, last):
            block, name = blocks[index], hashes[index]
            if block in self.chain or name in self.by_name:
                continue
            parent = root if index == 0 else hashes[index - 1]
            self.chain[block] = (name, parent, root, list(tokens[index * SIZE:(index + 1) * SIZE]))
            self.hits[block] = 0
            self.by_name[name] = block
            self.stored.append(name)


# Prompts share prefixes (four families) and two families collide: the same hashes over
# other tokens, as a forged or colliding prompt would.
lifecycle = st.one_of(
    st.tuples(st.just("new"), st.integers(0, 4), st.integers(1, 24), st.integers(1, 3)),  # family, length, chunk blocks
    st.tuples(st.just("release"), st.integers(0, 30), st.just(0), st.just(0)),
    st.tuples(st.just("reset"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("squeeze"), st.integers(1, 40), st.just(0), st.just(0)),  # evicts up to that many
    st.tuples(st.just("lease"), st.integers(0, 30), st.integers(0, 6), st.integers(1, 6)),  # table, start, blocks
)


@settings(max_examples=300, deadline=None)
@given(st.lists(lifecycle, max_size=60), st.integers(6, 40))
def test_every_decision_is_the_block_by_block_contracts(ops, num_blocks):
    sink = RecordingSink()
    manager = BlockManager(num_blocks, SIZE, sink)
    evicted: list = []
    manager.on_evict = lambda blocks: evicted.append([tuple(block) for block in blocks])
    model = ReferenceManager(num_blocks)
    families = [[f * 1000 + i for i in range(24)] for f in range(4)]
    families.append([9999 - i for i in range(24)])
    live: list[list[int]] = []
    for kind, a, b, chunk in ops:
        if kind == "new":
            tokens = families[a][:b]
            hashes = chain_hashes(7, families[min(a, 3)][:b], SIZE)  # family 4 forges family 3's names
            root = 7 if a % 2 else None
            max_hit = (len(tokens) - 1) // SIZE
            hits = manager.match_prefix(hashes, tokens, max_hit)
            assert hits == model.match(hashes, tokens, max_hit)
            fresh = -(-len(tokens) // SIZE) - len(hits)
            if manager.blocks_to_take(hits, fresh) > manager.num_available:
                assert fresh + sum(model.refs.get(h, 0) == 0 for h in hits) > model.available()
                continue
            manager.take(hits)
            model.take(hits)
            new = manager.allocate(fresh)
            assert new == model.allocate(fresh)
            blocks = hits + new
            for first in range(len(hits), len(tokens) // SIZE, chunk):  # a chunk at a time
                last = min(first + chunk, len(tokens) // SIZE)
                manager.commit(blocks, hashes, tokens, first, last, root)
                model.commit(blocks, hashes, tokens, first, last, root)
            live.append(blocks)
        elif kind == "release" and live:
            table = live.pop(a % len(live))
            manager.release(table)
            model.release(table)
        elif kind == "lease" and live:  # a second holder of part of a table (P/D's KV lease)
            table = live[a % len(live)]
            lease = table[b:b + chunk]
            if lease:
                manager.retain(lease)
                model.retain(lease)
                live.append(lease)
        elif kind == "squeeze":  # a burst of unnamed blocks, given back at once
            count = min(a, manager.num_available)
            burst = manager.allocate(count)
            assert burst == model.allocate(count)
            manager.release(burst)
            model.release(burst)
        elif kind == "reset":
            removed = manager.reset_prefix_cache()
            cached = list(model.lru)
            for block in cached:
                name = model.chain.pop(block)[0]
                del model.by_name[name]
                model.hits.pop(block, None)
                model.removed.append(name)
            model.free += cached
            model.lru.clear()
            assert removed == len(cached)
        manager.check_integrity(live)
        assert list(manager.cached_blocks) == list(model.lru)
        assert list(manager.free_blocks) == model.free
        assert manager.num_available == model.available()
        assert sink.stored_names == model.stored and sink.removed_names == model.removed
        assert evicted == model.evicted
        assert {name: manager.named(name).block_id for name in manager.names()} == model.by_name
        assert {block: manager.record(block)[1:] for block in model.chain} == \
            {block: (name, parent, root, model.hits.get(block, 0))
             for block, (name, parent, root, _) in model.chain.items()}
        assert all(manager.refs(block) == model.refs.get(block, 0) for block in range(num_blocks))


def test_a_sequence_named_chunk_by_chunk_is_one_run_and_a_shared_prefix_cuts_it_once():
    manager = BlockManager(64, SIZE)
    tokens = list(range(1, 12 * SIZE + 1))
    hashes = chain_hashes(7, tokens, SIZE)
    blocks = manager.allocate(12)
    for first in range(0, 12, 3):  # prefill chunks of three blocks each
        manager.commit(blocks, hashes, tokens, first, first + 3, root=7)
    assert len(manager.runs()) == 1
    manager.release(blocks)
    assert len(manager.runs()) == 1 and list(manager.cached_blocks) == blocks[::-1]
    other = tokens[:5 * SIZE] + [999] * (3 * SIZE)  # shares five blocks, then diverges
    other_hashes = chain_hashes(7, other, SIZE)
    hits = manager.match_prefix(other_hashes, other, 7)
    assert hits == blocks[:5]
    manager.take(hits)
    fresh = manager.allocate(3)
    manager.commit(hits + fresh, other_hashes, other, 5, 8, root=7)
    assert sorted(len(run.block_ids) for run in manager.runs()) == [3, 5, 7]  # taken, cached tail, new
    assert list(manager.cached_blocks) == blocks[5:][::-1]
    manager.check_integrity([hits + fresh])
    manager.release(hits + fresh)
    assert list(manager.cached_blocks) == blocks[5:][::-1] + fresh[::-1] + hits[::-1]
    manager.check_integrity([])
