"""A ranking of workers made as it is read, for costs some of which are known only as
lower bounds until priced (docs/router.md §8.6)."""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload


class Ranking(Sequence[str]):
    """Worker ids by ascending (cost, then, id), made as they are read. Some slots' costs
    are known only as lower bounds (`pending`) until `price(slot)` gives the exact cost,
    which must be no lower: a slot is priced only when its bound comes first among those
    not yet ranked, so a caller that takes the first worker that admits prices only the
    slots whose bounds fall below it. The order is the one ClusterState.order_by gives
    on the exact costs. `price` reads the cluster as it is: read a Ranking before the
    cluster changes (a placement, an event), as admission does."""

    def __init__(self, worker_ids: list[str], ranks: Sequence[int], costs: Sequence[float],
                 then: Sequence[float], pending: Iterable[int], price: Callable[[int], float]):
        """`ranks`: each slot's place in `worker_ids` (the sorted ids)."""
        self.worker_ids = worker_ids
        self.price = price
        self.pending = set(pending)
        # (cost, then, rank, slot): tuples compare as order_by's stable sorts do
        self.heap = [(cost, then[slot], ranks[slot], slot) for slot, cost in enumerate(costs)]
        heapq.heapify(self.heap)
        self.ranked: list[str] = []

    def __len__(self) -> int:
        return len(self.ranked) + len(self.heap)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        while len(self.ranked) <= index:
            self._rank_next()
        return self.ranked[index]

    def __iter__(self) -> Iterator[str]:
        index = 0
        while index < len(self):
            yield self[index]
            index += 1

    def _rank_next(self) -> None:
        heap, pending = self.heap, self.pending
        while True:
            cost, then, rank, slot = heapq.heappop(heap)
            if slot not in pending:
                self.ranked.append(self.worker_ids[rank])
                return
            pending.discard(slot)
            heapq.heappush(heap, (self.price(slot), then, rank, slot))
