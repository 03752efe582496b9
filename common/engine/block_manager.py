"""Paged KV bookkeeping: which block holds what, who references it, what may be reused.

Plain CPU code, no tensors. A block is in exactly one of three states:
  * referenced: its reference count > 0, in some sequence's block table;
  * cached: no references but named by a hash, kept in an LRU so a later request with
    the same prefix can take it back (the local prefix cache);
  * free: no references and unnamed.
Allocation takes free blocks first, then evicts the least recently used cached block.
`check_integrity` verifies all of the above against the sequences' block tables.

A named block also records its chain (its parent's name, or the chain's root for block 0,
and the root: the KV store's namespace) and how often a prefix match reused it, so that
an eviction hook can write it back to the KV store (docs/architecture.md §8).

Named blocks are kept per run (`Run`, docs/engine.md §3): consecutive blocks of one
chain that share fate, the same references, the same reuse count and one place in the
LRU. A sequence's blocks named chunk by chunk extend one run; a run is cut only where a
prefix match, a release or a lease treats its blocks apart, or an eviction takes its
tail. So matching, taking, releasing and evicting a sequence cost per run, not per
block; what stays per block is the block's run (its id's slot in a list), an unnamed
block's reference count and the name table a match starts from.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence as Seq
from itertools import repeat
from typing import NamedTuple, Protocol

from common.hashing import token_id_bytes


class KVEventSink(Protocol):
    """Receives the names of blocks entering and leaving the prefix cache."""

    def stored(self, block_hashes: list[int]) -> None: ...

    def removed(self, block_hashes: list[int]) -> None: ...


class EvictedBlock(NamedTuple):
    """A named block's record: what an eviction hook sees of a cached block an allocation
    is about to reuse (its KV still intact), and what `record` says of a named one.
    `parent` and `root` are None when it was named without its chain's root (callers that
    do not write back)."""

    block_id: int
    name: int
    parent: int | None
    root: int | None
    hits: int


EvictionHook = Callable[[list[EvictedBlock]], None]


class BlockManagerError(RuntimeError):
    """Bookkeeping is inconsistent: a bug, never a user error."""


class Run:
    """Named blocks that share fate: `block_ids[i]` is named `names[i]`, and each name
    continues the one before (the first continues `parent`: the chain's root for a
    chain's first block); `tokens` holds their tokens as common.hashing encodes them.
    They have the same references (`refs`) and reuse count (`hits`); with no references
    they lie in the LRU as one entry (`prev`, `next`), least recent first from the last
    block back, as a release leaves them. Never falsy: it has no length."""

    __slots__ = ("block_ids", "names", "tokens", "parent", "root", "refs", "hits", "prev", "next")

    def __init__(self, block_ids: list[int], names: list[int], tokens: bytearray, parent: int | None,
                 root: int | None, refs: int, hits: int):
        self.block_ids = block_ids
        self.names = names
        self.tokens = tokens
        self.parent = parent
        self.root = root
        self.refs = refs
        self.hits = hits
        self.prev: Run = self  # unlinked while referenced
        self.next: Run = self

    def parent_at(self, position: int) -> int | None:
        return self.names[position - 1] if position else self.parent


def _position(items: list[int], item: int) -> int:
    """Where `item` is in `items`: the ends first, where a stretch most often starts (a
    prefix match, a chain's first block) or ends (a release, tail first)."""
    if items[0] == item:
        return 0
    last = len(items) - 1
    return last if items[last] == item else items.index(item)


def _stretch(seq: Seq[int], i: int, items: list[int], first: int) -> int:
    """How many items of `seq` from i are `items` from `first` on, in order (seq[i] is
    items[first]): a slice comparison, binary searched where the whole rest differs."""
    high = min(len(seq) - i, len(items) - first)
    if seq[i:i + high] == items[first:first + high]:  # most often the whole rest
        return high
    low = 1  # the first `low` agree, the first `high` do not
    while low < high - 1:
        mid = (low + high) // 2
        if seq[i:i + mid] == items[first:first + mid]:
            low = mid
        else:
            high = mid
    return low


def _stretch_back(seq: Seq[int], i: int, items: list[int], last: int) -> int:
    """How many items of `seq` up to i are `items` up to `last`, in order (seq[i] is
    items[last]): `_stretch` read backwards."""
    high = min(i, last) + 1
    if seq[i + 1 - high:i + 1] == items[last + 1 - high:last + 1]:
        return high
    low = 1
    while low < high - 1:
        mid = (low + high) // 2
        if seq[i + 1 - mid:i + 1] == items[last + 1 - mid:last + 1]:
            low = mid
        else:
            high = mid
    return low


def _consume(iterator: Iterable[object]) -> None:
    deque(iterator, maxlen=0)  # runs a map's calls in C, keeping nothing


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, events: KVEventSink | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.width = 4 * block_size  # a block's tokens' bytes
        # Per-block entries of blocks 0..num_touched-1, made when a block is first handed
        # out (a simulated cluster of a thousand engines pays only for what it uses): the
        # run that names it (None: unnamed) and, while unnamed, its references.
        self.num_touched = 0
        self.block_run: list[Run | None] = []
        self.unnamed_refs: list[int] = []
        self.run_of_name: dict[int, Run] = {}
        # Free blocks are the never-used ones (num_touched on, handed out in order) and
        # then these, freed after use, in the order they were freed.
        self.free_blocks: deque[int] = deque()
        self.lru = Run([], [], bytearray(), None, None, -1, 0)  # the cached runs' circle; least recent next
        self.num_cached = 0
        self.events = events
        # Called once per allocation that evicted, before the evicted blocks are handed out.
        self.on_evict: EvictionHook | None = None

    # ---- queries -------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation could take (free plus evictable cached)."""
        return self.num_blocks - self.num_touched + len(self.free_blocks) + self.num_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def cached_blocks(self) -> Iterator[int]:
        """The cached blocks, least recently used first."""
        head = self.lru
        run = head.next
        while run is not head:
            yield from reversed(run.block_ids)
            run = run.next

    @property
    def num_named(self) -> int:
        """Blocks with a name (cached or referenced)."""
        return len(self.run_of_name)

    def runs(self) -> list[Run]:
        """Every run, each once (for tests and reports: O(blocks))."""
        return list({id(run): run for run in self.run_of_name.values()}.values())

    def names(self) -> list[int]:
        """The name of every named block (cached or referenced)."""
        return list(self.run_of_name)

    def named(self, name: int) -> EvictedBlock | None:
        """The record (see `record`) of the block named `name`; None if no block is."""
        run = self.run_of_name.get(name)
        if run is None:
            return None
        position = _position(run.names, name)
        return EvictedBlock(run.block_ids[position], name, run.parent_at(position), run.root, run.hits)

    def record(self, block_id: int) -> EvictedBlock | None:
        """The named block's name, chain and reuse count; None for an unnamed block."""
        run = self.block_run[block_id] if block_id < self.num_touched else None
        if run is None:
            return None
        position = _position(run.block_ids, block_id)
        return EvictedBlock(block_id, run.names[position], run.parent_at(position), run.root, run.hits)

    def refs(self, block_id: int) -> int:
        """The block's references."""
        if block_id >= self.num_touched:
            return 0
        run = self.block_run[block_id]
        return self.unnamed_refs[block_id] if run is None else run.refs

    def match_prefix(self, block_hashes: Seq[int], token_ids: Seq[int], max_blocks: int) -> list[int]:
        """Block ids holding the longest cached prefix, at most `max_blocks` long.

        The tokens are compared too, so a hash collision is a miss, never wrong KV.
        Takes no references.
        """
        stretches = self._named_stretches(block_hashes, max_blocks)
        if not stretches:
            return []
        width = self.width
        count = sum(length for _, _, length in stretches)
        token_bytes = token_id_bytes(token_ids[:count * self.block_size])  # the named blocks' tokens
        matched: list[int] = []
        offset = 0
        for run, first, length in stretches:
            tokens = token_bytes[offset:offset + length * width]
            if not run.tokens.startswith(tokens, first * width):
                length = self._agreeing_blocks(run, first, tokens)
                matched += run.block_ids[first:first + length]
                return matched
            matched += run.block_ids[first:first + length]
            offset += length * width
        return matched

    def _agreeing_blocks(self, run: Run, first: int, tokens: bytes) -> int:
        """How many leading blocks of `tokens` are the run's from `first` on."""
        width = self.width
        for index in range(len(tokens) // width):
            start = (first + index) * width
            if run.tokens[start:start + width] != tokens[index * width:(index + 1) * width]:
                return index
        return len(tokens) // width

    def _named_stretches(self, block_hashes: Seq[int], max_blocks: int) -> list[tuple[Run, int, int]]:
        """The leading hashes named here, up to the first that is not, as stretches of
        runs: (run, first position in it, blocks)."""
        hashes = block_hashes[:max_blocks]
        stretches: list[tuple[Run, int, int]] = []
        lookup = self.run_of_name.get
        i, count = 0, len(hashes)
        while i < count:
            run = lookup(hashes[i])
            if run is None:
                break
            first = _position(run.names, hashes[i])
            length = _stretch(hashes, i, run.names, first)
            stretches.append((run, first, length))
            i += length
        return stretches

    def num_matched_cached(self, block_hashes: Seq[int], max_blocks: int) -> int:
        """How many leading blocks are named in the cache (hashes only, for ordering)."""
        return sum(length for _, _, length in self._named_stretches(block_hashes, max_blocks))

    def blocks_to_take(self, hit_blocks: Seq[int], num_new: int) -> int:
        """Available blocks that reusing `hit_blocks` plus `num_new` fresh ones consumes."""
        unreferenced = 0
        for run, first, length in self._stretches(hit_blocks):
            if (self.unnamed_refs[first] if run is None else run.refs) == 0:
                unreferenced += length
        return num_new + unreferenced

    def _stretches(self, block_ids: Seq[int]) -> Iterator[tuple[Run | None, int, int]]:
        """`block_ids` in order as stretches of runs (run, first position, blocks), an
        unnamed block as (None, its id, 1)."""
        block_run = self.block_run
        i, count = 0, len(block_ids)
        while i < count:
            block_id = block_ids[i]
            run = block_run[block_id]
            if run is None:
                yield None, block_id, 1
                i += 1
                continue
            first = _position(run.block_ids, block_id)
            length = _stretch(block_ids, i, run.block_ids, first)
            yield run, first, length
            i += length

    # ---- mutations -----------------------------------------------------------------

    def take(self, block_ids: Seq[int]) -> None:
        """Add a reference to each (cached or referenced) block: a prefix match reuses it."""
        for run, first, length in self._stretches(block_ids):
            if run is None:
                if self.unnamed_refs[first] == 0:
                    raise BlockManagerError(f"block {first} is free, not cached; cannot share it")
                self.unnamed_refs[first] += 1
                continue
            piece = self._isolate(run, first, first + length)
            if piece.refs == 0:
                self._uncache(piece)
            piece.refs += 1
            piece.hits += 1

    def retain(self, block_ids: Seq[int]) -> None:
        """Add a reference to each referenced block (a second holder, not a prefix hit)."""
        for run, first, length in self._stretches(block_ids):
            refs = self.unnamed_refs[first] if run is None else run.refs
            if refs <= 0:
                block_id = first if run is None else run.block_ids[first]
                raise BlockManagerError(f"block {block_id} is not referenced; cannot retain it")
            if run is None:
                self.unnamed_refs[first] += 1
            else:
                self._isolate(run, first, first + length).refs += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks with one reference each: free blocks first, then the LRU
        cached ones, evicted (the hook sees them, then the event sink their names)."""
        if count > self.num_available:
            raise BlockManagerError(f"asked for {count} blocks, {self.num_available} available")
        allocated = self._touch(min(count, self.num_blocks - self.num_touched))
        free, unnamed_refs = self.free_blocks, self.unnamed_refs
        if count > len(allocated) and free:
            reused = [free.popleft() for _ in range(min(count - len(allocated), len(free)))]
            _consume(map(unnamed_refs.__setitem__, reused, repeat(1)))
            allocated += reused
        if count > len(allocated):
            allocated += self._evict(count - len(allocated))
        return allocated

    def _touch(self, count: int) -> list[int]:
        """The next `count` never-used blocks, given their entries and one reference each."""
        first = self.num_touched
        self.num_touched += count
        self.unnamed_refs += [1] * count
        self.block_run += [None] * count
        return list(range(first, first + count))

    def _evict(self, count: int) -> list[int]:
        """Take the `count` least recently used cached blocks with one reference each,
        forget them, tell the eviction hook and the event sink; returns their ids."""
        hook = self.on_evict
        block_ids: list[int] = []
        names: list[int] = []
        records: list[EvictedBlock] = []
        while len(block_ids) < count:
            run = self.lru.next
            size = len(run.block_ids)
            keep = max(size - (count - len(block_ids)), 0)  # the run's tail goes first
            if hook is not None:
                records += [EvictedBlock(run.block_ids[position], run.names[position], run.parent_at(position),
                                         run.root, run.hits) for position in range(size - 1, keep - 1, -1)]
            gone_ids, gone_names = self._forget_tail(run, keep)
            block_ids += reversed(gone_ids)
            names += reversed(gone_names)
        _consume(map(self.unnamed_refs.__setitem__, block_ids, repeat(1)))
        if hook is not None:
            hook(records)
        if self.events is not None:
            self.events.removed(names)
        return block_ids

    def _forget_tail(self, run: Run, keep: int) -> tuple[list[int], list[int]]:
        """Unname the cached run's blocks from position `keep` on (all of it at 0);
        returns their ids and names, in the run's order."""
        gone_ids, gone_names = run.block_ids[keep:], run.names[keep:]
        _consume(map(self.run_of_name.__delitem__, gone_names))
        _consume(map(self.block_run.__setitem__, gone_ids, repeat(None)))
        self.num_cached -= len(gone_ids)
        if keep == 0:
            self._unlink(run)
        del run.block_ids[keep:], run.names[keep:], run.tokens[keep * self.width:]
        return gone_ids, gone_names

    def release(self, block_ids: Seq[int]) -> None:
        """Drop one reference from each block; unreferenced named blocks stay cached.

        Released in reverse so a sequence's tail is evicted before its prefix.
        """
        block_run, unnamed_refs = self.block_run, self.unnamed_refs
        i = len(block_ids) - 1
        while i >= 0:
            block_id = block_ids[i]
            run = block_run[block_id]
            if run is None:
                count = unnamed_refs[block_id] - 1
                if count < 0:
                    raise BlockManagerError(f"block {block_id} released more often than taken")
                unnamed_refs[block_id] = count
                if count == 0:
                    self.free_blocks.append(block_id)
                i -= 1
                continue
            last = _position(run.block_ids, block_id)
            length = _stretch_back(block_ids, i, run.block_ids, last)
            piece = self._isolate(run, last + 1 - length, last + 1)
            if piece.refs <= 0:
                raise BlockManagerError(f"block {block_id} released more often than taken")
            piece.refs -= 1
            if piece.refs == 0:
                self._cache(piece)
            i -= length

    def commit(self, block_ids: Seq[int], block_hashes: Seq[int], token_ids: Seq[int],
               first: int, last: int, root: int | None = None) -> None:
        """Name blocks first..last-1 of a sequence now that their KV is computed.

        A name already held by another block (two requests computed the same prefix
        at once) leaves this block unnamed; it is freed normally later. `root`, the
        chain's root hash, is block 0's parent and every block's namespace.
        """
        if last <= first:  # most decode steps fill no block
            return
        ids, names = list(block_ids[first:last]), list(block_hashes[first:last])
        token_bytes = token_id_bytes(token_ids[first * self.block_size:last * self.block_size])
        refs = list(map(self.unnamed_refs.__getitem__, ids))
        if not any(map(self.block_run.__getitem__, ids)) and not any(map(self.run_of_name.__contains__, names)) \
                and refs.count(refs[0]) == len(refs):  # the usual case: new blocks, new names, one state
            self._name(block_ids, block_hashes, first, ids, names, token_bytes, root, refs[0])
            stored = names
        else:
            stored = self._name_apart(block_ids, block_hashes, first, ids, names, token_bytes, root, refs)
        if stored and self.events is not None:
            self.events.stored(stored)

    def _name_apart(self, block_ids: Seq[int], block_hashes: Seq[int], first: int, ids: list[int],
                    names: list[int], token_bytes: bytes, root: int | None, refs: list[int]) -> list[int]:
        """`commit` where some blocks are named already, some names are held by other
        blocks, or the blocks' references differ: each stretch of consecutive blocks to
        name with the same references is named on its own. Returns the names given."""
        kept = [index for index, (block_id, name) in enumerate(zip(ids, names))
                if self.block_run[block_id] is None and name not in self.run_of_name]
        stored: list[int] = []
        start = 0
        while start < len(kept):
            stop = start + 1
            while stop < len(kept) and kept[stop] == kept[stop - 1] + 1 and refs[kept[stop]] == refs[kept[start]]:
                stop += 1
            low, high = kept[start], kept[stop - 1] + 1
            self._name(block_ids, block_hashes, first + low, ids[low:high], names[low:high],
                       token_bytes[low * self.width:high * self.width], root, refs[low])
            stored += names[low:high]
            start = stop
        return stored

    def _name(self, block_ids: Seq[int], block_hashes: Seq[int], index: int, ids: list[int], names: list[int],
              tokens: bytes, root: int | None, refs: int) -> None:
        """Name a sequence's referenced blocks `ids` (from its block `index` on): they
        extend the run of the block before them where that block ends a run of the same
        chain in the same state, else they make a run of their own."""
        run = self.block_run[block_ids[index - 1]] if index else None
        if run is not None and run.block_ids[-1] == block_ids[index - 1] and run.refs == refs \
                and run.hits == 0 and run.root == root:
            run.block_ids += ids
            run.names += names
            run.tokens += tokens
        else:
            parent = root if index == 0 else block_hashes[index - 1]
            run = Run(ids, names, bytearray(tokens), parent, root, refs, 0)
        self.run_of_name.update(zip(names, repeat(run)))
        _consume(map(self.block_run.__setitem__, ids, repeat(run)))

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unreferenced) block; returns how many."""
        cached: list[int] = []
        names: list[int] = []
        while self.lru.next is not self.lru:  # least recent first, each run from its tail
            gone_ids, gone_names = self._forget_tail(self.lru.next, 0)
            cached += reversed(gone_ids)
            names += reversed(gone_names)
        _consume(map(self.unnamed_refs.__setitem__, cached, repeat(0)))
        self.free_blocks.extend(cached)
        if names and self.events is not None:
            self.events.removed(names)
        return len(names)

    # ---- runs ----------------------------------------------------------------------

    def _isolate(self, run: Run, start: int, stop: int) -> Run:
        """The run of exactly `run`'s blocks start to stop - 1, cut from the rest, which
        keeps its place in the LRU (the parts after it less recent, those before it more).
        The largest part stays in `run`, so a cut re-points the fewest blocks."""
        size = len(run.block_ids)
        if start == 0 and stop == size:
            return run
        bounds = [(low, high) for low, high in ((0, start), (start, stop), (stop, size)) if low < high]
        kept = max(range(len(bounds)), key=lambda k: bounds[k][1] - bounds[k][0])
        width, block_ids, names, tokens = self.width, run.block_ids, run.names, run.tokens
        parts: list[Run] = []
        for k, (low, high) in enumerate(bounds):
            if k == kept:
                parts.append(run)
                continue
            part = Run(block_ids[low:high], names[low:high], tokens[low * width:high * width],
                       run.parent_at(low), run.root, run.refs, run.hits)
            self.run_of_name.update(zip(part.names, repeat(part)))
            _consume(map(self.block_run.__setitem__, part.block_ids, repeat(part)))
            parts.append(part)
        low, high = bounds[kept]
        run.parent = run.parent_at(low)
        run.block_ids, run.names, run.tokens = block_ids[low:high], names[low:high], tokens[low * width:high * width]
        if run.refs == 0:  # cached: the later parts go first, tail first
            neighbour = run
            for part in parts[kept + 1:]:
                self._link_before(part, neighbour)
                neighbour = part
            neighbour = run
            for part in parts[kept - 1::-1] if kept else ():
                self._link_before(part, neighbour.next)
                neighbour = part
        return parts[1] if start > 0 else parts[0]

    def _cache(self, run: Run) -> None:
        """Put the unreferenced run at the LRU's recent end."""
        self._link_before(run, self.lru)
        self.num_cached += len(run.block_ids)

    def _uncache(self, run: Run) -> None:
        self._unlink(run)
        self.num_cached -= len(run.block_ids)

    @staticmethod
    def _link_before(run: Run, other: Run) -> None:
        last = other.prev
        run.prev, run.next = last, other
        last.next = run
        other.prev = run

    @staticmethod
    def _unlink(run: Run) -> None:
        run.prev.next = run.next
        run.next.prev = run.prev
        run.prev = run.next = run

    # ---- integrity -----------------------------------------------------------------

    def check_integrity(self, block_tables: Iterable[Seq[int]]) -> None:
        """Raise BlockManagerError unless the bookkeeping matches these block tables
        (one per live sequence) and the runs keep their contract."""
        if len(self.block_run) != self.num_touched or len(self.unnamed_refs) != self.num_touched:
            raise BlockManagerError(f"per-block state covers {len(self.block_run)} and {len(self.unnamed_refs)}"
                                    f" blocks, not {self.num_touched}")
        runs = self.runs()
        self._check_runs(runs)
        cached = self._check_lru()
        refs = [self.refs(block_id) for block_id in range(self.num_blocks)]
        expected = [0] * self.num_blocks
        for table in block_tables:
            for block_id in table:
                expected[block_id] += 1
        if expected != refs:
            bad = [b for b in range(self.num_blocks) if expected[b] != refs[b]]
            raise BlockManagerError(f"ref counts disagree with block tables at blocks {bad[:10]}")
        free = set(self.free_blocks)
        if len(free) != len(self.free_blocks) or any(b >= self.num_touched for b in free):
            raise BlockManagerError("a block is in the free list twice")
        free.update(range(self.num_touched, self.num_blocks))
        if free & cached:
            raise BlockManagerError(f"blocks both free and cached: {sorted(free & cached)[:10]}")
        if free | cached != {b for b in range(self.num_blocks) if refs[b] == 0}:
            raise BlockManagerError("free and cached blocks are not exactly the unreferenced ones")
        if any(self.block_run[b] is not None for b in free if b < self.num_touched):
            raise BlockManagerError("a free block still carries a name")
        if sum(len(run.block_ids) for run in runs) != sum(run is not None for run in self.block_run):
            raise BlockManagerError("the runs do not name exactly the blocks that point to them")

    def _check_runs(self, runs: list[Run]) -> None:
        width = self.width
        for run in runs:
            if not run.block_ids or len(run.block_ids) != len(run.names) or len(run.tokens) != len(run.names) * width:
                raise BlockManagerError(f"a run of {len(run.block_ids)} blocks, {len(run.names)} names and"
                                        f" {len(run.tokens)} token bytes")
            if run.refs < 0 or (run.refs == 0) == (run.prev is run):
                raise BlockManagerError(f"a run with {run.refs} references is {'not ' * (run.prev is run)}cached")
            if any(self.block_run[block_id] is not run for block_id in run.block_ids):
                raise BlockManagerError("a run's block points to another run")
            if any(self.run_of_name.get(name) is not run for name in run.names):
                raise BlockManagerError("a run's name is found in another run")
        if sum(len(run.names) for run in runs) != len(self.run_of_name):
            raise BlockManagerError("the name table names blocks no run holds")

    def _check_lru(self) -> set[int]:
        """The cached blocks, after checking the LRU's links and count."""
        cached: set[int] = set()
        head, count = self.lru, 0
        run = head.next
        while run is not head:
            if run.next.prev is not run or run.refs != 0:
                raise BlockManagerError("the LRU's links are broken or hold a referenced run")
            count += len(run.block_ids)
            cached.update(run.block_ids)
            run = run.next
        if count != self.num_cached or len(cached) != count:
            raise BlockManagerError(f"the LRU holds {count} blocks ({len(cached)} distinct), counted {self.num_cached}")
        return cached
