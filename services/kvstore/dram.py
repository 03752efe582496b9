"""Storage tiers of the KV store: the small interface the index moves blocks through, and
the DRAM tier, one preallocated pool of fixed-size slots.

A tier only holds bytes in slots; which block a slot holds, and when blocks move between
tiers, is decided by the index (services/kvstore/index.py). The SSD tier implements the
same interface over its durable file records.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Set
from typing import Protocol

import numpy as np


class TierError(RuntimeError):
    """A tier's own bookkeeping is inconsistent, or it was asked to misuse a slot."""


class Tier(Protocol):
    """Fixed-size slots holding block bytes. Slot numbers are the tier's own, 0-based."""

    @property
    def name(self) -> str:
        """"dram", "ssd", ...: what block records and events call this tier."""
        ...

    @property
    def capacity(self) -> int:
        """Slots in all."""
        ...

    @property
    def used(self) -> int:
        """Slots allocated and not yet freed."""
        ...

    @property
    def block_bytes(self) -> int:
        """The most bytes one slot holds."""
        ...

    def alloc(self) -> int | None:
        """Take a free slot, or None when every slot is in use."""
        ...

    def free(self, slot: int) -> None:
        """Give back an allocated slot."""
        ...

    def read(self, slot: int, nbytes: int) -> memoryview:
        """The first `nbytes` bytes held in `slot` (valid until the slot is freed)."""
        ...

    def write(self, slot: int, data: memoryview | bytes) -> None:
        """Store `data` (at most block_bytes) at the start of `slot`."""
        ...

    def check_integrity(self, owned: Set[int]) -> None:
        """Raise TierError unless exactly the slots in `owned` are allocated."""
        ...


class SlotAllocator:
    """Which of a tier's `capacity` slots are taken: a free list and the taken set, with
    the checks every tier makes of them."""

    def __init__(self, name: str, capacity: int):
        self.name = name
        self.capacity = capacity
        self.free_slots: deque[int] = deque(range(capacity))
        self.taken: set[int] = set()

    @property
    def used(self) -> int:
        return len(self.taken)

    def alloc(self) -> int | None:
        if not self.free_slots:
            return None
        slot = self.free_slots.popleft()
        self.taken.add(slot)
        return slot

    def free(self, slot: int) -> None:
        self.check(slot)
        self.taken.remove(slot)
        self.free_slots.append(slot)

    def check(self, slot: int) -> None:
        """TierError unless `slot` is taken."""
        if slot not in self.taken:
            raise TierError(f"{self.name}: slot {slot} is not allocated")

    def check_integrity(self, owned: Set[int]) -> None:
        """TierError unless exactly the slots in `owned` are taken and the rest are free."""
        free = set(self.free_slots)
        if len(free) != len(self.free_slots):
            raise TierError(f"{self.name}: a slot is in the free list twice")
        if free & self.taken or len(free) + len(self.taken) != self.capacity:
            raise TierError(f"{self.name}: free list and allocation disagree")
        if self.taken != set(owned):
            raise TierError(f"{self.name}: allocated slots {sorted(self.taken ^ set(owned))[:10]} "
                            "disagree with the blocks the index places here")


class SlottedTier:
    """What every tier of fixed-size slots shares: its name and sizes, and the slots'
    bookkeeping (SlotAllocator). Subclasses add where the bytes live."""

    def __init__(self, name: str, capacity: int, block_bytes: int):
        if capacity <= 0 or block_bytes <= 0:
            raise ValueError(f"capacity and block_bytes must be positive, got {capacity}, {block_bytes}")
        self._name = name
        self._block_bytes = block_bytes
        self.slots = SlotAllocator(name, capacity)

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def used(self) -> int:
        return self.slots.used

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def alloc(self) -> int | None:
        return self.slots.alloc()

    def free(self, slot: int) -> None:
        self.slots.free(slot)

    def check_integrity(self, owned: Set[int]) -> None:
        self.slots.check_integrity(owned)


class DramTier(SlottedTier):
    """One preallocated numpy pool, `capacity × block_bytes` bytes, and a free list.

    `view(slot)` is a writable slice of the pool: a writer fills it between the index's
    start_put and commit, and the same-host fast path copies straight out of it.
    """

    def __init__(self, capacity: int, block_bytes: int, name: str = "dram"):
        super().__init__(name, capacity, block_bytes)
        self.pool = np.zeros((capacity, block_bytes), dtype=np.uint8)

    def view(self, slot: int) -> np.ndarray:
        """The whole slot as a writable uint8 array sharing the pool's memory."""
        self.slots.check(slot)
        return self.pool[slot]

    def read(self, slot: int, nbytes: int) -> memoryview:
        if not 0 <= nbytes <= self._block_bytes:
            raise TierError(f"cannot read {nbytes} bytes from a {self._block_bytes}-byte slot")
        return self.view(slot)[:nbytes].data

    def write(self, slot: int, data: memoryview | bytes) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        if source.size > self._block_bytes:
            raise TierError(f"{source.size} bytes do not fit a {self._block_bytes}-byte slot")
        self.view(slot)[:source.size] = source
