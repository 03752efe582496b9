"""The router's prefix index (docs/router.md §2) on hand-built KV event streams."""
import numpy as np

from common.hashing import chain_hashes, root_hash
from services.router.index import SEGMENT_BLOCKS, PrefixIndex

BLOCK = 4
ROOT = root_hash("model", "tokenizer", "", "bfloat16", BLOCK)


def tokens(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, count).astype(np.uint32)


def as_bytes(token_ids, block: int = BLOCK) -> list[bytes]:
    """The prompt's block keys, as the router walks them."""
    return PrefixIndex(block).block_keys(np.ascontiguousarray(token_ids, dtype="<u4").tobytes())


def hashes(token_ids, root: int = ROOT) -> list[int]:
    return chain_hashes(root, token_ids, BLOCK)


def match(index: PrefixIndex, token_ids, now: float = 0.0, root: int = ROOT) -> dict[str, int]:
    index.expire(now)
    return index.match(index.walk(root, as_bytes(token_ids)))


# ---- walk -----------------------------------------------------------------------------


def test_walk_on_an_empty_index_finds_nothing():
    index = PrefixIndex(BLOCK)
    assert index.walk(ROOT, as_bytes(tokens(1, 40))) == []
    assert index.walk(ROOT, index.block_keys(b"")) == []
    assert len(index) == 0
    assert match(index, tokens(1, 40)) == {}


def test_walk_names_blocks_with_the_engine_chain_hash():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK + 3)  # a trailing partial block is never named
    expected = hashes(prompt)
    assert len(expected) == 10
    index.stored("a", expected, 0.0)
    path = index.walk(ROOT, as_bytes(prompt))
    assert [node.block_hash for node in path] == expected
    assert [node.depth for node in path] == list(range(10))
    # A second walk goes through the cached children and agrees.
    again = index.walk(ROOT, as_bytes(prompt))
    assert [node.block_hash for node in again] == expected
    assert all(first is second for first, second in zip(path, again))


def test_a_prompt_diverging_at_block_k_walks_exactly_k_blocks():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK)
    index.stored("a", hashes(prompt), 0.0)
    for k in (0, 1, 4, 9):
        other = prompt.copy()
        other[k * BLOCK + BLOCK - 1] += 1  # change the last token of block k
        path = index.walk(ROOT, as_bytes(other))
        assert len(path) == k
        assert [node.block_hash for node in path] == hashes(prompt)[:k]
        assert match(index, other) == ({"a": k} if k else {})


def test_a_block_with_one_two_or_no_children_walks_to_each_and_forgets_each():
    """A node keeps one child bare and two or more in a dict: every shape walks and forgets alike."""
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 6 * BLOCK)
    branches = []
    for k in range(3):  # three prompts sharing blocks 0..2 and differing from block 3
        other = prompt.copy()
        other[3 * BLOCK] += k
        branches.append(other)
        index.stored(f"w{k}", hashes(other), 0.0)
        assert [node.block_hash for node in index.walk(ROOT, as_bytes(other))] == hashes(other)
    fork = index.nodes[hashes(prompt)[2]]
    assert isinstance(fork.children, dict) and len(fork.children) == 3
    assert index.nodes[hashes(prompt)[1]].children is fork  # one child: no dict
    for k in (0, 2, 1):  # forget each branch's blocks 3..5: the others still walk whole
        index.removed(f"w{k}", hashes(branches[k])[3:])
        assert len(index.walk(ROOT, as_bytes(branches[k]))) == 3
        for j in range(3):
            alive = j in ((1, 2) if k == 0 else (1,) if k == 2 else ())
            assert len(index.walk(ROOT, as_bytes(branches[j]))) == (6 if alive else 3)
    assert hashes(prompt)[4] not in index.nodes  # nobody holds branch 0's tail any more
    index.removed("w0", hashes(branches[0])[1:3])  # w1, w2 still hold blocks 1, 2
    assert len(index.walk(ROOT, as_bytes(prompt))) == 3
    for k in (1, 2):
        index.removed(f"w{k}", hashes(branches[k])[2:3])
    assert index.nodes[hashes(prompt)[1]].children is None  # its only child forgotten
    assert len(index.walk(ROOT, as_bytes(prompt))) == 2
    index.stored("w0", hashes(prompt)[2:], 1.0)  # stored again: linked again, bare
    assert [node.block_hash for node in index.walk(ROOT, as_bytes(prompt))] == hashes(prompt)
    assert index.nodes[hashes(prompt)[1]].children is index.nodes[hashes(prompt)[2]]


