"""Block bookkeeping of the KV store: which blocks it holds, in which tier and slot, who
is writing, reading or pinning them, and which to move or drop when a tier fills.

Plain CPU code, no sockets, no clocks: every method that cares about time takes `now`.

A block is keyed by (namespace, block hash). The namespace is an opaque id fingerprinting
model, dtype, KV layout and tenant salt; nothing ever crosses namespaces. Block hashes are
the chained names of docs/kv-identity.md, so a block names its parent (the previous block
of its chain) and the index keeps, per block, the set of its stored children.

Invariants (`check_integrity` verifies them all):
  * every stored block's parent is stored, in the same namespace (no orphans), and a
    committed block's parent is committed;
  * a block is pending (start_put without commit) or committed; a pending block is never
    visible to lookup or get, is never leased or pinned, and is held by exactly one ticket;
  * each block owns exactly one slot of exactly one tier, and each tier's allocated slots
    are exactly those its blocks own;
  * leased, pinned and pending blocks are never moved or dropped by eviction;
  * eviction is leaf-first: a block is only dropped when it has no stored children, and
    only demoted out of a tier when none of its children is in that tier or above.

Tiers are ordered fastest first (tiers[0] is DRAM, where puts land). Eviction in tier t
demotes a block worth keeping to tier t+1 when that tier has a free slot, else drops it;
a get promotes the blocks it reads back to tiers[0] when a slot is free.

Eviction order is LRU by a logical touch counter (start of a put, commit, get): the
index's own counter, so it does not depend on callers' clocks. Finding victims scans the
tier's blocks once per eviction round, which is O(blocks) and fine for the sizes a first
store holds; a maintained leaf list is the obvious next step if it shows up in profiles.
"""
from __future__ import annotations

import heapq
import itertools
import math
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from services.kvstore.dram import Tier

Namespace = bytes | str
BlockKey = int  # a chained block hash (common/hashing.py)
Checksum = Callable[[memoryview], int]
EventKind = Literal["stored", "moved", "evicted", "removed"]


def crc32(data: memoryview) -> int:
    """The default block checksum: zlib's CRC-32 (the SSD tier may plug in CRC32C)."""
    return zlib.crc32(data)


# ---- errors ------------------------------------------------------------------------


class IndexIntegrityError(RuntimeError):
    """Bookkeeping is inconsistent: a bug, never a caller's error."""


class KVStoreError(Exception):
    """A request the store refuses; the subclasses say why."""


class StoreFull(KVStoreError):
    """No slot in the first tier could be freed: every block is pending, leased or pinned."""


class QuotaExceeded(KVStoreError):
    """The namespace holds its quota of blocks and none of its own could be dropped."""


class ChecksumMismatch(KVStoreError):
    """The bytes in the slot do not match the writer's checksum; the put is undone."""


class MissingParent(KVStoreError):
    """A put names a parent the store does not hold (in this namespace)."""


class ParentNotCommitted(KVStoreError):
    """A commit comes before its parent's; the put stays pending."""


class PutInProgress(KVStoreError):
    """Another put of the same block is pending."""


class UnknownTicket(KVStoreError):
    """The ticket was committed, aborted, or reclaimed after its timeout."""


class UnknownLease(KVStoreError):
    """The lease was released or expired."""


class BlockNotFound(KVStoreError):
    """No committed block under this key in this namespace."""


class BlockBusy(KVStoreError):
    """The block (or a descendant) is leased or pinned, so it cannot be removed."""


