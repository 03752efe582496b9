"""Paged KV bookkeeping: which block holds what, who references it, what may be reused.

Plain CPU code, no tensors. A block is in exactly one of three states:
  * referenced: ref_count > 0, in some sequence's block table;
  * cached: ref_count == 0 but named by a hash, kept in an LRU so a later request with
    the same prefix can take it back (the local prefix cache);
  * free: ref_count == 0 and unnamed.
Allocation takes free blocks first, then evicts the least recently used cached block.
`check_integrity` verifies all of the above against the sequences' block tables.

A named block also records its chain (its parent's name, or the chain's root for block 0,
and the root: the KV store's namespace) and how often a prefix match reused it, so that
an eviction hook can write it back to the KV store (docs/architecture.md §8).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence as Seq
from typing import NamedTuple, Protocol

from common.hashing import token_id_bytes


class KVEventSink(Protocol):
    """Receives the names of blocks entering and leaving the prefix cache."""

    def stored(self, block_hashes: list[int]) -> None: ...

    def removed(self, block_hashes: list[int]) -> None: ...


class EvictedBlock(NamedTuple):
    """A cached block that an allocation is about to reuse: its KV is still intact when
    the eviction hook sees it. `parent` and `root` are None when it was named without
    its chain's root (callers that do not write back)."""

    block_id: int
    name: int
    parent: int | None
    root: int | None
    hits: int


EvictionHook = Callable[[list[EvictedBlock]], None]