def test_a_shorter_prompt_walks_only_its_full_blocks():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK)
    index.stored("a", hashes(prompt), 0.0)
    assert len(index.walk(ROOT, as_bytes(prompt[:3 * BLOCK + 2]))) == 3
    assert index.walk(ROOT, as_bytes(prompt[:BLOCK - 1])) == []


def test_a_stored_event_holds_the_named_nodes_down_linked_and_branching_chains():
    """stored() reads a block from its predecessor's child where it can: along a linked
    chain, past a branch (a node with two children), and for blocks never linked, it
    must hold exactly the index's node of each hash and leave one node per hash."""
    index = PrefixIndex(BLOCK)
    shared = tokens(1, 6 * BLOCK)
    left = np.concatenate([shared, tokens(2, 5 * BLOCK)])
    right = np.concatenate([shared, tokens(3, 5 * BLOCK)])
    for worker_id, prompt in (("a", left), ("b", right)):  # credits, named and linked by the walks
        keys = as_bytes(prompt)
        index.expect(worker_id, ROOT, keys, index.walk(ROOT, keys), 0, 0.0)
    index.name_credits()
    branch = index.nodes[hashes(shared)[-1]]
    assert isinstance(branch.children, dict) and len(branch.children) == 2
    unlinked = hashes(tokens(4, 3 * BLOCK), root=hashes(right)[-1])  # hashes only, never walked
    skip = hashes(shared)[:3] + unlinked[1:2]  # a block whose predecessor's one child is another
    events = [("c", hashes(left)), ("c", hashes(right)), ("c", hashes(right)[4:] + unlinked), ("d", unlinked),
              ("e", skip)]
    for worker_id, event in events:
        index.stored(worker_id, event, 1.0)
    named = hashes(left) + hashes(right)[6:] + unlinked
    assert len(index) == len(set(named)) == len(named)
    for block_hash in named:
        node = index.nodes[block_hash]
        assert node.block_hash == block_hash
    assert {h for h, node in index.nodes.items() if "c" in index.holders(node)} == set(named)
    assert {h for h, node in index.nodes.items() if "d" in index.holders(node)} == set(unlinked)
    assert {h for h, node in index.nodes.items() if "e" in index.holders(node)} == set(skip)
    assert match(index, right) == {"a": 6, "b": 11, "c": 11, "e": 3}
    assert match(index, left) == {"a": 11, "b": 6, "c": 11, "e": 3}


# ---- match ----------------------------------------------------------------------------


def test_match_counts_each_workers_leading_blocks():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK)
    chain = hashes(prompt)
    index.stored("A", chain, 0.0)
    index.stored("B", chain[:5], 0.0)
    index.stored("C", chain[:3] + chain[4:], 0.0)  # all but block 3
    index.stored("D", chain[1:], 0.0)  # a later block but not block 0
    index.stored("E", chain[5:7], 0.0)
    assert match(index, prompt) == {"A": 10, "B": 5, "C": 3}


def test_match_stops_at_the_prompt_end_and_at_the_first_unnamed_block():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK)
    chain = hashes(prompt)
    index.stored("A", chain, 0.0)
    index.stored("B", chain[:2], 0.0)
    assert match(index, prompt[:6 * BLOCK]) == {"A": 6, "B": 2}
    extended = np.concatenate([prompt, tokens(2, 5 * BLOCK)])
    assert match(index, extended) == {"A": 10, "B": 2}


# ---- removed / drop_worker ------------------------------------------------------------


def test_removing_a_block_cuts_that_workers_match_only():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK)
    chain = hashes(prompt)
    index.stored("A", chain, 0.0)
    index.stored("B", chain, 0.0)
    assert len(index) == 10
    index.removed("A", [chain[6]])
    assert match(index, prompt) == {"A": 6, "B": 10}
    assert len(index) == 10  # B still holds block 6
    assert index.num_blocks("A") == 9
    assert chain[6] not in [node.block_hash for node in index.lru_blocks("A")]


