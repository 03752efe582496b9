"""The prefix index keeps holders and LRU places per run of blocks (docs/router.md §2): on
random event streams it must hold, order and match exactly what a per-block model of the
same rules does, and keep its runs' contract (PrefixIndex.check) after every step."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from common.hashing import chain_hashes, root_hash
from services.router.index import Credit, PrefixIndex

BLOCK = 2
ROOT = root_hash("model", "tokenizer", "", "bfloat16", BLOCK)
WORKERS = ("a", "b", "c")


def _prompts() -> list[np.ndarray]:
    """Prompts of 3-12 blocks in two families, branching at several depths, so chains share blocks."""
    rng = np.random.default_rng(7)
    trunks = [rng.integers(0, 1000, 12 * BLOCK).astype(np.uint32) for _ in range(2)]
    prompts = []
    for trunk in trunks:
        for cut in (3, 5, 8, 12):
            tail = rng.integers(0, 1000, (12 - cut) * BLOCK).astype(np.uint32)
            prompts.append(np.concatenate([trunk[:cut * BLOCK], tail]))
        prompts.append(trunk[:4 * BLOCK].copy())
    return prompts


PROMPTS = _prompts()
CHAINS = [chain_hashes(ROOT, prompt, BLOCK) for prompt in PROMPTS]


class Model:
    """Per block: its holders in holding order, each with its expiry; per worker: its
    blocks least recent first; the blocks the store holds."""

    def __init__(self, ttl_s: float | None) -> None:
        self.ttl_s = ttl_s
        self.holders: dict[int, dict[str, float]] = {}
        self.lru: dict[str, list[int]] = {}
        self.unconfirmed: dict[str, set[int]] = {}
        self.stored: set[int] = set()

    def hold(self, worker_id: str, block_hashes: list[int], now: float = 0.0) -> None:
        lru = self.lru.setdefault(worker_id, [])
        self.unconfirmed.get(worker_id, set()).difference_update(block_hashes)
        expiry = now + self.ttl_s if self.ttl_s is not None else float("inf")
        for block_hash in block_hashes:
            holders = self.holders.setdefault(block_hash, {})
            if worker_id in holders:
                lru.remove(block_hash)
            holders[worker_id] = expiry
            lru.append(block_hash)

    def expire(self, now: float) -> None:
        for block_hash, holders in list(self.holders.items()):
            for worker_id in [w for w, expiry in holders.items() if expiry <= now]:
                self.removed(worker_id, [block_hash])

    def removed(self, worker_id: str, block_hashes: list[int]) -> None:
        for block_hash in block_hashes:
            holders = self.holders.get(block_hash)
            if holders is not None and worker_id in holders:
                del holders[worker_id]
                self.lru[worker_id].remove(block_hash)
                self.unconfirmed.get(worker_id, set()).discard(block_hash)
                if not holders:
                    del self.holders[block_hash]

    def known(self) -> set[int]:
        return set(self.holders) | self.stored

    def drop(self, worker_id: str) -> None:
        self.removed(worker_id, list(self.lru.get(worker_id, [])))
        self.lru.pop(worker_id, None)
        self.unconfirmed.pop(worker_id, None)

    def reuse(self, worker_id: str, block_hashes: list[int]) -> None:
        lru = self.lru.setdefault(worker_id, [])
        for block_hash in block_hashes:
            if block_hash in lru:
                lru.remove(block_hash)
                lru.append(block_hash)

    def match(self, chain: list[int]) -> dict[str, int]:
        known, named = 0, self.known()
        while known < len(chain) and chain[known] in named:
            known += 1
        matched: dict[str, int] = {}
        for worker_id in WORKERS:
            count = 0
            while count < known and worker_id in self.holders.get(chain[count], {}):
                count += 1
            if count:
                matched[worker_id] = count
        return matched


def _ordered(block_hashes: list[int], order: str) -> list[int]:
    if order == "down":
        return block_hashes[::-1]
    if order == "gaps":
        return block_hashes[::2]
    if order == "shuffled":
        return [block_hashes[i] for i in np.random.default_rng(len(block_hashes)).permutation(len(block_hashes))]
    return block_hashes


_worker = st.sampled_from(WORKERS)
_prompt = st.integers(0, len(PROMPTS) - 1)
_span = st.tuples(st.integers(0, 12), st.integers(0, 12))
_order = st.sampled_from(("up", "down", "gaps", "shuffled"))
_step = st.one_of(
    st.tuples(st.just("stored"), _worker, _prompt, _span, _order),
    st.tuples(st.just("removed"), _worker, _prompt, _span, _order),
    st.tuples(st.just("place"), _worker, _prompt),
    st.tuples(st.just("settle"), st.integers(0, 5)),
    st.tuples(st.just("drop"), _worker),
    st.tuples(st.just("store"), _prompt, _span),
    st.tuples(st.just("unstore"), _prompt, _span),
)


def _apply(index: PrefixIndex, model: Model, credits: list[tuple[Credit, str]], step: tuple, now: float) -> None:
    kind = step[0]
    if kind in ("stored", "removed"):
        _, worker_id, prompt, (start, stop), order = step
        block_hashes = _ordered(CHAINS[prompt][min(start, stop):max(start, stop)], order)
        if kind == "stored":
            index.stored(worker_id, block_hashes, now)
            model.hold(worker_id, block_hashes, now)
        else:
            index.removed(worker_id, block_hashes)
            model.removed(worker_id, block_hashes)
    elif kind == "place":  # a reuse of what the worker holds, then a credit for the rest
        _, worker_id, prompt = step
        keys = index.block_keys(PROMPTS[prompt])
        path = index.walk(ROOT, keys)
        held = index.match(path).get(worker_id, 0)
        index.record_hits(path[:held], worker_id, now)
        credit = index.expect(worker_id, ROOT, keys, path, held, now)
        chain = CHAINS[prompt]
        model.reuse(worker_id, chain[:held])
        # Known blocks the worker lacks, then every block past the walk, as _name makes them.
        lacked = [h for h in chain[held:len(path)] if worker_id not in model.holders.get(h, {})] + chain[len(path):]
        model.hold(worker_id, lacked, now)
        model.unconfirmed.setdefault(worker_id, set()).update(lacked)
        assert index.credited(credit) == lacked
        credits.append((credit, worker_id))
    elif kind == "settle":
        if step[1] < len(credits):
            credit, worker_id = credits.pop(step[1])
            pending = model.unconfirmed.get(worker_id, set())
            unconfirmed = [h for h in credit.blocks or [] if h in pending]
            index.settle(credit)
            model.removed(worker_id, unconfirmed)
    elif kind in ("store", "unstore"):  # the KV store's events
        _, prompt, (start, stop) = step
        block_hashes = CHAINS[prompt][min(start, stop):max(start, stop)]
        if kind == "store":
            index.store_stored(block_hashes, [0] * len(block_hashes))
            model.stored.update(block_hashes)
        else:
            index.store_evicted(block_hashes)
            model.stored.difference_update(block_hashes)
    else:
        index.drop_worker(step[1])
        model.drop(step[1])


def _same(index: PrefixIndex, model: Model) -> None:
    index.name_credits()
    index.check()
    for worker_id in WORKERS:
        assert [node.block_hash for node in index.lru_blocks(worker_id)] == model.lru.get(worker_id, [])
        assert index.num_blocks(worker_id) == len(model.lru.get(worker_id, []))
    assert set(index.nodes) == model.known()
    for block_hash, holders in model.holders.items():
        assert index.holders(index.nodes[block_hash]) == holders
        assert list(index.holders(index.nodes[block_hash])) == list(holders)
    for prompt, chain in zip(PROMPTS, CHAINS):
        assert index.match(index.walk(ROOT, index.block_keys(prompt))) == model.match(chain)


@settings(max_examples=200, deadline=None)
@given(st.lists(_step, min_size=5, max_size=40), st.sampled_from((None, 3.0)))
def test_runs_hold_order_and_match_as_the_per_block_rules_do(steps, ttl_s):
    """Events mode, and approximate mode (entries expire ttl_s after their last hold)."""
    index, model = PrefixIndex(BLOCK, ttl_s=ttl_s), Model(ttl_s)
    credits: list[tuple[Credit, str]] = []
    for n, step in enumerate(steps):
        now = float(n)
        if ttl_s is not None:
            index.expire(now)
            model.expire(now)
        _apply(index, model, credits, step, now)
        _same(index, model)


def test_a_cut_run_keeps_its_place_in_every_holders_lru():
    """Cutting a run shared by two workers (one reuses the middle of it) leaves the other
    worker's order untouched and moves only the middle for the first."""
    index, model = PrefixIndex(BLOCK), Model(None)
    chain = CHAINS[3]
    for worker_id in ("a", "b"):
        index.stored(worker_id, chain, 0.0)
        model.hold(worker_id, chain)
    index.stored("a", CHAINS[0][:2], 1.0)  # something more recent on a
    model.hold("a", CHAINS[0][:2])
    index.stored("a", chain[4:7], 2.0)
    model.hold("a", chain[4:7])
    _same(index, model)
    assert [node.block_hash for node in index.lru_blocks("a")][-3:] == chain[4:7]
    assert [node.block_hash for node in index.lru_blocks("b")] == chain
    index.removed("b", chain[7:][::-1])  # an engine's eviction: the tail, last block first
    model.removed("b", chain[7:][::-1])
    _same(index, model)
    assert index.match(index.walk(ROOT, index.block_keys(PROMPTS[3]))) == {"a": 12, "b": 7}


def test_check_catches_a_broken_run():
    index = PrefixIndex(BLOCK)
    index.stored("a", CHAINS[0], 0.0)
    index.check()
    node = index.nodes[CHAINS[0][3]]
    assert node.run is not None
    node.run.signature ^= 1
    try:
        index.check()
    except AssertionError:
        return
    raise AssertionError("check() missed a stale signature")
