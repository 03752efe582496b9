"""The store's two tiers as the index sees them (services/kvstore/dram.py Tier): DRAM in
POSIX shared memory, which same-host engines map, and the SSD tier's durable records.

The shared-memory pool: docs/kvstore.md §2
The SSD record and the rebuild: docs/kvstore.md §3
"""
from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np

from common.logs import get_logger
from services.kvstore.dram import DramTier, SlottedTier, TierError
from services.kvstore.index import BlockKey, KVIndex, Namespace
from services.kvstore.ssd import HEADER_BYTES, DamagedRecord, SsdTier, SsdTierConfig, SyncPolicy

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "baton-kvstore-"
PAGE = 4096
# Inside each SSD record's payload, before the block's value: the parent block hash and a
# flag (1: has a parent; 0: first block of its chain).
_PARENT = struct.Struct("<QB7x")
PARENT_BYTES = _PARENT.size

log = get_logger("kvstore")


def crc32c(data: memoryview | bytes) -> int:
    """The store's block checksum (docs/kvstore.md §4)."""
    return int(google_crc32c.value(bytes(data)))


def namespace_bytes(namespace: int) -> bytes:
    """The index's and the SSD record's form of a namespace (a 64-bit root hash)."""
    return int(namespace).to_bytes(8, "little")


class DamagedBlock(TierError):
    """A tier's record failed its check on read: the block must not be served."""