def test_a_block_nobody_holds_leaves_the_index_and_is_not_walked():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 10 * BLOCK)
    chain = hashes(prompt)
    index.stored("A", chain, 0.0)
    index.stored("B", chain[:8], 0.0)
    assert len(index.walk(ROOT, as_bytes(prompt))) == 10  # links the children
    index.removed("A", [chain[4]])
    assert len(index) == 10
    index.removed("B", [chain[4]])
    assert len(index) == 9
    assert chain[4] not in index.nodes
    path = index.walk(ROOT, as_bytes(prompt))
    assert [node.block_hash for node in path] == chain[:4]
    assert match(index, prompt) == {"A": 4, "B": 4}
    # Removing what a worker never held, or an unknown block, changes nothing.
    index.removed("C", [chain[0]])
    index.removed("A", [12345])
    assert len(index) == 9
    # Stored again, the block is walked again through the new node.
    index.stored("A", [chain[4]], 1.0)
    path = index.walk(ROOT, as_bytes(prompt))
    assert [node.block_hash for node in path] == chain
    assert match(index, prompt, 1.0) == {"A": 10, "B": 4}


def test_drop_worker_forgets_only_that_workers_blocks():
    index = PrefixIndex(BLOCK)
    shared, own = tokens(1, 6 * BLOCK), tokens(2, 4 * BLOCK)
    index.stored("A", hashes(shared), 0.0)
    index.stored("A", hashes(own), 0.0)
    index.stored("B", hashes(shared)[:3], 0.0)
    assert len(index) == 10
    index.drop_worker("A")
    assert len(index) == 3
    assert index.num_blocks("A") == 0
    assert list(index.lru_blocks("A")) == []
    assert match(index, shared) == {"B": 3}
    assert match(index, own) == {}
    assert index.walk(ROOT, as_bytes(own)) == []
    index.drop_worker("A")  # twice, or an unknown worker: nothing happens
    index.drop_worker("nobody")
    assert len(index) == 3


# ---- tenant salt ------------------------------------------------------------------------


def test_different_tenant_salts_never_share_blocks():
    index = PrefixIndex(BLOCK)
    root_a = root_hash("model", "tokenizer", "", "bfloat16", BLOCK, tenant_salt="a")
    root_b = root_hash("model", "tokenizer", "", "bfloat16", BLOCK, tenant_salt="b")
    assert root_a != root_b
    prompt = tokens(1, 8 * BLOCK)
    chain_a, chain_b = hashes(prompt, root_a), hashes(prompt, root_b)
    assert not set(chain_a) & set(chain_b)
    index.stored("A", chain_a, 0.0)
    assert match(index, prompt, root=root_a) == {"A": 8}
    assert index.walk(ROOT, as_bytes(prompt)) == []  # nor the unsalted root
    assert match(index, prompt, root=root_b) == {}
    index.stored("B", chain_b, 0.0)
    assert match(index, prompt, root=root_a) == {"A": 8}
    assert match(index, prompt, root=root_b) == {"B": 8}


# ---- hits over a sliding window ---------------------------------------------------------


def test_hits_count_the_current_and_previous_half_window():
    index = PrefixIndex(BLOCK, window_s=10.0)  # half-windows of 5 s
    prompt = tokens(1, 3 * BLOCK)
    index.stored("A", hashes(prompt), 0.0)
    path = index.walk(ROOT, as_bytes(prompt))
    assert index.hits(path[0], 0.0) == 0
    for _ in range(2):
        index.record_hits(path[:2], "A", 1.0)
    assert [index.hits(node, 1.0) for node in path] == [2, 2, 0]
    for _ in range(3):
        index.record_hits(path[:1], "A", 6.0)
    assert [index.hits(node, 6.0) for node in path] == [5, 2, 0]
    assert [index.hits(node, 11.0) for node in path] == [3, 0, 0]  # only the hits at 6 s remain
    assert [index.hits(node, 16.0) for node in path] == [0, 0, 0]  # a full window without hits
    # Counting starts again from zero after a quiet window.
    index.record_hits(path[:1], "A", 30.0)
    assert index.hits(path[0], 30.0) == 1
    assert index.hits(path[0], 36.0) == 1
    assert index.hits(path[0], 41.0) == 0