@runtime_checkable
class IdentifiedTier(Protocol):
    """A tier whose records name their block (the SSD tier: a rebuild after a restart
    reads the identity and parent link back from the record). The index calls `label`
    right before each `write` into a slot it moved a block to."""

    def label(self, slot: int, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> None: ...


# ---- configuration and records ----------------------------------------------------


@dataclass(frozen=True)
class IndexConfig:
    """Policy of the index. Watermarks are fractions of each tier's slots."""

    high_watermark: float = 0.9  # evict when a tier's use goes above this ...
    low_watermark: float = 0.8  # ... down to this
    put_timeout_s: float = 30.0  # a put not committed within this is reclaimed
    lease_timeout_s: float = 30.0  # a read lease not released within this expires
    demote_min_hits: int = 1  # gets a block needs to be demoted rather than dropped
    promote_on_get: bool = True  # a get moves blocks it reads up to the first tier
    quota_blocks: int | None = None  # per-namespace cap on stored blocks, all tiers together
    quotas: Mapping[Namespace, int] = field(default_factory=dict)  # per-namespace overrides
    quota_policy: Literal["evict", "refuse"] = "evict"  # a put beyond quota: drop own leaves, or refuse
    max_events: int = 4096  # events kept for the router before the oldest are dropped

    def __post_init__(self) -> None:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(f"need 0 < low <= high <= 1, got {self.low_watermark}, {self.high_watermark}")
        if self.put_timeout_s <= 0 or self.lease_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_events <= 0:
            raise ValueError("max_events must be positive")

    def quota_for(self, ns: Namespace) -> int | None:
        return self.quotas.get(ns, self.quota_blocks)


@dataclass
class _Block:
    ns: Namespace
    key: BlockKey
    parent: BlockKey | None
    tier: int  # index into the store's tiers
    slot: int
    nbytes: int
    committed: bool = False
    checksum: int | None = None
    children: set[BlockKey] = field(default_factory=set)
    leases: int = 0
    pins: int = 0
    hits: int = 0
    ticket: int = 0  # the pending put's ticket; 0 once committed
    touch: int = 0  # logical LRU time: larger is more recent


@dataclass(frozen=True)
class PutTicket:
    """A reserved slot to write one block into, then commit. `already_stored` means the
    block was committed before: nothing is reserved (slot is -1) and commit is a no-op."""

    ticket_id: int
    ns: Namespace
    key: BlockKey
    tier: str
    slot: int
    nbytes: int
    deadline: float
    already_stored: bool = False


@dataclass(frozen=True)
class BlockLocation:
    key: BlockKey
    tier: str
    slot: int
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class ReadLease:
    """The leading blocks of a get, held against eviction until released or expired."""

    lease_id: int
    ns: Namespace
    blocks: tuple[BlockLocation, ...]
    expires_at: float


@dataclass(frozen=True)
class PrefixMatch:
    """How many leading keys a lookup found committed, and each one's tier."""

    length: int
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    ns: Namespace
    key: BlockKey
    tier: str  # where the block is now (stored, moved) or was (evicted, removed)
    from_tier: str | None = None  # moved only


@dataclass(frozen=True)
class _Lease:
    ns: Namespace
    keys: tuple[BlockKey, ...]
    expires_at: float


# ---- the index ----------------------------------------------------------------------


class KVIndex:
    """The store's bookkeeping over `tiers`, fastest first. tiers[0] takes every put."""

    def __init__(self, config: IndexConfig, tiers: Sequence[Tier], checksum: Checksum = crc32):
        if not tiers:
            raise ValueError("the index needs at least one tier")
        if len({t.name for t in tiers}) != len(tiers):
            raise ValueError("tier names must differ")
        self.config = config
        self.tiers = list(tiers)
        self.checksum = checksum
        self._blocks: dict[tuple[Namespace, BlockKey], _Block] = {}
        self._ns_count: dict[Namespace, int] = {}
        self._pending: dict[int, tuple[tuple[Namespace, BlockKey], float]] = {}  # ticket -> (block, deadline)
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.events: deque[KVEvent] = deque(maxlen=config.max_events)
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "commits", "already_stored", "checksum_failures", "puts_reclaimed", "leases_expired",
             "gets", "hit_blocks", "evicted", "demoted", "promoted", "removed", "quota_evictions",
             "quota_refusals", "store_full"), 0)

    # ---- writes ---------------------------------------------------------------------

    def start_put(self, ns: Namespace, key: BlockKey, parent: BlockKey | None, nbytes: int,
                  now: float) -> PutTicket:
        """Reserve a slot of the first tier for one block. The caller writes the bytes
        into `view(ticket.slot)` (or tiers[0].write) and then calls `commit`.

        Idempotent: a block already committed gets a ticket with `already_stored` set and
        nothing reserved. The parent, if any, must be stored (pending or committed)."""
        top = self.tiers[0]
        if not 0 < nbytes <= top.block_bytes:
            raise ValueError(f"a block of {nbytes} bytes does not fit {top.block_bytes}-byte slots")
        existing = self._blocks.get((ns, key))
        if existing is not None:
            if not existing.committed:
                raise PutInProgress(f"block {key:#x} is being written")
            existing.touch = next(self._clock)
            self.counters["already_stored"] += 1
            return PutTicket(0, ns, key, self.tiers[existing.tier].name, -1, existing.nbytes, now,
                             already_stored=True)
        parent_block = None if parent is None else self._blocks.get((ns, parent))
        if parent is not None and parent_block is None:
            raise MissingParent(f"parent {parent:#x} of block {key:#x} is not stored")
        if parent_block is not None:
            parent_block.pins += 1  # making room must not drop the parent we are about to extend
        try:
            self._make_quota_room(ns)
            slot = self._alloc_top()
        finally:
            if parent_block is not None:
                parent_block.pins -= 1
        ticket_id = next(self._ids)
        deadline = now + self.config.put_timeout_s
        self._link(_Block(ns, key, parent, 0, slot, nbytes, ticket=ticket_id, touch=next(self._clock)))
        self._pending[ticket_id] = ((ns, key), deadline)
        self.counters["puts"] += 1
        self._enforce_watermarks()
        return PutTicket(ticket_id, ns, key, top.name, slot, nbytes, deadline)

    def view(self, slot: int) -> memoryview:
        """The writable bytes of a first-tier slot (for the writer of a put)."""
        return self.tiers[0].read(slot, self.tiers[0].block_bytes)

    def commit(self, ticket: PutTicket, checksum: int) -> None:
        """Make a put visible after checking the caller's checksum over the slot's bytes.

        A mismatch undoes the put (slot freed) and raises ChecksumMismatch. A parent that
        is still pending raises ParentNotCommitted and leaves this put pending."""
        if ticket.already_stored:
            return
        block = self._pending_block(ticket)
        if block.parent is not None and not self._blocks[(block.ns, block.parent)].committed:
            raise ParentNotCommitted(f"commit parent {block.parent:#x} before block {block.key:#x}")
        actual = self.checksum(self.tiers[block.tier].read(block.slot, block.nbytes))
        if actual != checksum:
            self.counters["checksum_failures"] += 1
            self._drop_pending(ticket.ticket_id)
            raise ChecksumMismatch(f"block {block.key:#x}: checksum {checksum:#x}, bytes give {actual:#x}")
        del self._pending[ticket.ticket_id]
        block.committed, block.ticket = True, 0
        block.checksum = checksum
        block.touch = next(self._clock)
        self.counters["commits"] += 1
        self._event("stored", block)
        self._enforce_watermarks()  # a pending block could not be evicted; now it can

    def abort(self, ticket: PutTicket) -> None:
        """Give up a put: its slot is freed (and any pending puts under it)."""
        if not ticket.already_stored:
            self._pending_block(ticket)
            self._drop_pending(ticket.ticket_id)

    def reclaim(self, now: float) -> int:
        """Undo puts past their deadline and end leases past theirs; how many of each in all."""
        late_puts = [t for t, (_, deadline) in self._pending.items() if deadline <= now]
        done = 0
        for ticket_id in late_puts:
            if ticket_id in self._pending:  # a parent's reclaim may have taken it already
                self._drop_pending(ticket_id)
                self.counters["puts_reclaimed"] += 1
                done += 1
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self._end_lease(lease_id)
            self.counters["leases_expired"] += 1
            done += 1
        self._enforce_watermarks()
        return done

    # ---- reads ----------------------------------------------------------------------

    def lookup(self, ns: Namespace, keys: Iterable[BlockKey]) -> PrefixMatch:
        """The longest prefix of `keys` held committed in `ns`. Takes nothing, moves nothing."""
        tiers: list[str] = []
        for key in keys:
            block = self._blocks.get((ns, key))
            if block is None or not block.committed:
                break
            tiers.append(self.tiers[block.tier].name)
        return PrefixMatch(len(tiers), tuple(tiers))

    def get(self, ns: Namespace, keys: Iterable[BlockKey], now: float) -> ReadLease:
        """Lease the longest committed prefix of `keys` against eviction, promoting blocks
        from lower tiers to the first when a slot is free there. An empty prefix gives an
        empty lease (still to release, harmlessly)."""
        found: list[_Block] = []
        for key in keys:
            block = self._blocks.get((ns, key))
            if block is None or not block.committed:
                break
            found.append(block)
        for block in found:
            block.leases += 1
            block.hits += 1
            block.touch = next(self._clock)
        if self.config.promote_on_get:
            try:
                for block in found:
                    if block.tier != 0:
                        self._promote(block)
            except Exception:
                for block in found:  # a tier failed to read a block back: no lease is taken
                    block.leases -= 1
                raise
        lease_id = next(self._ids)
        expires_at = now + self.config.lease_timeout_s
        self._leases[lease_id] = _Lease(ns, tuple(b.key for b in found), expires_at)
        self.counters["gets"] += 1
        self.counters["hit_blocks"] += len(found)
        locations = tuple(BlockLocation(b.key, self.tiers[b.tier].name, b.slot, b.nbytes, b.checksum or 0)
                          for b in found)
        return ReadLease(lease_id, ns, locations, expires_at)

    def release(self, lease: ReadLease) -> None:
        if lease.lease_id not in self._leases:
            raise UnknownLease(f"lease {lease.lease_id} was released or expired")
        self._end_lease(lease.lease_id)
        self._enforce_watermarks()

    def restore(self, ns: Namespace, key: BlockKey, parent: BlockKey | None, tier: int, slot: int,
                nbytes: int, checksum: int) -> None:
        """Adopt a committed block a tier already holds in `slot` (allocated there), as a
        store rebuilding its index from durable records after a restart does. Parents
        must be restored before their children; nothing is written, no event recorded."""
        if (ns, key) in self._blocks:
            raise KVStoreError(f"block {key:#x} is already indexed")
        if parent is not None and (ns, parent) not in self._blocks:
            raise MissingParent(f"parent {parent:#x} of block {key:#x} is not restored")
        self._link(_Block(ns, key, parent, tier, slot, nbytes, committed=True, checksum=checksum,
                          touch=next(self._clock)))

    def empty_tier(self, tier: int) -> None:
        """Move every movable block out of `tier` (demoted where the next tier has room,
        else dropped, leaf-first as always): a store stopping flushes its DRAM this way."""
        self._evict(tier, 0)

    # ---- management -----------------------------------------------------------------

    def pin(self, ns: Namespace, key: BlockKey) -> None:
        """Keep a committed block from eviction until as many unpins."""
        self._committed(ns, key).pins += 1

    def unpin(self, ns: Namespace, key: BlockKey) -> None:
        block = self._committed(ns, key)
        if block.pins == 0:
            raise KVStoreError(f"block {key:#x} is not pinned")
        block.pins -= 1

    def remove(self, ns: Namespace, key: BlockKey) -> int:
        """Drop a committed block and every block stored under it (they are unreachable
        without it). Refused with BlockBusy if any of them is leased or pinned. Returns
        how many blocks went."""
        root = self._committed(ns, key)
        subtree = self._subtree(root)
        if any(b.leases or b.pins for b in subtree):
            raise BlockBusy(f"block {key:#x} or a block under it is leased or pinned")
        for block in reversed(subtree):  # children before parents
            if not block.committed:
                self._pending.pop(block.ticket)
            else:
                self._event("removed", block)
            self._drop(block)
        self.counters["removed"] += len(subtree)
        return len(subtree)

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last drain, oldest first (at most max_events)."""
        events = list(self.events)
        self.events.clear()
        return events

    def stats(self) -> dict[str, object]:
        committed = sum(b.committed for b in self._blocks.values())
        return {
            "blocks": committed,
            "pending": len(self._blocks) - committed,
            "leases": len(self._leases),
            "pinned": sum(b.pins > 0 for b in self._blocks.values()),
            "namespaces": len(self._ns_count),
            "tiers": {t.name: {"used": t.used, "capacity": t.capacity} for t in self.tiers},
            **self.counters,
        }

    # ---- integrity ------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IndexIntegrityError (or the tier's TierError) unless every invariant in the
        module docstring holds."""
        owned: list[set[int]] = [set() for _ in self.tiers]
        ns_count: dict[Namespace, int] = {}
        for (ns, key), block in self._blocks.items():
            if (block.ns, block.key) != (ns, key):
                raise IndexIntegrityError(f"block {key:#x} is filed under another key")
            if block.slot in owned[block.tier]:
                raise IndexIntegrityError(f"two blocks own slot {block.slot} of {self.tiers[block.tier].name}")
            owned[block.tier].add(block.slot)
            ns_count[ns] = ns_count.get(ns, 0) + 1
            self._check_links(block)
            if not block.committed and (block.leases or block.pins or block.tier != 0):
                raise IndexIntegrityError(f"pending block {key:#x} is leased, pinned or moved")
            if block.committed == bool(block.ticket):
                raise IndexIntegrityError(f"block {key:#x}: a ticket must mark exactly the pending blocks")
            if block.leases < 0 or block.pins < 0:
                raise IndexIntegrityError(f"block {key:#x} has a negative lease or pin count")
        for tier, slots in zip(self.tiers, owned):
            tier.check_integrity(slots)
        if ns_count != self._ns_count:
            raise IndexIntegrityError("per-namespace block counts disagree with the blocks")
        pending = {ticket: block for ticket, (block, _) in self._pending.items()}
        if pending != {b.ticket: k for k, b in self._blocks.items() if not b.committed}:
            raise IndexIntegrityError("pending tickets are not exactly the uncommitted blocks")
        leased: dict[tuple[Namespace, BlockKey], int] = {}
        for lease in self._leases.values():
            for key in lease.keys:
                leased[(lease.ns, key)] = leased.get((lease.ns, key), 0) + 1
        if leased != {k: b.leases for k, b in self._blocks.items() if b.leases}:
            raise IndexIntegrityError("lease counts disagree with the open leases")

    def _check_links(self, block: _Block) -> None:
        if block.parent is not None:
            parent = self._blocks.get((block.ns, block.parent))
            if parent is None:
                raise IndexIntegrityError(f"block {block.key:#x} is stored without its parent")
            if block.key not in parent.children:
                raise IndexIntegrityError(f"parent {parent.key:#x} does not list child {block.key:#x}")
            if block.committed and not parent.committed:
                raise IndexIntegrityError(f"committed block {block.key:#x} has a pending parent")
        for child_key in block.children:
            child = self._blocks.get((block.ns, child_key))
            if child is None or child.parent != block.key:
                raise IndexIntegrityError(f"block {block.key:#x} lists a child {child_key:#x} it is not parent of")

    # ---- internals: records -----------------------------------------------------------

    def _link(self, block: _Block) -> None:
        self._blocks[(block.ns, block.key)] = block
        self._ns_count[block.ns] = self._ns_count.get(block.ns, 0) + 1
        if block.parent is not None:
            self._blocks[(block.ns, block.parent)].children.add(block.key)

    def _drop(self, block: _Block) -> None:
        """Forget a block with no stored children and free its slot."""
        assert not block.children, "leaf-first: children go before their parent"
        self.tiers[block.tier].free(block.slot)
        del self._blocks[(block.ns, block.key)]
        self._ns_count[block.ns] -= 1
        if not self._ns_count[block.ns]:
            del self._ns_count[block.ns]
        if block.parent is not None:
            self._blocks[(block.ns, block.parent)].children.discard(block.key)

    def _subtree(self, root: _Block) -> list[_Block]:
        """The block and all blocks stored under it, parents before children."""
        order, frontier = [root], [root]
        while frontier:
            block = frontier.pop()
            for child_key in block.children:
                child = self._blocks[(block.ns, child_key)]
                order.append(child)
                frontier.append(child)
        return order

    def _pending_block(self, ticket: PutTicket) -> _Block:
        entry = self._pending.get(ticket.ticket_id)
        if entry is None:
            raise UnknownTicket(f"put of block {ticket.key:#x} was committed, aborted or reclaimed")
        return self._blocks[entry[0]]

    def _drop_pending(self, ticket_id: int) -> None:
        """Undo a pending put. Everything stored under a pending block is pending too
        (commits go parent first), so its whole subtree goes with it."""
        block_key, _ = self._pending.pop(ticket_id)
        subtree = self._subtree(self._blocks[block_key])
        for block in reversed(subtree):
            if block is not subtree[0]:
                self._pending.pop(block.ticket)
            self._drop(block)

    def _committed(self, ns: Namespace, key: BlockKey) -> _Block:
        block = self._blocks.get((ns, key))
        if block is None or not block.committed:
            raise BlockNotFound(f"no committed block {key:#x} in this namespace")
        return block

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        for key in lease.keys:
            self._blocks[(lease.ns, key)].leases -= 1

    def _event(self, kind: EventKind, block: _Block, from_tier: int | None = None) -> None:
        source = None if from_tier is None else self.tiers[from_tier].name
        self.events.append(KVEvent(kind, block.ns, block.key, self.tiers[block.tier].name, source))

    # ---- internals: placement and eviction ----------------------------------------------

    def _alloc_top(self) -> int:
        """A free first-tier slot, evicting down to the low watermark if there is none."""
        slot = self.tiers[0].alloc()
        if slot is None:
            self._evict(0, self._low(0))
            slot = self.tiers[0].alloc()
        if slot is None:
            self.counters["store_full"] += 1
            raise StoreFull(f"every {self.tiers[0].name} slot is pending, leased or pinned")
        return slot

    def _high(self, tier: int) -> int:
        return math.floor(self.config.high_watermark * self.tiers[tier].capacity)

    def _low(self, tier: int) -> int:
        return math.floor(self.config.low_watermark * self.tiers[tier].capacity)

    def _enforce_watermarks(self) -> None:
        """Evict each tier above its high watermark down to its low one, fastest first
        (demotions out of one tier may push the next one over)."""
        for tier in range(len(self.tiers)):
            if self.tiers[tier].used > self._high(tier):
                self._evict(tier, self._low(tier))

    def _movable(self, block: _Block, tier: int) -> bool:
        """May eviction take this block out of `tier`? Not if pending, leased or pinned,
        nor while a child sits in this tier or a faster one (leaf-first)."""
        if block.tier != tier or not block.committed or block.leases or block.pins:
            return False
        return all(self._blocks[(block.ns, c)].tier > tier for c in block.children)

    def _evict(self, tier: int, target_used: int) -> None:
        """Demote or drop LRU movable blocks of `tier` until it uses at most `target_used`."""
        heap = [(b.touch, i, b) for i, b in enumerate(self._blocks.values()) if self._movable(b, tier)]
        heapq.heapify(heap)
        tie = itertools.count(len(heap))
        while self.tiers[tier].used > target_used and heap:
            _, _, block = heapq.heappop(heap)
            if (block.ns, block.key) not in self._blocks or not self._movable(block, tier):
                continue
            if not self._demote(block) and not self._evict_drop(block):
                continue  # has children in lower tiers and nowhere to go: it stays
            parent = self._blocks.get((block.ns, block.parent)) if block.parent is not None else None
            if parent is not None and self._movable(parent, tier):
                heapq.heappush(heap, (parent.touch, next(tie), parent))

    def _demote(self, block: _Block) -> bool:
        """Move a block one tier down if it is worth keeping and that tier has a free slot.
        A block with stored children is always worth keeping (dropping it orphans them)."""
        below = block.tier + 1
        if below >= len(self.tiers):
            return False
        if block.hits < self.config.demote_min_hits and not block.children:
            return False
        if not self._move(block, below):
            return False
        self.counters["demoted"] += 1
        return True

    def _evict_drop(self, block: _Block) -> bool:
        if block.children:
            return False
        self._event("evicted", block)
        self._drop(block)
        self.counters["evicted"] += 1
        return True

    def _promote(self, block: _Block) -> None:
        """Move a leased block up to the first tier if a slot is free there (a get never
        evicts to promote: the block is readable where it is)."""
        if self._move(block, 0):
            self.counters["promoted"] += 1

    def _move(self, block: _Block, tier: int) -> bool:
        target = self.tiers[tier]
        slot = target.alloc()
        if slot is None:
            return False
        source = self.tiers[block.tier]
        try:
            if isinstance(target, IdentifiedTier):
                target.label(slot, block.ns, block.key, block.parent)
            target.write(slot, source.read(block.slot, block.nbytes))
        except Exception:
            target.free(slot)  # the block stays where it was
            raise
        source.free(block.slot)
        from_tier, block.tier, block.slot = block.tier, tier, slot
        self._event("moved", block, from_tier)
        return True

    def _make_quota_room(self, ns: Namespace) -> None:
        """Before a put in `ns`: under the evict policy drop the namespace's own LRU
        droppable leaves until one more block fits; else raise QuotaExceeded."""
        quota = self.config.quota_for(ns)
        if quota is None or self._ns_count.get(ns, 0) < quota:
            return
        if self.config.quota_policy == "evict":
            while self._ns_count.get(ns, 0) >= quota:
                leaves = [b for b in self._blocks.values()
                          if b.ns == ns and not b.children and self._movable(b, b.tier)]
                if not leaves:
                    break
                self._evict_drop(min(leaves, key=lambda b: b.touch))
                self.counters["quota_evictions"] += 1
            if self._ns_count.get(ns, 0) < quota:
                return
        self.counters["quota_refusals"] += 1
        raise QuotaExceeded(f"namespace holds {self._ns_count.get(ns, 0)} blocks, quota {quota}")