class ShmDramTier(DramTier):
    """DramTier whose pool is a preallocated file under /dev/shm (mode 0600, unlinked on
    close), slot-major: slot s holds bytes [s*block_bytes, (s+1)*block_bytes). Same-host
    engines open the same file and copy straight in and out of leased or reserved slots."""

    def __init__(self, capacity: int, block_bytes: int, instance_id: str, directory: Path = SHM_DIR):
        # DramTier's own constructor would allocate a private pool: only the slots' part here.
        SlottedTier.__init__(self, "dram", capacity, block_bytes)
        self.swept = sweep_stale_pools(directory)
        _require_room(directory, capacity * block_bytes)
        self.path = directory / f"{SHM_PREFIX}{instance_id}"
        # Held open and flocked for the store's life: a later store that can take the lock
        # knows this one died (even by SIGKILL) and removes the file.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(self._fd, capacity * block_bytes)
        except BaseException:
            self.close()
            raise
        self.pool = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(capacity, block_bytes))

    def close(self) -> None:
        """Unlink the file; mappings engines still hold stay valid until they drop them."""
        self.path.unlink(missing_ok=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _require_room(directory: Path, pool_bytes: int) -> None:
    """The pool file is sparse, so a /dev/shm without room for it would show only later, as
    SIGBUS in whichever process writes a slot past the room: refuse now, naming the setting."""
    stat = os.statvfs(directory)
    room = stat.f_bavail * stat.f_frsize
    if room < pool_bytes:
        raise ValueError(f"kvstore_dram_gb: the DRAM tier needs {pool_bytes / 1e9:.2f} GB in {directory}, which has "
                         f"{room / 1e9:.2f} GB free (a container's /dev/shm is 64 MB unless it sets shm_size)")


def sweep_stale_pools(directory: Path) -> int:
    """Remove the pools of stores that died without unlinking theirs (no one holds their
    flock any more); how many went. The pool of a live store is left alone."""
    swept = 0
    for path in directory.glob(f"{SHM_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # another user's, or gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live store's
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        swept += 1
    return swept


@dataclass(frozen=True)
class Recovered:
    """What the rebuild of the index from the SSD records found (docs/kvstore.md §3)."""

    blocks: int  # indexed, with their whole chain
    orphans: int  # records dropped because a block of their chain was missing or damaged
    damaged: int  # records the SSD tier dropped (CRC32C, torn writes) or a read found damaged
    stale: int
    seconds: float


def ssd_config(directory: Path, ssd_gb: float, block_bytes: int) -> SsdTierConfig:
    """An SSD tier of about `ssd_gb` GB of slots that each hold one record of a block."""
    slot_bytes = -(-(HEADER_BYTES + PARENT_BYTES + block_bytes) // PAGE) * PAGE
    num_slots = max(1, int(ssd_gb * 1e9) // slot_bytes)
    return SsdTierConfig(directory, slot_bytes, num_slots, sync=SyncPolicy.BATCHED)


class SsdIndexTier(SlottedTier):
    """The SSD tier behind the index's Tier protocol. The SsdTier picks its own slot on
    each write, so the index's slots here are virtual, mapped to the record's real slot.
    Each record's payload is the parent prefix, then the block's value.

    A record found damaged by a read is logged (`kvstore_ssd_record_damaged`, naming the
    block and the reason), counted (`damaged_reads`, and `on_damaged` is called) and freed;
    the read raises DamagedBlock, and the caller drops the block from the index."""

    def __init__(self, ssd: SsdTier, block_bytes: int, on_damaged: Callable[[], None] | None = None):
        if ssd.config.max_payload < PARENT_BYTES + block_bytes:
            raise ValueError(f"SSD slots of {ssd.config.slot_bytes} bytes cannot hold {block_bytes}-byte blocks")
        super().__init__("ssd", ssd.config.num_slots, block_bytes)
        self.ssd = ssd
        self._real: dict[int, int] = {}  # virtual slot -> the SsdTier slot of its record
        self._labels: dict[int, tuple[bytes, int, int | None]] = {}
        self._on_damaged = on_damaged
        self.damaged_reads = 0

    def free(self, slot: int) -> None:
        super().free(slot)
        label = self._labels.pop(slot, None)
        real = self._real.pop(slot, None)
        if real is not None and label is not None and self.ssd.slot_of(label[0], label[1]) == real:
            self.ssd.free(real)

    def label(self, slot: int, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> None:
        if not isinstance(ns, bytes):
            raise TierError(f"the SSD tier keys namespaces as bytes, got {type(ns).__name__}")
        self._check(slot)
        self._labels[slot] = (ns, key, parent)

    def write(self, slot: int, data: memoryview | bytes) -> None:
        self._check(slot)
        if slot not in self._labels:
            raise TierError(f"ssd: slot {slot} written without its block's identity (label first)")
        if len(data) > self._block_bytes:
            raise TierError(f"{len(data)} bytes do not fit a {self._block_bytes}-byte slot")
        ns, key, parent = self._labels[slot]
        prefix = _PARENT.pack(parent or 0, parent is not None)
        self._real[slot] = self.ssd.write(ns, key, prefix + bytes(data))

    def read(self, slot: int, nbytes: int) -> memoryview:
        self._check(slot)
        real = self._real.get(slot)
        if real is None:
            raise DamagedBlock(f"ssd: slot {slot} holds no record")
        try:
            _, _, payload = self.ssd.read(real)
        except DamagedRecord as error:  # the SsdTier freed the record; the index drops the block
            del self._real[slot]
            self._damaged(slot, error)
            raise DamagedBlock(str(error)) from None
        return memoryview(payload)[PARENT_BYTES: PARENT_BYTES + nbytes]

    def _damaged(self, slot: int, error: DamagedRecord) -> None:
        self.damaged_reads += 1
        ns, key, _ = self._labels.get(slot, (b"", 0, None))
        log.warning("kvstore_ssd_record_damaged", namespace=f"{int.from_bytes(ns, 'little'):#x}", key=f"{key:#x}",
                    ssd_slot=error.slot, reason=error.reason, action="dropped")
        if self._on_damaged is not None:
            self._on_damaged()

    def adopt(self, real: int, ns: bytes, key: int, parent: int | None) -> int:
        """A virtual slot for a record the rebuild found in real slot `real`."""
        slot = self.alloc()
        assert slot is not None  # as many virtual slots as real ones
        self._real[slot] = real
        self._labels[slot] = (ns, key, parent)
        return slot

    def _check(self, slot: int) -> None:
        self.slots.check(slot)


def rebuild(index: KVIndex, tier_number: int, tier: SsdIndexTier) -> Recovered:
    """Index every SSD record whose whole chain is on the SSD, parents first; drop (free and
    count) the rest leaf-first, so no orphan is ever indexed (docs/kvstore.md §3)."""
    started = time.perf_counter()
    ssd = tier.ssd
    records: dict[tuple[bytes, int], tuple[int | None, int, int]] = {}  # -> (parent, real slot, checksum)
    damaged = 0
    for (ns, key), real in sorted(ssd.entries().items(), key=lambda item: item[1]):
        try:
            _, _, payload = ssd.read(real)
        except DamagedRecord:
            damaged += 1
            continue
        if len(payload) != PARENT_BYTES + tier.block_bytes:
            ssd.free(real)
            damaged += 1
            continue
        parent_key, has_parent = _PARENT.unpack_from(payload)
        records[(ns, key)] = (parent_key if has_parent else None, real, crc32c(payload[PARENT_BYTES:]))
    complete: dict[tuple[bytes, int], bool] = {}
    for block in records:
        _complete(block, records, complete)
    orphans = 0
    for (ns, key), ok in complete.items():
        if not ok:
            ssd.free(records[(ns, key)][1])
            orphans += 1
    depths: dict[tuple[bytes, int], int] = {}
    for ns, key in sorted((b for b, ok in complete.items() if ok), key=lambda b: _depth(b, records, depths)):
        parent, real, checksum = records[(ns, key)]
        slot = tier.adopt(real, ns, key, parent)
        index.restore(ns, key, parent, tier_number, slot, tier.block_bytes, checksum)
    ssd.sync()
    stats = ssd.stats()
    return Recovered(blocks=sum(complete.values()), orphans=orphans, damaged=damaged + stats.dropped_damaged,
                     stale=stats.dropped_stale, seconds=time.perf_counter() - started + stats.rebuild_seconds)


def _complete(block: tuple[bytes, int], records: dict, memo: dict[tuple[bytes, int], bool]) -> bool:
    """Whether every block up `block`'s chain is among `records` (iterative: chains are long)."""
    path = []
    current: tuple[bytes, int] | None = block
    result = True
    while current is not None:
        if current in memo:
            result = memo[current]
            break
        if current not in records:
            result = False
            break
        if current in path:  # a cycle cannot come from chained hashes: treat it as damage
            result = False
            break
        path.append(current)
        parent = records[current][0]
        current = None if parent is None else (current[0], parent)
    for seen in path:
        memo[seen] = result
    return result


def _depth(block: tuple[bytes, int], records: dict, memo: dict[tuple[bytes, int], int]) -> int:
    """Blocks above `block` in its (complete) chain."""
    path = []
    current = block
    while current not in memo:
        parent = records[current][0]
        if parent is None:
            memo[current] = 0
            break
        path.append(current)
        current = (current[0], parent)
    depth = memo[current]
    for seen in reversed(path):
        depth += 1
        memo[seen] = depth
    return memo[block]