def test_hits_after_a_skipped_half_window_drop_the_old_counts():
    index = PrefixIndex(BLOCK, window_s=10.0)
    prompt = tokens(1, BLOCK)
    index.stored("A", hashes(prompt), 0.0)
    node = index.walk(ROOT, as_bytes(prompt))[0]
    for _ in range(4):
        index.record_hits([node], "A", 1.0)  # epoch 0
    index.record_hits([node], "A", 11.0)  # epoch 2: epoch 0 is a full window ago
    assert index.hits(node, 11.0) == 1


# ---- LRU ------------------------------------------------------------------------------


def test_lru_blocks_come_least_recent_first_and_hits_refresh_them():
    index = PrefixIndex(BLOCK)
    first, second = tokens(1, 3 * BLOCK), tokens(2, 2 * BLOCK)
    index.stored("A", hashes(first), 0.0)
    index.stored("A", hashes(second), 1.0)
    index.stored("B", hashes(first), 2.0)
    order = [node.block_hash for node in index.lru_blocks("A")]
    assert order == hashes(first) + hashes(second)
    path = index.walk(ROOT, as_bytes(first))
    index.record_hits(path[:2], "A", 3.0)
    order = [node.block_hash for node in index.lru_blocks("A")]
    assert order == hashes(first)[2:] + hashes(second) + hashes(first)[:2]
    # Hits on A move nothing for B; storing again refreshes too.
    assert [node.block_hash for node in index.lru_blocks("B")] == hashes(first)
    index.stored("B", hashes(first)[:1], 4.0)
    assert [node.block_hash for node in index.lru_blocks("B")] == hashes(first)[1:] + hashes(first)[:1]
    assert list(index.lru_blocks("nobody")) == []


def test_a_large_lru_keeps_a_recently_touched_prefix_in_place_until_half_of_it_turns_over():
    """On a big LRU (more than EXACT_LRU_BLOCKS), reusing the same prefix again soon only
    counts the hit: the prefix is still in the recent half. Once half the LRU has turned
    over, the next reuse moves it to the recent end again."""
    index = PrefixIndex(BLOCK)
    prefix = tokens(1, 4 * BLOCK)
    index.stored("A", hashes(prefix), 0.0)
    index.stored("A", hashes(tokens(2, 400 * BLOCK)), 0.0)
    path = index.walk(ROOT, as_bytes(prefix))
    prefix_hashes = [node.block_hash for node in path]

    def order() -> list[int]:
        return [node.block_hash for node in index.lru_blocks("A")]

    index.record_hits(path, "A", 1.0)
    assert order()[-4:] == prefix_hashes  # first reuse: moved to the recent end
    newer = hashes(tokens(3, 10 * BLOCK))
    index.stored("A", newer, 1.0)
    index.record_hits(path, "A", 2.0)
    assert order()[-14:] == prefix_hashes + newer  # again soon: left where it is
    assert [index.hits(node, 2.0) for node in path] == [2, 2, 2, 2]  # but counted
    index.stored("A", hashes(tokens(4, 400 * BLOCK)), 2.0)  # more than half turns over
    index.record_hits(path, "A", 3.0)
    assert order()[-4:] == prefix_hashes
    assert [index.hits(node, 3.0) for node in path] == [3, 3, 3, 3]


# ---- approximate mode -------------------------------------------------------------------


def test_placed_predicts_every_full_block_and_expires_after_the_ttl():
    index = PrefixIndex(BLOCK, ttl_s=10.0)
    prompt = tokens(1, 6 * BLOCK + 2)
    prompt_bytes = as_bytes(prompt)
    path = index.walk(ROOT, prompt_bytes)
    assert path == []
    index.placed("A", ROOT, prompt_bytes, path, 0.0)
    assert len(index) == 6
    assert set(index.nodes) == set(hashes(prompt))
    assert [node.block_hash for node in index.lru_blocks("A")] == hashes(prompt)
    path = index.walk(ROOT, prompt_bytes)
    assert [node.block_hash for node in path] == hashes(prompt)
    assert index.match(path) == {"A": 6}
    assert index.expire(9.9) == 0
    assert len(index) == 6
    assert index.expire(10.0) == 6
    assert len(index) == 0
    assert index.walk(ROOT, prompt_bytes) == []


