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
    slots whose bounds fall below it. The order is a stable sort of the sorted ids by
    (exact cost, then). `price` reads the cluster as it is: read a Ranking before the
    cluster changes (a placement, an event), as admission does."""

    def __init__(self, worker_ids: list[str], ranks: list[int], costs: Sequence[float],
                 then: Sequence[float], pending: Iterable[int], price: Callable[[int], float],
                 lead: int = -1):
        """`ranks`: each slot's place in `worker_ids` (the sorted ids); read, never changed.
        `lead`, a slot or -1: ranked first whatever its cost, the rest in order after it.
        Lists are read in place, not copied (a thousand workers' loads, where a caller
        takes the first worker): `costs` is copied only where slots are `pending`, since
        pricing writes into it."""
        self.worker_ids = worker_ids
        self.price = price
        self.pending = set(pending)
        self.costs = costs if isinstance(costs, list) and not self.pending else list(costs)
        self.then = then if isinstance(then, list) else list(then)
        self.ranks = ranks
        self.first = lead  # the slot ranked first, -1 until known
        # (cost, then, rank, slot) of the slots after the first, made when a second is read:
        # a caller that takes the first worker (admission, as a rule) pays a scan, not a heap
        self.heap: list[tuple[float, float, int, int]] | None = None
        self.ranked: list[str] = [worker_ids[ranks[lead]]] if lead >= 0 else []

    def __len__(self) -> int:
        return len(self.costs)

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
        if self.first < 0:
            self._rank_first()
            return
        heap, pending = self.heap, self.pending
        if heap is None:
            costs, then, ranks, first = self.costs, self.then, self.ranks, self.first
            heap = self.heap = [(costs[slot], then[slot], ranks[slot], slot) for slot in range(len(costs))
                                if slot != first]
            heapq.heapify(heap)
        while True:
            cost, then_value, rank, slot = heapq.heappop(heap)
            if slot not in pending:
                self.ranked.append(self.worker_ids[rank])
                return
            pending.discard(slot)
            heapq.heappush(heap, (self.price(slot), then_value, rank, slot))

    def _rank_first(self) -> None:
        """The least (cost, then, rank) by a scan, pricing the least while it is a bound."""
        costs, then, ranks, pending = self.costs, self.then, self.ranks, self.pending
        while True:
            best = 0
            best_cost, best_then, best_rank = costs[0], then[0], ranks[0]
            for slot in range(1, len(costs)):
                cost = costs[slot]
                if cost < best_cost or (cost == best_cost and (then[slot] < best_then or (
                        then[slot] == best_then and ranks[slot] < best_rank))):
                    best, best_cost, best_then, best_rank = slot, cost, then[slot], ranks[slot]
            if best not in pending:
                self.first = best
                self.ranked.append(self.worker_ids[best_rank])
                return
            pending.discard(best)
            costs[best] = self.price(best)
