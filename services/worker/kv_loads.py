"""The loop's side of every KV load (common/engine/kv_connector.py): a request's blocks
past the local prefix cache are allocated once (`Engine.begin_load`), its sources are
asked in order, each for what the ones before it did not land, and the load ends when a
source leaves nothing to ask or none is left. The role then completes it in the engine
(`Engine.complete_load`, or `cancel_load` when what it needed did not come).

Which sources a role asks, and in what order, is the role's: a co-located or prefill
worker asks the KV store and computes the rest; a decode worker asks the KV store, then
the prefill worker's lease for whatever the store did not give.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.engine.engine import Engine
from common.engine.kv_connector import KvLoad, KvSource, Landed
from common.logs import get_logger

log = get_logger("worker")


@dataclass
class LoadInFlight:
    load: KvLoad
    sources: tuple[KvSource, ...]  # asked in this order
    next_source: int = 0  # the next one to ask
    landed: int = 0  # leading blocks of the load that hold their KV
    parts: list[Landed] = field(default_factory=list)  # what each source asked came to
    asking: KvSource | None = None  # the source whose part is out
    cancelled: bool = False  # no source is asked after the part out


@dataclass(frozen=True)
class LoadDone:
    """A load whose sources are done: its first `landed` blocks hold their KV; `parts`
    says what each source asked gave (the last one's error says why the rest did not)."""

    load: KvLoad
    landed: int
    parts: tuple[Landed, ...]

    @property
    def whole(self) -> bool:
        return self.landed == len(self.load.dst_block_ids)

    @property
    def settled(self) -> bool:
        return all(part.settled for part in self.parts)


class KvLoads:
    """The loads in flight on one engine, each walking its sources in order."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loads: dict[str, LoadInFlight] = {}
        self.done: list[LoadDone] = []  # ended loads not yet taken by `tend`

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.loads

    def __len__(self) -> int:
        return len(self.loads)

    def begin(self, load: KvLoad, sources: Sequence[KvSource]) -> None:
        """Walk a load `Engine.begin_load` gave through `sources`; its end comes out of `tend`."""
        if load.request_id in self.loads:
            raise ValueError(f"{load.request_id!r} is loading already")
        flight = LoadInFlight(load, tuple(sources))
        self.loads[load.request_id] = flight
        self._ask_next(flight)

    def tend(self) -> list[LoadDone]:
        """Take every source's finished parts, ask the next source where blocks are still
        missing; the loads that ended since the last call."""
        if not self.loads and not self.done:  # every turn of the loop: nothing to do, nothing built
            return []
        for source in {id(f.asking): f.asking for f in self.loads.values() if f.asking is not None}.values():
            for part in source.poll():
                flight = self.loads.get(part.request_id)
                if flight is None or flight.asking is not source:
                    log.warning("kv_part_unexpected", request_id=part.request_id, source=source.name)
                    continue
                self._take(flight, part)
        done, self.done = self.done, []
        return done

    def cancel(self, request_id: str) -> bool:
        """Stop a load's transfer; True when no byte of it can land any more (the load is
        forgotten here: the caller ends the request), False when a source cannot say so
        yet (the load ends through `tend` once that part is in, no other source asked)."""
        flight = self.loads.get(request_id)
        if flight is None:
            return True
        if flight.asking is not None and not flight.asking.cancel(request_id):
            flight.cancelled = True
            return False
        del self.loads[request_id]
        return True

    def _take(self, flight: LoadInFlight, part: Landed) -> None:
        flight.parts.append(part)
        flight.asking = None
        flight.landed += part.landed
        if part.settled and not flight.cancelled:  # the next source is asked for what this one did not land
            self._ask_next(flight)
        else:  # late bytes may land: the role decides what becomes of the blocks
            self._end(flight)

    def _ask_next(self, flight: LoadInFlight) -> None:
        """Hand what is still missing to the next source that takes it; end the load when
        nothing is missing or no source is left."""
        total = len(flight.load.dst_block_ids)
        while flight.landed < total and flight.next_source < len(flight.sources):
            source = flight.sources[flight.next_source]
            flight.next_source += 1
            if source.start(flight.load, flight.landed):
                flight.asking = source
                return
        self._end(flight)

    def _end(self, flight: LoadInFlight) -> None:
        del self.loads[flight.load.request_id]
        self.done.append(LoadDone(flight.load, flight.landed, tuple(flight.parts)))