def test_placed_extends_a_known_prefix_for_another_worker():
    index = PrefixIndex(BLOCK, ttl_s=10.0)
    shared = tokens(1, 3 * BLOCK)
    longer = np.concatenate([shared, tokens(2, 4 * BLOCK)])
    index.placed("A", ROOT, as_bytes(shared), index.walk(ROOT, as_bytes(shared)), 0.0)
    path = index.walk(ROOT, as_bytes(longer))
    assert len(path) == 3
    index.placed("B", ROOT, as_bytes(longer), path, 1.0)
    path = index.walk(ROOT, as_bytes(longer))
    assert [node.block_hash for node in path] == hashes(longer)
    assert index.match(path) == {"A": 3, "B": 7}
    assert index.expire(10.0) == 3  # A's entries; B's shared ones stay
    assert len(index) == 7
    assert index.match(index.walk(ROOT, as_bytes(longer))) == {"B": 7}


def test_expect_credits_the_blocks_a_worker_lacks_and_settle_drops_the_unconfirmed():
    index = PrefixIndex(BLOCK)
    shared = tokens(1, 2 * BLOCK)
    prompt = np.concatenate([shared, tokens(2, 4 * BLOCK)])
    names = hashes(prompt)
    index.stored("A", names[:2], 0.0)
    index.stored("B", names[:2], 0.0)
    keys = as_bytes(prompt)
    credited = index.expect("A", ROOT, keys, index.walk(ROOT, keys), 2, 0.0)
    assert index.credited(credited) == names[2:]
    assert index.match(index.walk(ROOT, keys)) == {"A": 6, "B": 2}
    index.stored("A", names[2:4], 1.0)  # confirmed
    index.settle(credited)
    assert index.match(index.walk(ROOT, keys)) == {"A": 4, "B": 2}
    assert len(index) == 4
    index.settle(credited)  # twice is harmless
    assert index.match(index.walk(ROOT, keys)) == {"A": 4, "B": 2}


def test_a_dropped_worker_leaves_no_credit_behind():
    index = PrefixIndex(BLOCK)
    keys = as_bytes(tokens(1, 3 * BLOCK))
    credited = index.expect("A", ROOT, keys, index.walk(ROOT, keys), 0, 0.0)
    index.drop_worker("A")
    assert len(index) == 0
    assert index.unconfirmed == {}
    index.stored("A", index.credited(credited), 1.0)  # the worker came back and stored them for real
    index.settle(credited)  # its old request's end must not drop them
    assert index.match(index.walk(ROOT, keys)) == {"A": 3}


def test_a_refreshed_entry_outlives_its_older_expiry():
    index = PrefixIndex(BLOCK, ttl_s=10.0)
    prompt = tokens(1, 4 * BLOCK)
    prompt_bytes = as_bytes(prompt)
    index.placed("A", ROOT, prompt_bytes, index.walk(ROOT, prompt_bytes), 0.0)
    index.placed("A", ROOT, prompt_bytes, index.walk(ROOT, prompt_bytes), 5.0)
    assert index.expire(12.0) == 0
    assert len(index) == 4
    assert index.match(index.walk(ROOT, prompt_bytes)) == {"A": 4}
    assert index.expire(15.0) == 4
    assert len(index) == 0


# ---- cost -------------------------------------------------------------------------------


def test_walking_an_unseen_long_prompt_touches_one_block():
    index = PrefixIndex(16)
    known = tokens(1, 64 * 16)
    index.stored("A", chain_hashes(ROOT, known, 16), 0.0)
    before = len(index.nodes)
    unseen = tokens(2, 65536)
    assert index.walk(ROOT, as_bytes(unseen, 16)) == []
    assert len(index.nodes) == before
    # Nothing was linked for the unseen prompt: the root's only children are known blocks.
    root = index.roots[ROOT]
    assert root.children is None
    assert index.walk(ROOT, as_bytes(tokens(3, 100_000), 16)) == []
    assert len(index.nodes) == before


def test_walk_stops_at_the_first_unknown_block_without_hashing_the_rest(monkeypatch):
    import services.router.index as index_module

    calls = []
    real_hash = index_module._hash

    def counting_hash(data):
        calls.append(len(data))
        return real_hash(data)

    monkeypatch.setattr(index_module, "_hash", counting_hash)
    index = PrefixIndex(16)
    known = tokens(1, 4 * 16)
    index.stored("A", chain_hashes(ROOT, known, 16), 0.0)
    calls.clear()
    assert index.walk(ROOT, as_bytes(tokens(2, 65536), 16)) == []
    assert len(calls) == 1
    calls.clear()
    prompt = np.concatenate([known, tokens(3, 65536)])
    assert len(index.walk(ROOT, as_bytes(prompt, 16))) == 4
    assert len(calls) == 5  # 4 known blocks the first time, then the first unknown one
    calls.clear()
    assert len(index.walk(ROOT, as_bytes(prompt, 16))) == 4
    assert len(calls) == 1  # known blocks come from the children links now


