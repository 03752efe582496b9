"""Every way KV enters or leaves the engine, behind one seam (docs/architecture.md §7.1).

In, as vLLM's connector splits it: a scheduler half and a transfer half. The engine's
own prefix cache is matched first (`Engine.begin_load`); each `KvSource` then answers
`match` (how many of the blocks past it the source can give, and at what cost per block)
before any block is allocated, so the cost model picks the sources a request uses and
how many blocks to allocate for them (services/worker/kv_loads.py). The transfer half:
the chosen sources are asked in turn, cheapest first, each for what the ones before it
left (`start`, then `poll` reports the part, `cancel` stops it); then
`Engine.complete_load` lets the request decode (the whole prompt came) or prefill the
rest, and `Engine.cancel_load` ends it when a source failed with nothing late to land.
Out: every place KV leaves for is a `KvSink` the engine tells, on its loop, of what
it may take: the prefix cache's evictions (the KV store's write-back, `Writeback`, stages
copies for the store thread) and the end of a request that asked to hold its prompt's KV
(a prefill worker's leases, common/engine/leases.py, hold it for a decode worker's pull).

The sources themselves live with the roles that own their sockets and threads
(services/worker/kv_loads.py and the modules it names); this module holds what the
engine and every source share.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from common.engine.block_manager import BlockManager, EvictedBlock

if TYPE_CHECKING:
    from common.engine.leases import KvLease


@dataclass(frozen=True)
class StoreHint:
    """What the router's index says of a prompt (Generate.store_from, store_tiers): this
    engine's cache holds its first `start` blocks, the KV store the next len(tiers) in
    `tiers`, and the store lacks the block after them."""

    start: int
    tiers: tuple[int, ...]

    def run_from(self, block: int) -> int | None:
        """How many blocks from prompt block `block` on the store holds; None where the
        hint does not say (the cache ends elsewhere than the router believes)."""
        end = self.start + len(self.tiers)
        return end - block if self.start <= block <= end else None


@dataclass(frozen=True)
class KvLoad:
    """Where a request's prompt KV from elsewhere must land (docs/architecture.md §7.1):
    prompt block `first_block + i` goes to this engine's block `dst_block_ids[i]`. The
    leading `first_block` blocks this engine's prefix cache held are not loaded.
    `block_hashes[i]` names prompt block `first_block + i` where it is full (the KV
    store's key); a load `through_prompt_end` (the prompt was computed elsewhere) may end
    on a partial block, which has no name. `store_hint`, when the cluster knows it, says
    what the KV store can supply without asking it."""

    request_id: str
    namespace: int
    first_block: int
    dst_block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    through_prompt_end: bool
    store_hint: StoreHint | None = None

    @property
    def num_blocks(self) -> int:
        """The blocks the load covers: those allocated for it, or, shown to a plan before
        any is allocated (`Engine.begin_load`), those named."""
        return len(self.dst_block_ids) if self.dst_block_ids else len(self.block_hashes)


class KvLoadError(ValueError):
    """A load's blocks do not fit this engine (the source names them otherwise)."""


@dataclass(frozen=True)
class WritebackConfig:
    """Engine-side write-back to the KV store (docs/architecture.md §8)."""

    queue_blocks: int  # blocks staged at most; an eviction finding no room drops its copies
    min_hits: int = 0  # an evicted block is written back only if prefix matches reused it this often


@dataclass(frozen=True)
class StagedBlocks:
    """Copies of one eviction's blocks for the KV store, root-first within each chain:
    block i is `keys[i]` of namespace `namespaces[i]`, its parent is `parents[i]` (the
    namespace itself for a chain's first block), its value is `values[i]` (plane-major
    bytes, docs/kv-transfer.md)."""

    namespaces: tuple[int, ...]
    keys: tuple[int, ...]
    parents: tuple[int, ...]
    values: np.ndarray  # (n, bytes_per_block) uint8


class KnownBlocks:
    """A bounded set of (namespace, block hash) the KV store holds or that are staged for
    it: written back blocks are not staged again. The least recently added are forgotten
    first (forgetting one costs at most a redundant put). Thread-safe: the engine's loop
    reads and adds, the worker's store thread adds and discards."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[int | None, int]) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, namespace: int, keys: Iterable[int]) -> None:
        with self._lock:
            for key in keys:
                self._keys[(namespace, key)] = None
                self._keys.move_to_end((namespace, key))
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def discard(self, namespace: int, keys: Iterable[int]) -> None:
        with self._lock:
            for key in keys:
                self._keys.pop((namespace, key), None)


class WritebackQueue:
    """The bounded hand-off of staged copies from the engine's loop to the store thread.
    Never blocks: a push that does not fit is refused and counted as dropped."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._batches: list[StagedBlocks] = []
        self._blocks = 0
        self._oldest_pushed_at = 0.0  # time.monotonic() of the oldest batch still queued
        self._lock = threading.Lock()
        self.staged_blocks = 0  # counters, for metrics
        self.dropped_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self._blocks

    def oldest_age_s(self) -> float:
        """Seconds the oldest queued batch has waited; 0 when none is queued."""
        return time.monotonic() - self._oldest_pushed_at if self._batches else 0.0

    def room(self) -> int:
        return max(0, self.capacity_blocks - self._blocks)

    def push(self, batch: StagedBlocks) -> None:
        with self._lock:
            if not self._batches:
                self._oldest_pushed_at = time.monotonic()
            self._batches.append(batch)
            self._blocks += len(batch.keys)
            self.staged_blocks += len(batch.keys)

    def drop(self, count: int) -> None:
        with self._lock:
            self.dropped_blocks += count

    def pop_all(self) -> StagedBlocks | None:
        """Every queued batch as one, in push order (so still root-first), or None."""
        with self._lock:
            batches, self._batches = self._batches, []
            self._blocks = 0
        if not batches:
            return None
        if len(batches) == 1:
            return batches[0]
        return StagedBlocks(tuple(ns for b in batches for ns in b.namespaces),
                            tuple(key for b in batches for key in b.keys),
                            tuple(parent for b in batches for parent in b.parents),
                            np.concatenate([b.values for b in batches]))


@dataclass(frozen=True)
class Landed:
    """What a source's part of a load came to: its first `landed` blocks (counted from the
    part's `start`) hold their KV. `settled` False: late bytes may still land, so the
    load's blocks must never be reused. `error` says why fewer than asked landed."""

    request_id: str
    landed: int
    source: str
    error: str = ""
    settled: bool = True
    detail: object = None  # the source's own account of the part (a lease's: its PullResult)


@dataclass(frozen=True)
class Offer:
    """A source's answer to `match`, before anything is allocated or asked: it may give
    up to `blocks` of the load's blocks from the asked one on, at about `block_s` seconds
    a block. `sure`: it holds them all (a lease does); otherwise it only believes so, or
    only asking will tell, and it cannot stand in for another source. `why` names a
    refusal (blocks == 0), for metrics. `coming`: the source will have more of the load
    later (a prompt still being prefilled elsewhere), so the load waits for it rather
    than ending, and it may be asked again (`KvLoads.resume`)."""

    blocks: int
    block_s: float
    sure: bool = False
    why: str = ""
    coming: bool = False


def no_offer(why: str) -> Offer:
    return Offer(0, math.inf, why=why)


class KvSource(Protocol):
    """A place prompt KV comes from. `match` says what the source could give of a load
    from its block `start` on (the blocks before it are cached or landed from other
    sources) without asking anyone. `start` asks for them; `rival_block_s` is what a
    block costs the next best way (another source, or recomputing it), so a source whose
    own lookup finds its blocks dearer may give fewer, or none. It answers False when it
    gives nothing (no transfer started). Once started, `poll` reports the part exactly
    once, settled or not; `cancel` stops a part and answers True when no byte of it can
    land any more. Every method runs on the engine's loop and never blocks it."""

    name: str

    def match(self, load: KvLoad, start: int) -> Offer: ...

    def start(self, load: KvLoad, start: int, rival_block_s: float) -> bool: ...

    def poll(self) -> list[Landed]: ...

    def cancel(self, request_id: str) -> bool: ...


# ---- out: sinks ----------------------------------------------------------------------------

class KvSink(Protocol):
    """A place KV leaves the engine for. The engine tells every sink it has
    (`Engine.add_sink`), on its loop; a sink never blocks it. `evicted`: the prefix cache
    is about to reuse these cached blocks, whose KV is still intact (copy what you keep,
    now). `held`: a request that asked to hold its prompt's KV (`hold_kv`) ended; the
    first sink that answers a lease owns the prompt's blocks until it hands them back
    (`Engine.release_lease`), and the request's last output carries the lease."""

    name: str

    def evicted(self, blocks: list[EvictedBlock]) -> None: ...

    def held(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[int], num_tokens: int,
             last_token_id: int) -> KvLease | None: ...


class Writeback:
    """The KV store's write-back as a sink (docs/architecture.md §8): each evicted block
    reused at least `min_hits` times, with its ancestors the store is not known to hold,
    is copied root-first into `queue` for the worker's store thread; what finds no room
    is dropped (counted)."""

    name = "writeback"

    def __init__(self, config: WritebackConfig, known: KnownBlocks, block_manager: BlockManager,
                 read_blocks: Callable[[Sequence[int]], np.ndarray]):
        if config.queue_blocks <= 0 or config.min_hits < 0:
            raise ValueError(f"write-back: queue_blocks must be positive and min_hits >= 0, got {config}")
        self.config = config
        self.known = known
        self.queue = WritebackQueue(config.queue_blocks)
        self.block_manager = block_manager
        self.read_blocks = read_blocks

    def evicted(self, blocks: list[EvictedBlock]) -> None:
        chosen = self._chains(blocks)
        if not chosen:
            return
        room = self.queue.room()
        if len(chosen) > room:
            self.queue.drop(len(chosen) - room)
            chosen = chosen[:room]  # a root-first prefix: what is kept is still reachable
            if not chosen:
                return
        namespaces: list[int] = []
        parents: list[int] = []
        for block in chosen:  # _chains takes only blocks named with their chain
            assert block.root is not None and block.parent is not None
            namespaces.append(block.root)
            parents.append(block.parent)
        keys = [block.name for block in chosen]
        values = self.read_blocks([block.block_id for block in chosen])
        for namespace in set(namespaces):
            self.known.add(namespace, [key for key, ns in zip(keys, namespaces) if ns == namespace])
        self.queue.push(StagedBlocks(tuple(namespaces), tuple(keys), tuple(parents), values))

    def held(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[int], num_tokens: int,
             last_token_id: int) -> KvLease | None:
        return None  # write-back takes blocks as they are evicted, not as requests end

    def _chains(self, evicted: list[EvictedBlock]) -> list[EvictedBlock]:
        """Each evicted block reused at least `min_hits` times, preceded by its ancestors
        that the store is not known to hold and this engine still has (this eviction's
        blocks or cached ones), root-first, each block once."""
        manager, known = self.block_manager, self.known
        in_batch = {block.name: block for block in evicted}
        seen: set[int] = set()
        chosen: list[EvictedBlock] = []
        for block in evicted:
            if block.root is None or block.hits < self.config.min_hits:
                continue
            chain: list[EvictedBlock] = []
            current: EvictedBlock | None = block
            while current is not None and current.root is not None and current.name not in seen \
                    and (current.root, current.name) not in known:
                chain.append(current)
                seen.add(current.name)
                parent = current.parent
                if parent is None or parent == current.root:
                    break
                current = in_batch.get(parent)
                if current is None:
                    current = manager.named(parent)
            chosen.extend(reversed(chain))
        return chosen
