"""The cluster prefix index: which worker holds which KV block (docs/router.md §2).

Blocks are named by the chained hash of docs/kv-identity.md §1. Workers report the names they store
and evict (KV events); in approximate mode the router instead records what it placed,
and each entry expires after a TTL. With events, a placed prompt's blocks are held on
credit until its events arrive (`expect`, `settle`): a long prefill takes seconds, and
the requests that share its prompt and arrive meanwhile must find it. A credit is named
block by block only when something could see it (docs/router.md §2), so placing a
request costs O(1) here and the naming is paid by the event or the request that reads
it. For each block the
index keeps its hits over a sliding window; its holders, each holder's expiry and its
place in each holder's LRU are kept per run of blocks that share them (`Run`), cut only
where an event, a credit or a reuse treats the run's blocks apart.

Matching a prompt walks its blocks from the root and stops at the first block no worker
holds, so it costs O(matched blocks), never O(tokens × workers). Each node also keeps
its children keyed by their token bytes: a prefix seen before is walked by dictionary
lookups, and a block's hash is computed only the first time its tokens are seen; every
SEGMENT_BLOCKS-th node also keeps the runs walks went below it, so a known prefix is
mostly taken a run of blocks at a time (docs/router.md §2).
Plain CPU code on caller-given times, so the live router and the simulator share it.

With the cluster's KV store (docs/router.md §7) a block may also be held by the store, in
one of its tiers, apart from its worker holders: the store's events fill `store_tiers` (block
name -> tier, off the nodes, so a cluster without a store pays nothing per node), and a block
neither a worker nor the store holds is forgotten.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Set

import numpy as np
import xxhash

_hash = xxhash.xxh3_64_intdigest
NEVER = math.inf
EXACT_LRU_BLOCKS = 256  # a worker's LRU up to this size is reordered on every hit
SEGMENT_BLOCKS = 32  # a walk compares this many blocks at once where it went before


def _common_blocks(a: bytes, b: bytes, block_bytes: int) -> int:
    """How many leading blocks of `block_bytes` bytes `a` and `b` share (a binary search,
    each probe one comparison in C)."""
    low, high = 0, min(len(a), len(b)) // block_bytes
    while low < high:  # the first `low` blocks are shared, those after `high` are not
        mid = (low + high + 1) // 2
        if a[:mid * block_bytes] == b[:mid * block_bytes]:
            low = mid
        else:
            high = mid - 1
    return low


class BlockKeys:
    """A prompt's full blocks as token bytes (little-endian uint32 ids), the keys a walk
    follows: key i is block i's bytes and span(i, j) those of blocks i to j - 1, each
    sliced out of the prompt's bytes when asked for, so a walk makes only what it reads.
    `data` is the prompt's bytes, made once: a walk compares runs against it in place
    (bytes.startswith at an offset), with no copy per segment."""

    __slots__ = ("data", "block_bytes", "count")

    def __init__(self, data: bytes, block_bytes: int):
        self.data = data
        self.block_bytes = block_bytes
        self.count = len(data) // block_bytes

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> bytes:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return self.data[i * self.block_bytes:(i + 1) * self.block_bytes]

    def span(self, start: int, stop: int) -> bytes:
        return self.data[start * self.block_bytes:min(stop, self.count) * self.block_bytes]


_NO_KEYS = BlockKeys(b"", 1)


class BlockNode:
    """One named block (or, with depth -1 and no parent, the root of a hash chain)."""

    __slots__ = ("block_hash", "parent", "key", "depth", "run", "children",
                 "hit_epoch", "hits_now", "hits_before", "lead", "ahead")

    def __init__(self, block_hash: int):
        self.block_hash = block_hash
        self.parent: BlockNode | None = None
        self.key = b""  # this block's token bytes, the key in parent.children
        self.depth = -1  # index of the block in its prompt; -1 while unknown
        # The run of blocks that share this one's holders and LRU places; None while no
        # worker holds it (docs/router.md §2).
        self.run: Run | None = None
        # The children by key: None, the one child (most blocks have one: its key is its
        # own), or a dict once a second is linked; no dict per node (docs/evaluation.md §3.4).
        self.children: BlockNode | dict[bytes, BlockNode] | None = None
        self.hit_epoch = 0  # the half-window of the last hit; hits in it and in the one before
        self.hits_now = 0
        self.hits_before = 0
        # Segments: a node whose depth + 1 is a multiple of SEGMENT_BLOCKS (or a root) is a
        # segment head. `ahead` keeps, per first block below it, the longest run of up to
        # SEGMENT_BLOCKS blocks from there that a walk went (their keys' bytes and nodes),
        # dropped when one of those nodes is forgotten; `lead` is the first block of this
        # node's segment (its parent the head).
        self.lead: BlockNode | None = None
        self.ahead: dict[bytes, tuple[bytes, list[BlockNode]]] | None = None


class Run:
    """Blocks that share fate: the same holders, each holder's same expiry, and one place
    in each holder's LRU, where they lie next to each other in `nodes`' order (least
    recent first). The index keeps holders and LRU places per run, not per block, and cuts
    a run only where an event, a credit or a reuse treats its blocks apart."""

    __slots__ = ("nodes", "holders", "signature")

    def __init__(self, nodes: list[BlockNode]):
        self.nodes = nodes
        self.holders: dict[str, Hold] = {}  # worker id -> the run's place in its LRU, in holding order
        self.signature = 0  # XOR of the holders' worker bits: equal signatures, equal holder sets


class Hold:
    """A worker's hold on a run: its link in the worker's LRU of runs (a circular list
    through the worker's `Lru.head`) and its expiry (NEVER with KV events)."""

    __slots__ = ("run", "expiry", "prev", "next")

    def __init__(self, run: Run | None, expiry: float):
        self.run = run  # None for an Lru's head
        self.expiry = expiry
        self.prev: Hold = self
        self.next: Hold = self

    def unlink(self) -> None:
        self.prev.next = self.next
        self.next.prev = self.prev

    def insert_before(self, other: Hold) -> None:
        """Link this hold just before `other` (before the head: at the recent end)."""
        last = other.prev
        self.prev, self.next = last, other
        last.next = self
        other.prev = self


class Lru:
    """A worker's runs, least recently used first, and how many blocks they hold."""

    __slots__ = ("head", "blocks")

    def __init__(self) -> None:
        self.head = Hold(None, NEVER)
        self.blocks = 0

    def __iter__(self) -> Iterator[BlockNode]:
        """The blocks, least recent first (as they stand: deferred credits and moves not made)."""
        head = self.head
        hold = head.next
        while hold is not head:
            run = hold.run
            assert run is not None  # only a head has none
            yield from run.nodes
            hold = hold.next


def window_hits(node: BlockNode, current: int) -> int:
    """`node`'s hits over the full window that ends in half-window `current` (flushed ones)."""
    if node.hit_epoch == current:
        return node.hits_now + node.hits_before
    return node.hits_now if node.hit_epoch == current - 1 else 0


class Credit:
    """Blocks a placement holds on credit: the prompt's full-block `keys` after the first
    `held`, which its `worker_id` already holds; `path` is the prompt's known prefix when
    it was placed. `blocks` is None until the credit is named, then the names credited
    (the blocks the worker lacked); naming lets `keys` and `path` go (release())."""

    __slots__ = ("worker_id", "root_hash", "keys", "path", "held", "now", "blocks")

    def __init__(self, worker_id: str, root_hash: int, keys: BlockKeys, path: list[BlockNode],
                 held: int, now: float):
        self.worker_id = worker_id
        self.root_hash = root_hash
        self.keys = keys
        self.path = path
        self.held = held
        self.now = now
        self.blocks: list[int] | None = None

    def release(self) -> None:
        """Drop the prompt's bytes and path once named: a request in flight keeps its
        credit, and the memory its prompt's copy frees is what the next one reuses."""
        self.keys = _NO_KEYS
        self.path = []


class Reuse:
    """A placement's reuse of `path` (a prefix its `worker_id` holds) whose move to the
    recent end of the worker's LRU waits, like a credit, until something could see it."""

    __slots__ = ("worker_id", "path")

    def __init__(self, worker_id: str, path: list[BlockNode]):
        self.worker_id = worker_id
        self.path = path


def _position(nodes: list[BlockNode], node: BlockNode) -> int:
    """Where `node` is in its run's `nodes`. The ends first: a stretch most often starts a
    run (a reuse, a chain stored again) or ends it (an eviction, tail first), and
    list.index reads every node before it (cold, in a large index)."""
    if nodes[0] is node:
        return 0
    last = len(nodes) - 1
    return last if nodes[last] is node else nodes.index(node)


def _stretch(seq: list[BlockNode] | list[BlockNode | None], i: int, nodes: list[BlockNode], first: int) -> int:
    """Where the stretch of `seq` from i that is `nodes` from `first` on, in order, ends
    (seq[i] is nodes[first]). Compared a slice at a time: nodes are equal only to
    themselves, so a list comparison is a row of pointer comparisons in C."""
    low, high = 1, min(len(seq) - i, len(nodes) - first)
    if seq[i:i + high] == nodes[first:first + high]:  # most often the whole rest
        return i + high
    while low < high - 1:  # the first `low` items agree, the first `high` do not
        mid = (low + high) // 2
        if seq[i:i + mid] == nodes[first:first + mid]:
            low = mid
        else:
            high = mid
    return i + low


def _stretch_down(seq: list[BlockNode | None], i: int, nodes: list[BlockNode], first: int) -> int:
    """Where the stretch of `seq` from i that is `nodes` from `first` down, in reverse
    order, ends (seq[i] is nodes[first]): an engine names what it evicts tail first."""
    low, high = 1, min(len(seq) - i, first + 1)
    if seq[i:i + high] == nodes[first + 1 - high:first + 1][::-1]:
        return i + high
    while low < high - 1:  # the first `low` items agree, the first `high` do not
        mid = (low + high) // 2
        if seq[i:i + mid] == nodes[first + 1 - mid:first + 1][::-1]:
            low = mid
        else:
            high = mid
    return i + low


class PrefixIndex:
    def __init__(self, block_size: int, window_s: float = 180.0, ttl_s: float | None = None):
        """`ttl_s` None: entries live until a removed event (events mode); otherwise
        each entry expires `ttl_s` after its last placement (approximate mode)."""
        self.block_size = block_size
        self.block_bytes = 4 * block_size
        self.half_window_s = window_s / 2
        self.ttl_s = ttl_s
        self.nodes: dict[int, BlockNode] = {}
        self.roots: dict[int, BlockNode] = {}
        self.lru: dict[str, Lru] = {}  # per worker, its runs least recent first
        self.changed: set[str] = set()  # workers whose LRU changed since the owner last looked
        self.worker_bits: dict[str, int] = {}
        self.expiries: deque[tuple[float, str, int]] = deque()  # approximate mode, in time order
        # Hits not yet counted on the nodes: the deepest block of each reused prefix -> how
        # many placements reused it, in half-window `pending_epoch`. A node's ancestors are
        # its prefix, so one entry stands for the whole path; hits() counts them first.
        self.pending_hits: dict[BlockNode, int] = {}
        self.pending_epoch = 0
        self.lru_clock: dict[str, int] = {}  # per worker, blocks moved to its recent end so far
        self.last_touch: dict[str, tuple[BlockNode, int]] = {}  # per worker: (deepest block, clock)
        self.unconfirmed: dict[str, set[int]] = {}  # per worker, blocks held on credit (expect)
        # Credits placed but not yet named and reuses not yet moved in their LRUs, in
        # placement order, with the (root, first block key) pairs of the credits' prompts
        # and the workers of both: what may read them (see expect and record_hits).
        self.deferred: list[Credit | Reuse] = []
        self.unnamed_heads: set[tuple[int, bytes]] = set()
        self.deferred_workers: set[str] = set()
        self.store_tiers: dict[int, int] = {}  # block the KV store holds -> its tier (0 = DRAM, 1 = SSD)

    # ---- reading ---------------------------------------------------------------------

    def block_keys(self, prompt: bytes | np.ndarray) -> BlockKeys:
        """The prompt's full blocks' keys (a prompt given as little-endian uint32 ids)."""
        data = prompt if isinstance(prompt, bytes) else prompt.tobytes()
        return BlockKeys(data, self.block_bytes)

    def walk(self, root_hash: int, keys: BlockKeys) -> list[BlockNode]:
        """Nodes of the prompt's longest prefix of full blocks that the index names.

        Segment by segment: the blocks a segment shares with the run a walk went below
        its head are taken at once (a few comparisons of their bytes); the rest block
        by block, each a lookup of its key among the node's children (or,
        for a child not linked yet, of its hash among all nodes)."""
        data, block_bytes, count = keys.data, keys.block_bytes, keys.count
        if count and (root_hash, data[:block_bytes]) in self.unnamed_heads:
            self.name_credits()
        node = self.roots.get(root_hash)
        if node is None:
            node = self.roots[root_hash] = BlockNode(root_hash)
        path: list[BlockNode] = []
        end, segment_bytes = count * block_bytes, SEGMENT_BLOCKS * block_bytes
        start = 0  # the segment's first byte in `data`
        while start < end:
            head, first = node, len(path)  # a segment head
            stop = start + segment_bytes
            if stop > end:
                stop = end
            lead_key = data[start:start + block_bytes]
            ahead = head.ahead.get(lead_key) if head.ahead is not None else None
            same = 0
            if ahead is not None:
                run_bytes, run = ahead
                same = len(run) if data.startswith(run_bytes, start, stop) \
                    else _common_blocks(data[start:stop], run_bytes, block_bytes)
                if same:
                    path += run if same == len(run) else run[:same]
                    node = path[-1]
                    if same == SEGMENT_BLOCKS:
                        start = stop
                        continue
            for offset in range(start + same * block_bytes, stop, block_bytes):
                child = self._step(node, data[offset:offset + block_bytes], len(path))
                if child is None:
                    break
                path.append(child)
                node = child
            walked = len(path) - first
            if walked and (ahead is None or walked > len(ahead[1])):
                if head.ahead is None:
                    head.ahead = {}
                head.ahead[lead_key] = (data[start:start + walked * block_bytes], path[first:])
            if walked < SEGMENT_BLOCKS:
                break
            start = stop
        return path

    def _step(self, node: BlockNode, key: bytes, depth: int) -> BlockNode | None:
        """The child of `node` whose key this is (linking it if only its hash is known)."""
        children = node.children
        if children is None:
            child = None
        elif isinstance(children, dict):
            child = children.get(key)
        else:
            child = children if children.key == key else None
        if child is None:
            child = self.nodes.get(_hash(node.block_hash.to_bytes(8, "little") + key))
            if child is not None:
                self._link(node, key, child, depth)
        return child

    def match(self, path: list[BlockNode]) -> dict[str, int]:
        """Worker id -> how many leading blocks of `path` it holds (only workers with ≥ 1).

        Holder sets are compared only where the path enters a run whose signature differs
        from the one before, so a match costs O(blocks) pointer comparisons however many
        workers share the prefix (holder sets rarely change along a chain). Call expire()
        first in approximate mode.
        """
        if not path:
            return {}
        matched: dict[str, int] = {}
        run = path[0].run
        if run is None:
            return matched
        alive: Set[str] = run.holders.keys()
        signature = run.signature
        depth = 0
        for node in path:  # the loop does no more than compare: changes are rare
            here = node.run
            if here is not run:
                run = here
                if here is None:
                    for worker_id in alive:
                        matched[worker_id] = depth
                    return matched
                if here.signature != signature:
                    still = alive & here.holders.keys()
                    for worker_id in alive - still:
                        matched[worker_id] = depth
                    if not still:
                        return matched
                    alive, signature = still, here.signature
            depth += 1
        for worker_id in alive:
            matched[worker_id] = depth
        return matched

    def hits(self, node: BlockNode, now: float) -> int:
        """Hits of `node` over the last full window (two half-windows)."""
        if self.pending_hits:
            self.flush_hits()
        return window_hits(node, int(now / self.half_window_s))

    def lru_blocks(self, worker_id: str) -> Iterator[BlockNode]:
        """The worker's blocks, least recently used first."""
        self._name_credits_of(worker_id)
        lru = self.lru.get(worker_id)
        return iter(lru) if lru is not None else iter(())

    def num_blocks(self, worker_id: str) -> int:
        self._name_credits_of(worker_id)
        lru = self.lru.get(worker_id)
        return lru.blocks if lru is not None else 0

    def holders(self, node: BlockNode) -> dict[str, float]:
        """Worker id -> when its hold on the block expires (NEVER with KV events)."""
        run = node.run
        return {worker_id: hold.expiry for worker_id, hold in run.holders.items()} if run is not None else {}

    def __len__(self) -> int:
        self.name_credits()
        return len(self.nodes)

    @property
    def store_blocks(self) -> int:
        """How many blocks the KV store holds."""
        return len(self.store_tiers)

    def store_run(self, path: list[BlockNode], start: int) -> list[int]:
        """How many blocks of each store tier the store holds from `path[start]` on, up to
        the first block it lacks: [DRAM blocks, SSD blocks, ...], [] if it lacks path[start]."""
        counts: list[int] = []
        tiers = self.store_tiers
        for depth in range(start, len(path)):
            tier = tiers.get(path[depth].block_hash)
            if tier is None:
                break
            while len(counts) <= tier:
                counts.append(0)
            counts[tier] += 1
        return counts

    # ---- writing ---------------------------------------------------------------------

    def stored(self, worker_id: str, block_hashes: Iterable[int], now: float) -> None:
        """A worker holds these blocks now (a KV event, or a placement in approximate mode)."""
        self.name_credits()
        nodes = self.nodes
        known = nodes.get
        held: list[BlockNode] = []
        node: BlockNode | None = None
        for block_hash in block_hashes:
            # An event names a chain, parent first, so a block is most often the previous
            # block's one child: read there, it costs no probe of the table of every node
            # (a few cold reads each). A linked child is always that table's node.
            child = node.children if node is not None else None
            if child is None or isinstance(child, dict) or child.block_hash != block_hash:
                child = known(block_hash)
                if child is None:
                    child = nodes[block_hash] = BlockNode(block_hash)
            held.append(child)
            node = child
        self._hold(worker_id, held, now)

    def _hold(self, worker_id: str, held: list[BlockNode], now: float) -> None:
        """`stored` for the blocks' nodes: the worker holds them, most recently used last.

        Taken a run at a time: each stretch of `held` that is a stretch of one run is cut
        out of it (in every holder's LRU) and moved to the worker's recent end, or joined
        by the worker; a stretch of blocks no one held becomes a run of its own."""
        expiry = now + self.ttl_s if self.ttl_s is not None else NEVER
        lru = self._lru_of(worker_id)
        bit = self._worker_bit(worker_id)
        self._touched(worker_id)
        credited = self.unconfirmed.get(worker_id)
        if credited:  # only held blocks are on credit: discarding any other is a no-op
            credited.difference_update([node.block_hash for node in held])
        head = lru.head
        count = len(held)
        i = 0
        while i < count:
            node = held[i]
            run = node.run
            if run is None:  # no one holds it: it starts a run with the unheld blocks after it
                piece = Run([node])
                node.run = piece
                i += 1
                while i < count and held[i].run is None:
                    held[i].run = piece
                    piece.nodes.append(held[i])
                    i += 1
            else:
                first = _position(run.nodes, node)
                stop = _stretch(held, i, run.nodes, first)
                piece = self._isolate(run, first, first + stop - i)
                i = stop
            hold = piece.holders.get(worker_id)
            if hold is None:
                hold = piece.holders[worker_id] = Hold(piece, expiry)
                piece.signature ^= bit
                lru.blocks += len(piece.nodes)
            else:
                hold.unlink()
                hold.expiry = expiry
            hold.insert_before(head)
        if self.ttl_s is not None:
            self.expiries.extend((expiry, worker_id, node.block_hash) for node in held)
        self.lru_clock[worker_id] = self.lru_clock.get(worker_id, 0) + count

    def removed(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """The worker no longer holds these blocks (a KV event): a stretch of one run at a
        time, in either direction (an engine evicts a chain's tail first)."""
        self.name_credits()
        bit = self._worker_bit(worker_id)
        self._touched(worker_id)
        lru = self.lru.get(worker_id)
        if lru is None:  # it holds nothing
            return
        credited = self.unconfirmed.get(worker_id)
        known = self.nodes.get
        found = [known(block_hash) for block_hash in block_hashes]
        count = len(found)
        i = 0
        while i < count:
            node = found[i]
            run = node.run if node is not None else None
            if node is None or run is None or worker_id not in run.holders:
                i += 1
                continue
            nodes = run.nodes
            first = _position(nodes, node)
            stop = _stretch(found, i, nodes, first)
            if stop > i + 1:
                piece = self._isolate(run, first, first + stop - i)
            else:
                stop = _stretch_down(found, i, nodes, first)
                piece = self._isolate(run, first - (stop - i) + 1, first + 1)
            hold = piece.holders.pop(worker_id)
            hold.unlink()
            piece.signature ^= bit
            lru.blocks -= stop - i
            if credited:
                credited.difference_update([found_node.block_hash for found_node in piece.nodes])
            if not piece.holders:
                self._let_go([gone for gone in found[i:stop] if gone is not None])  # in the event's order
            i = stop

    def drop_worker(self, worker_id: str) -> None:
        """Forget everything a worker held (it left or restarted with an empty cache)."""
        self.name_credits()
        bit = self._worker_bit(worker_id)
        self.lru_clock.pop(worker_id, None)
        self.last_touch.pop(worker_id, None)
        self.unconfirmed.pop(worker_id, None)
        lru = self.lru.pop(worker_id, None)
        if lru is None:
            return
        head = lru.head
        hold = head.next
        while hold is not head:
            run = hold.run
            assert run is not None  # only a head has none
            del run.holders[worker_id]
            run.signature ^= bit
            if not run.holders:
                self._let_go(run.nodes)
            hold = hold.next

    def _let_go(self, nodes: list[BlockNode]) -> None:
        """These blocks' run has lost its last holder: forget those the store lacks."""
        stored = self.store_tiers
        for node in nodes:
            node.run = None
            if node.block_hash not in stored:
                self._forget(node)

    def store_stored(self, block_hashes: list[int], tiers: list[int]) -> None:
        """The KV store holds these blocks now, block_hashes[i] in tier tiers[i] (a stored
        or a moved event: a move of a block not known here is as good as a store)."""
        self.name_credits()
        nodes = self.nodes
        store_tiers = self.store_tiers
        for block_hash, tier in zip(block_hashes, tiers):
            if block_hash not in nodes:
                nodes[block_hash] = BlockNode(block_hash)
            store_tiers[block_hash] = tier

    def store_evicted(self, block_hashes: list[int]) -> None:
        """The KV store no longer holds these blocks."""
        self.name_credits()
        for block_hash in block_hashes:
            if self.store_tiers.pop(block_hash, None) is not None:
                node = self.nodes[block_hash]  # a stored block always has its node
                if node.run is None:
                    self._forget(node)

    def drop_store(self) -> None:
        """Forget every block the store held (it restarted as a new instance)."""
        self.name_credits()
        stored, self.store_tiers = self.store_tiers, {}
        for block_hash in stored:
            node = self.nodes[block_hash]
            if node.run is None:
                self._forget(node)

    def record_hits(self, path: list[BlockNode], worker_id: str, now: float) -> None:
        """A request placed on `worker_id` reuses these blocks (a prefix of a path it
        holds, as match() reports): count the hits and make them its most recently used.

        Both stay off the per-block path where they can: the hits wait in pending_hits
        under the path's deepest block (repeats of a prefix merge there); the move waits
        with the credits (docs/router.md §2), done in placement order before anything
        reads or reorders the worker's LRU (see expect), so every read sees the order a
        move here would have made. A worker with more than EXACT_LRU_BLOCKS blocks that
        reuses the same prefix again, before half its LRU has turned over, keeps the order
        it has: the prefix is still in the recent half, away from the old end where
        evictions (and eviction samples) come from. The index keeps `path` until then:
        the caller must not change it."""
        self._touched(worker_id)
        if not path:
            return
        epoch = int(now / self.half_window_s)
        if epoch != self.pending_epoch:
            self.flush_hits()
            self.pending_epoch = epoch
        tail = path[-1]
        self.pending_hits[tail] = self.pending_hits.get(tail, 0) + 1
        self.deferred.append(Reuse(worker_id, path))
        self.deferred_workers.add(worker_id)

    def _move_to_recent(self, reuse: Reuse) -> None:
        """The LRU move record_hits deferred: each stretch of the path that is a stretch
        of a run the worker holds, cut out and moved to its recent end."""
        worker_id, path = reuse.worker_id, reuse.path
        tail = path[-1]
        lru = self._lru_of(worker_id)
        clock = self.lru_clock.get(worker_id, 0)
        last = self.last_touch.get(worker_id)
        if (last is not None and last[0] is tail and lru.blocks > EXACT_LRU_BLOCKS
                and clock - last[1] < lru.blocks // 2):
            return
        head = lru.head
        count = len(path)
        i = 0
        while i < count:
            node = path[i]
            run = node.run
            if run is None or worker_id not in run.holders:  # not the worker's: a caller passed more than it holds
                i += 1
                continue
            first = _position(run.nodes, node)
            stop = _stretch(path, i, run.nodes, first)
            piece = self._isolate(run, first, first + stop - i)
            hold = piece.holders[worker_id]
            hold.unlink()
            hold.insert_before(head)
            i = stop
        self.lru_clock[worker_id] = clock = clock + count
        self.last_touch[worker_id] = (tail, clock)

    def flush_hits(self) -> None:
        """Count the pending hits on every block of each pending prefix."""
        epoch = self.pending_epoch
        for tail, count in self.pending_hits.items():
            node: BlockNode | None = tail
            # Only a node without a parent (a root, or a block not linked) may have depth
            # -1, so the depth is read once per chain, at its end: a depth past 256 is an
            # int object of its own, one more cold read per block.
            while node is not None:
                parent = node.parent
                if parent is None and node.depth < 0:
                    break
                if node.hit_epoch == epoch:
                    node.hits_now += count
                else:
                    node.hits_before = node.hits_now if node.hit_epoch == epoch - 1 else 0
                    node.hits_now, node.hit_epoch = count, epoch
                node = parent
        self.pending_hits.clear()

    def placed(self, worker_id: str, root_hash: int, keys: BlockKeys, path: list[BlockNode],
               now: float) -> None:
        """Approximate mode: predict that `worker_id` now holds every full block of the
        prompt whose block `keys` these are (`path` is its already-known prefix)."""
        nodes = path + self._name_rest(root_hash, keys, path)
        self.stored(worker_id, [node.block_hash for node in nodes], now)

    def expect(self, worker_id: str, root_hash: int, keys: BlockKeys, path: list[BlockNode],
               held: int, now: float) -> Credit:
        """Events mode: the prompt whose block `keys` these are (`path` its already-known
        prefix, of which the worker holds the first `held` blocks) was just placed on
        `worker_id`. Count the worker as holding every full block of it until KV events
        confirm them (a stored event) or deny them (removed). Returns the credit; pass it
        to `settle` when the request ends.

        The credit is named (its blocks hashed, made nodes and held) only when something
        could see it, in placement order: before any event or store event, before a walk
        of a prompt with the same first block (a prompt without it shares none of its
        blocks), and before a read or a reorder of the worker's LRU. So every read sees
        what naming it here would have shown, and a placement costs O(1)."""
        credit = Credit(worker_id, root_hash, keys, path, held, now)
        if held < len(keys):  # else the worker holds every block (matched = the prompt)
            self.deferred.append(credit)
            self.unnamed_heads.add((root_hash, keys[0]))
            self.deferred_workers.add(worker_id)
            self._touched(worker_id)
        else:
            credit.blocks = []
            credit.release()
        return credit

    def settle(self, credit: Credit) -> None:
        """The request `expect` made this credit for has ended: forget the blocks no
        event confirmed (the worker refused it, failed, or never stored them)."""
        self.name_credits()
        pending = self.unconfirmed.get(credit.worker_id)
        if pending and credit.blocks:
            self.removed(credit.worker_id, [block_hash for block_hash in credit.blocks if block_hash in pending])

    def credited(self, credit: Credit) -> list[int]:
        """The blocks the credit holds for its worker (those it lacked when placed)."""
        self.name_credits()
        assert credit.blocks is not None  # named above, or made with none
        return credit.blocks

    def name_credits(self) -> None:
        """Name every credit placed and not yet named, and make every deferred LRU move,
        oldest first."""
        if not self.deferred:
            return
        deferred, self.deferred = self.deferred, []
        self.unnamed_heads.clear()
        self.deferred_workers.clear()
        for item in deferred:
            if isinstance(item, Credit):
                self._name(item)
            else:
                self._move_to_recent(item)

    def _name_credits_of(self, worker_id: str) -> None:
        if worker_id in self.deferred_workers:
            self.name_credits()

    def _name(self, credit: Credit) -> None:
        """What the credit holds: the known blocks the worker lacked and the rest of the
        prompt. O(blocks after `held`)."""
        worker_id, path = credit.worker_id, credit.path
        held = [node for node in path[credit.held:] if node.run is None or worker_id not in node.run.holders]
        held += self._name_rest(credit.root_hash, credit.keys, path)
        credit.blocks = blocks = [node.block_hash for node in held]
        credit.release()
        if blocks:
            touched = worker_id in self.changed
            self._hold(worker_id, held, credit.now)
            if not touched:  # expect marked it; a sample read since must stay valid
                self.changed.discard(worker_id)
            self.unconfirmed.setdefault(worker_id, set()).update(blocks)

    def _name_rest(self, root_hash: int, keys: BlockKeys, path: list[BlockNode]) -> list[BlockNode]:
        """The nodes of the prompt's full blocks after `path`, named (and linked) here."""
        parent = path[-1] if path else self.roots[root_hash]
        rest: list[BlockNode] = []
        data, block_bytes = keys.data, keys.block_bytes
        nodes = self.nodes
        known = nodes.get
        for depth in range(len(path), keys.count):
            key = data[depth * block_bytes:(depth + 1) * block_bytes]
            children = parent.children
            if children is None:
                child = None
            elif isinstance(children, dict):
                child = children.get(key)
            else:  # the one child
                child = children if children.key == key else None
            if child is None:
                block_hash = _hash(parent.block_hash.to_bytes(8, "little") + key)
                child = known(block_hash)
                if child is None:
                    child = nodes[block_hash] = BlockNode(block_hash)
                self._link(parent, key, child, depth)
            rest.append(child)
            parent = child
        return rest

    def expire(self, now: float) -> int:
        """Drop approximate entries whose TTL passed; returns how many."""
        dropped = 0
        while self.expiries and self.expiries[0][0] <= now:
            expiry, worker_id, block_hash = self.expiries.popleft()
            node = self.nodes.get(block_hash)
            run = node.run if node is not None else None
            hold = run.holders.get(worker_id) if run is not None else None
            if hold is not None and hold.expiry == expiry:  # not refreshed since
                self.removed(worker_id, (block_hash,))
                dropped += 1
        return dropped

    def check(self) -> None:
        """Raise AssertionError where the runs break their contract: each worker's LRU a
        closed list of holds on non-empty runs that name it back, its block count theirs;
        each run's nodes pointing to it and in it once, its signature its holders' bits;
        a node held exactly when its run is in some LRU; a node nobody holds kept only
        while the store holds it. For tests: O(blocks)."""
        seen: dict[int, Run] = {}  # id(run) -> run, every run some LRU links
        for worker_id, lru in self.lru.items():
            head, blocks = lru.head, 0
            hold = head.next
            assert head.run is None and head.next.prev is head, worker_id
            while hold is not head:
                run = hold.run
                assert run is not None and run.holders.get(worker_id) is hold, worker_id
                assert hold.next.prev is hold and hold.prev.next is hold, worker_id
                assert run.nodes, "an empty run"
                blocks += len(run.nodes)
                seen[id(run)] = run
                hold = hold.next
            assert blocks == lru.blocks, (worker_id, blocks, lru.blocks)
        placed: set[int] = set()  # id(node) of every node in a run
        for run in seen.values():
            signature = 0
            for worker_id in run.holders:
                assert worker_id in self.lru, worker_id
                signature ^= self._worker_bit(worker_id)
            assert signature == run.signature, "a stale signature"
            for node in run.nodes:
                assert node.run is run and id(node) not in placed, node.block_hash
                assert self.nodes.get(node.block_hash) is node, node.block_hash
                placed.add(id(node))
        for block_hash, node in self.nodes.items():
            assert node.block_hash == block_hash
            if node.run is None:
                assert block_hash in self.store_tiers, f"{block_hash} is kept with no holder"
            else:
                assert id(node) in placed, f"{block_hash} is in a run no LRU links"

    # ---- internals -------------------------------------------------------------------

    def _worker_bit(self, worker_id: str) -> int:
        """A random-looking 62-bit word per worker, for holder-set signatures. 62 bits, not
        64: compiled code keeps an int below 2**62 unboxed, so a signature's XOR on every
        held or dropped block allocates nothing and match() compares machine words."""
        bit = self.worker_bits.get(worker_id)
        if bit is None:
            bit = self.worker_bits[worker_id] = (_hash(worker_id.encode()) >> 2) or 1
        return bit

    def _touched(self, worker_id: str) -> None:
        self.changed.add(worker_id)

    def _lru_of(self, worker_id: str) -> Lru:
        lru = self.lru.get(worker_id)
        if lru is None:
            lru = self.lru[worker_id] = Lru()
        return lru

    @staticmethod
    def _isolate(run: Run, start: int, stop: int) -> Run:
        """The run of exactly `run`'s blocks start to stop - 1, cut from the rest (in every
        holder's LRU, those before it just before it and those after just after). The
        largest part stays in `run`, so a cut relinks the fewer blocks."""
        nodes = run.nodes
        size = len(nodes)
        if start == 0 and stop == size:
            return run
        parts = [(low, high) for low, high in ((0, start), (start, stop), (stop, size)) if low < high]
        kept = 0
        for k in range(1, len(parts)):
            if parts[k][1] - parts[k][0] > parts[kept][1] - parts[kept][0]:
                kept = k
        runs: list[Run] = []
        for k, (low, high) in enumerate(parts):
            if k == kept:
                runs.append(run)
                continue
            part = Run(nodes[low:high])
            for node in part.nodes:
                node.run = part
            part.signature = run.signature
            runs.append(part)
        low, high = parts[kept]
        run.nodes = nodes[low:high]
        for worker_id, hold in run.holders.items():
            expiry = hold.expiry
            neighbour = hold
            for k in range(kept - 1, -1, -1):  # the parts before, each just before the next
                link = runs[k].holders[worker_id] = Hold(runs[k], expiry)
                link.insert_before(neighbour)
                neighbour = link
            neighbour = hold
            for k in range(kept + 1, len(runs)):  # the parts after, each just after the one before
                link = runs[k].holders[worker_id] = Hold(runs[k], expiry)
                link.insert_before(neighbour.next)
                neighbour = link
        return runs[1] if start > 0 else runs[0]

    @staticmethod
    def _link(parent: BlockNode, key: bytes, child: BlockNode, depth: int) -> None:
        children = parent.children
        if children is None or (not isinstance(children, dict) and children.key == key):
            parent.children = child
        elif isinstance(children, dict):
            children[key] = child
        else:
            parent.children = {children.key: children, key: child}
        child.parent, child.key, child.depth = parent, key, depth
        child.lead = child if depth % SEGMENT_BLOCKS == 0 else parent.lead

    def _forget(self, node: BlockNode) -> None:
        del self.nodes[node.block_hash]
        parent = node.parent
        if parent is not None:
            children = parent.children
            if children is node:
                parent.children = None
            elif isinstance(children, dict) and children.get(node.key) is node:
                del children[node.key]
        self._drop_run(node)
        node.parent = node.lead = node.ahead = None

    @staticmethod
    def _drop_run(node: BlockNode) -> None:
        """Drop the memoized run that `node` is in, if any (see BlockNode.ahead)."""
        lead = node.lead
        head = lead.parent if lead is not None else None
        if lead is None or head is None or not head.ahead:
            return
        run = head.ahead.get(lead.key)
        at = node.depth - lead.depth
        if run is not None and at < len(run[1]) and run[1][at] is node:
            del head.ahead[lead.key]