class BlockManagerError(RuntimeError):
    """Bookkeeping is inconsistent: a bug, never a user error."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, events: KVEventSink | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Per-block state of blocks 0..num_touched-1; a block's entries are made when it is
        # first handed out (a simulated cluster of a thousand engines pays only for what
        # it uses).
        self.num_touched = 0
        self.ref_counts: list[int] = []
        self.block_hash: list[int | None] = []
        self.block_tokens: list[bytes | None] = []  # as common.hashing encodes them
        self.block_parent: list[int | None] = []
        self.block_root: list[int | None] = []
        self.block_hits: list[int] = []  # times a prefix match took the named block
        self.hash_to_block: dict[int, int] = {}
        # Free blocks are the never-used ones (num_touched on, handed out in order) and
        # then these, freed after use, in the order they were freed.
        self.free_blocks: deque[int] = deque()
        self.cached_blocks: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.events = events
        # Called once per allocation that evicted, before the evicted blocks are handed out.
        self.on_evict: EvictionHook | None = None

    # ---- queries -------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation could take (free plus evictable cached)."""
        return self.num_blocks - self.num_touched + len(self.free_blocks) + len(self.cached_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self.cached_blocks)

    def match_prefix(self, block_hashes: Seq[int], token_ids: Seq[int], max_blocks: int) -> list[int]:
        """Block ids holding the longest cached prefix, at most `max_blocks` long.

        The tokens are compared too, so a hash collision is a miss, never wrong KV.
        Takes no references.
        """
        named = self._named_prefix(block_hashes, max_blocks)
        if not named:
            return named
        width = 4 * self.block_size
        token_bytes = token_id_bytes(token_ids[:len(named) * self.block_size])  # the named blocks' tokens
        block_tokens = self.block_tokens
        if b"".join(map(block_tokens.__getitem__, named)) == token_bytes:  # type: ignore[arg-type]
            return named  # all agree: one comparison instead of one per block
        for index, block_id in enumerate(named):
            if block_tokens[block_id] != token_bytes[index * width:(index + 1) * width]:
                return named[:index]
        return named

    def _named_prefix(self, block_hashes: Seq[int], max_blocks: int) -> list[int]:
        """Block ids named by the leading hashes, up to the first not in the cache."""
        named: list[int] = []
        lookup = self.hash_to_block.get
        for block_name in block_hashes[:max_blocks]:
            block_id = lookup(block_name)
            if block_id is None:
                break
            named.append(block_id)
        return named

    def num_matched_cached(self, block_hashes: Seq[int], max_blocks: int) -> int:
        """How many leading blocks are named in the cache (hashes only, for ordering)."""
        count = 0
        for block_name in block_hashes[:max_blocks]:
            if block_name not in self.hash_to_block:
                break
            count += 1
        return count

    def blocks_to_take(self, hit_blocks: Iterable[int], num_new: int) -> int:
        """Available blocks that reusing `hit_blocks` plus `num_new` fresh ones consumes."""
        return num_new + sum(1 for block_id in hit_blocks if self.ref_counts[block_id] == 0)

    # ---- mutations -----------------------------------------------------------------

    def take(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each (cached or referenced) block: a prefix match reuses it."""
        ref_counts, hits, cached = self.ref_counts, self.block_hits, self.cached_blocks
        for block_id in block_ids:
            hits[block_id] += 1
            if ref_counts[block_id] == 0:
                if block_id not in cached:
                    raise BlockManagerError(f"block {block_id} is free, not cached; cannot share it")
                del cached[block_id]
            ref_counts[block_id] += 1

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each referenced block (a second holder, not a prefix hit)."""
        ref_counts = self.ref_counts
        for block_id in block_ids:
            if ref_counts[block_id] <= 0:
                raise BlockManagerError(f"block {block_id} is not referenced; cannot retain it")
            ref_counts[block_id] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks with one reference each: free blocks first, then the LRU
        cached ones, evicted (the hook sees them, then the event sink their names)."""
        if count > self.num_available:
            raise BlockManagerError(f"asked for {count} blocks, {self.num_available} available")
        allocated = self._touch(min(count, self.num_blocks - self.num_touched))
        free, ref_counts = self.free_blocks, self.ref_counts
        if count > len(allocated) and free:
            reused = [free.popleft() for _ in range(min(count - len(allocated), len(free)))]
            for block_id in reused:
                ref_counts[block_id] = 1
            allocated += reused
        if count > len(allocated):
            allocated += self._evict(count - len(allocated))
        return allocated

    def _touch(self, count: int) -> list[int]:
        """The next `count` never-used blocks, given their state and one reference each."""
        first = self.num_touched
        self.num_touched += count
        self.ref_counts += [1] * count
        for unnamed in (self.block_hash, self.block_tokens, self.block_parent, self.block_root):
            unnamed += [None] * count
        self.block_hits += [0] * count
        return list(range(first, first + count))

    def _evict(self, count: int) -> list[int]:
        """Take the `count` least recently used cached blocks with one reference each,
        forget them, tell the eviction hook and the event sink; returns their ids."""
        popitem, ref_counts = self.cached_blocks.popitem, self.ref_counts
        block_ids = [popitem(last=False)[0] for _ in range(count)]
        for block_id in block_ids:
            ref_counts[block_id] = 1
        hook = self.on_evict
        chains = [(self.block_parent[block_id], self.block_root[block_id], self.block_hits[block_id])
                  for block_id in block_ids] if hook is not None else []
        names = self._forget_all(block_ids)
        if hook is not None:
            hook([EvictedBlock(block_id, name, *chain) for block_id, name, chain in zip(block_ids, names, chains)])
        if self.events is not None:
            self.events.removed(names)
        return block_ids

    def release(self, block_ids: Seq[int]) -> None:
        """Drop one reference from each block; unreferenced named blocks stay cached.

        Released in reverse so a sequence's tail is evicted before its prefix.
        """
        ref_counts, block_hash, cached = self.ref_counts, self.block_hash, self.cached_blocks
        for block_id in reversed(block_ids):
            count = ref_counts[block_id] - 1
            if count < 0:
                raise BlockManagerError(f"block {block_id} released more often than taken")
            ref_counts[block_id] = count
            if count == 0:
                if block_hash[block_id] is not None:
                    cached[block_id] = None
                else:
                    self.free_blocks.append(block_id)

    def commit(self, block_ids: Seq[int], block_hashes: Seq[int], token_ids: Seq[int],
               first: int, last: int, root: int | None = None) -> None:
        """Name blocks first..last-1 of a sequence now that their KV is computed.

        A name already held by another block (two requests computed the same prefix
        at once) leaves this block unnamed; it is freed normally later. `root`, the
        chain's root hash, is block 0's parent and every block's namespace.
        """
        if last <= first:  # most decode steps fill no block
            return
        stored: list[int] = []
        width = 4 * self.block_size
        token_bytes = token_id_bytes(token_ids[first * self.block_size:last * self.block_size])
        block_hash, block_tokens, hash_to_block = self.block_hash, self.block_tokens, self.hash_to_block
        block_parent, block_root, block_hits = self.block_parent, self.block_root, self.block_hits
        names = block_hashes[first:last]
        parents = ([root] if first == 0 else [block_hashes[first - 1]]) + list(names[:-1])
        for offset, block_id, block_name, parent in zip(range(0, len(token_bytes), width), block_ids[first:last],
                                                       names, parents):
            if block_hash[block_id] is not None or block_name in hash_to_block:
                continue
            block_hash[block_id] = block_name
            block_tokens[block_id] = token_bytes[offset:offset + width]
            hash_to_block[block_name] = block_id
            block_parent[block_id] = parent
            block_root[block_id] = root
            block_hits[block_id] = 0
            stored.append(block_name)
        if stored and self.events is not None:
            self.events.stored(stored)

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unreferenced) block; returns how many."""
        evicted = self._forget_all(list(self.cached_blocks))
        self.free_blocks.extend(self.cached_blocks)
        self.cached_blocks.clear()
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return len(evicted)

    def _forget_all(self, block_ids: list[int]) -> list[int]:
        """Unname these cached blocks (their chain and hits too); returns their names."""
        block_hash, block_tokens, hash_to_block = self.block_hash, self.block_tokens, self.hash_to_block
        block_parent, block_root, block_hits = self.block_parent, self.block_root, self.block_hits
        names: list[int] = []
        for block_id in block_ids:
            block_name = block_hash[block_id]
            assert block_name is not None  # only a cached block is forgotten, and it has a hash
            del hash_to_block[block_name]
            block_hash[block_id] = block_tokens[block_id] = block_parent[block_id] = block_root[block_id] = None
            block_hits[block_id] = 0
            names.append(block_name)
        return names

    # ---- integrity -----------------------------------------------------------------

    def check_integrity(self, block_tables: Iterable[Seq[int]]) -> None:
        """Raise BlockManagerError unless the bookkeeping matches these block tables
        (one per live sequence)."""
        untouched = self.num_blocks - self.num_touched  # free, with no state yet: as if unnamed
        lengths = {len(state) for state in (self.ref_counts, self.block_hash, self.block_tokens, self.block_parent,
                                            self.block_root, self.block_hits)}
        if lengths != {self.num_touched}:
            raise BlockManagerError(f"per-block state covers {sorted(lengths)} blocks, not {self.num_touched}")
        ref_counts = self.ref_counts + [0] * untouched
        block_hash = self.block_hash + [None] * untouched
        expected = [0] * self.num_blocks
        for table in block_tables:
            for block_id in table:
                expected[block_id] += 1
        if expected != ref_counts:
            bad = [b for b in range(self.num_blocks) if expected[b] != ref_counts[b]]
            raise BlockManagerError(f"ref counts disagree with block tables at blocks {bad[:10]}")
        free, cached = set(self.free_blocks), set(self.cached_blocks)
        if len(free) != len(self.free_blocks) or any(b >= self.num_touched for b in free):
            raise BlockManagerError("a block is in the free list twice")
        free.update(range(self.num_touched, self.num_blocks))
        if free & cached:
            raise BlockManagerError(f"blocks both free and cached: {sorted(free & cached)[:10]}")
        unreferenced = {b for b in range(self.num_blocks) if ref_counts[b] == 0}
        if free | cached != unreferenced:
            raise BlockManagerError("free and cached blocks are not exactly the unreferenced ones")
        if any(block_hash[b] is not None for b in free):
            raise BlockManagerError("a free block still carries a name")
        if any(block_hash[b] is None for b in cached):
            raise BlockManagerError("a cached block has no name")
        if any(self.block_parent[b] is not None or self.block_root[b] is not None for b in free
               if b < self.num_touched):
            raise BlockManagerError("a free block still records a chain")
        named = {b: h for b, h in enumerate(self.block_hash) if h is not None}
        if {h: b for b, h in named.items()} != self.hash_to_block or len(named) != len(self.hash_to_block):
            raise BlockManagerError("the hash index disagrees with the blocks' names")