def test_a_walk_that_goes_a_known_segment_at_once_stops_where_a_block_was_forgotten():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, (2 * SEGMENT_BLOCKS + 3) * BLOCK)
    names = hashes(prompt)
    index.stored("A", names, 0.0)
    keys = as_bytes(prompt)
    assert [node.block_hash for node in index.walk(ROOT, keys)] == names  # a first walk
    assert [node.block_hash for node in index.walk(ROOT, keys)] == names  # segments at once
    index.removed("A", [names[SEGMENT_BLOCKS + 5]])
    assert [node.block_hash for node in index.walk(ROOT, keys)] == names[:SEGMENT_BLOCKS + 5]
    index.stored("A", [names[SEGMENT_BLOCKS + 5]], 1.0)
    assert [node.block_hash for node in index.walk(ROOT, keys)] == names
    assert index.match(index.walk(ROOT, keys)) == {"A": len(names)}


def test_a_credit_is_named_only_when_something_could_see_it():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 4 * BLOCK)
    keys = as_bytes(prompt)
    credit = index.expect("A", ROOT, keys, index.walk(ROOT, keys), 0, 0.0)
    assert index.walk(ROOT, as_bytes(tokens(2, 4 * BLOCK))) == []  # another first block
    assert credit.blocks is None and index.nodes == {}
    assert index.match(index.walk(ROOT, keys)) == {"A": 4}  # the same first block: named first
    assert credit.blocks == hashes(prompt)
    later = index.expect("B", ROOT, keys, index.walk(ROOT, keys), 0, 1.0)
    assert [node.block_hash for node in index.lru_blocks("B")] == hashes(prompt)  # B's LRU read
    assert later.blocks == hashes(prompt)


def test_a_reuses_lru_move_waits_with_the_credits_and_lands_in_placement_order():
    """record_hits moves the reused prefix only when something reads or reorders the
    LRU, in placement order with the credits: a read sees what moving at once shows."""
    first, second, new = tokens(1, 3 * BLOCK), tokens(2, 3 * BLOCK), tokens(3, 2 * BLOCK)

    def place_three(read_each: bool) -> tuple[list[int], list[int]]:
        """The LRU as stored before the last read, and as that read sees it."""
        index = PrefixIndex(BLOCK)
        index.stored("A", hashes(first) + hashes(second), 0.0)
        for token_ids, held in ((first, 2), (new, 0), (second, 3)):
            keys = as_bytes(token_ids)
            path = index.walk(ROOT, keys)
            index.record_hits(path[:held], "A", 1.0)
            index.expect("A", ROOT, keys, path, held, 1.0)
            if read_each:
                index.lru_blocks("A")
        return [node.block_hash for node in index.lru["A"]], [node.block_hash for node in index.lru_blocks("A")]

    waiting, deferred = place_three(read_each=False)
    _, at_once = place_three(read_each=True)
    assert waiting == hashes(first) + hashes(second)  # nothing moved before the read
    assert deferred == at_once == hashes(first)[2:] + hashes(first)[:2] + hashes(new) + hashes(second)


def test_a_named_credit_lets_its_prompt_go_and_keeps_its_blocks():
    index = PrefixIndex(BLOCK)
    prompt = tokens(1, 6 * BLOCK)
    keys = index.block_keys(prompt)
    credit = index.expect("a", ROOT, keys, index.walk(ROOT, keys), 0, 0.0)
    assert credit.keys is keys  # not named yet: the prompt is still needed
    assert index.credited(credit) == chain_hashes(ROOT, prompt, BLOCK)
    assert len(credit.keys) == 0 and credit.path == []
    assert index.match(index.walk(ROOT, index.block_keys(prompt))) == {"a": 6}
    index.settle(credit)
    assert index.match(index.walk(ROOT, index.block_keys(prompt))) == {}
