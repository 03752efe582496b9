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
    assert manager.ref_counts[blocks[0]] == 2
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
    assert manager.hash_to_block[hashes[0]] == first[0]
    assert manager.block_hash[second[0]] is None
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
    manager.on_evict = lambda blocks: seen.append([(b, manager.ref_counts[b.block_id]) for b in blocks])
    tokens = list(range(1, 2 * SIZE + 1))
    hashes = chain_hashes(7, tokens, SIZE)
    blocks = manager.allocate(2)
    manager.commit(blocks, hashes, tokens, 0, 2, root=7)
    assert [manager.block_parent[b] for b in blocks] == [7, hashes[0]]
    assert [manager.block_root[b] for b in blocks] == [7, 7]
    manager.release(blocks)
    hit = manager.match_prefix(hashes, tokens, 1)
    manager.take(hit)
    assert manager.block_hits[blocks[0]] == 1 and manager.block_hits[blocks[1]] == 0
    manager.release(hit)
    assert manager.allocate(2) and seen == []  # free blocks first: no eviction
    manager.allocate(2)  # evicts block 1 (released last, so least recent), then block 0
    assert [[entry for entry, _ in batch] for batch in seen] == [[
        (blocks[1], hashes[1], hashes[0], 7, 0), (blocks[0], hashes[0], 7, 7, 1)]]
    assert manager.block_parent[blocks[0]] is None and manager.block_hits[blocks[0]] == 0
    manager.check_integrity([[0], [1], [2], [3]])
