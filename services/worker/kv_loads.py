"""The loop's side of every KV load (common/engine/kv_connector.py), both halves.

The scheduler half: before a load's blocks are allocated (`plan`, handed to
`Engine.begin_load`), and again each time blocks are still missing, every source not yet
asked answers `match` for the blocks from the first missing one on. A source is worth
asking when its cost per block beats its rival's: the cheapest other source sure to
give all that is missing, or recomputing the blocks (where the load may stop short: not
a load through the prompt's end). The cheapest source worth asking is asked; one that
offers nothing, or is dearer than its rival, is passed over for the load. Nothing is
allocated when no source is worth asking.

The transfer half: the asked source's part lands (`poll`), the next source is chosen
for what it left, and the load ends when nothing is missing or no source is worth
asking. The role then completes it in the engine (`Engine.complete_load`, or
`cancel_load` when what it needed did not come).

Which sources a role has is the role's: a co-located or prefill worker has the KV store
(and computes the rest); a decode worker has the KV store and the prefill worker's
lease, and the lease is sure to hold every block.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.engine.engine import Engine
from common.engine.kv_connector import KvLoad, KvSource, Landed, Offer
from common.logs import get_logger
from common.metrics import Registry

log = get_logger("worker")

# seconds to compute one block at a prompt block index; None: the load lands whole
Recompute = Callable[[int], float] | None
COMING = "coming"  # a source's choice: nothing yet, more later (Offer.coming)


@dataclass
class LoadInFlight:
    load: KvLoad
    untried: list[KvSource]  # neither asked nor passed over yet
    recompute: Recompute
    landed: int = 0  # leading blocks of the load that hold their KV
    parts: list[Landed] = field(default_factory=list)  # what each source asked came to
    asking: KvSource | None = None  # the source whose part is out
    cancelled: bool = False  # no source is asked after the part out
    waiting: bool = False  # for a source that will have more (`resume`)


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
    """The loads in flight on one engine, each choosing among its sources as it goes."""

    def __init__(self, engine: Engine, registry: Registry | None = None):
        self.engine = engine
        self.loads: dict[str, LoadInFlight] = {}
        self.done: list[LoadDone] = []  # ended loads not yet taken by `tend`
        self.choices = (registry or Registry()).counter(
            "baton_worker_kv_source_choices_total",
            "Each KV source's part in each load: asked, declined (chosen, but it started nothing), costlier "
            "(its rival was cheaper), or why it offered nothing (known_miss: the router's index says the store "
            "lacks the blocks; off: the source takes no load now; nothing: none of the blocks is its to give; "
            "coming: none yet, more later)",
            labels=("source", "choice"))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.loads

    def __len__(self) -> int:
        return len(self.loads)

    @property
    def parts_out(self) -> bool:
        """Whether a source has a part out (its landing comes on no socket: the loop
        polls for it); a load that waits for more (`resume`) needs no polling."""
        return any(flight.asking is not None for flight in self.loads.values())

    def plan(self, sources: Sequence[KvSource], recompute: Recompute) -> Callable[[KvLoad], int]:
        """For `Engine.begin_load`: how many of a load's leading blocks to allocate (0: no
        source is worth asking, and each source's choice is counted now). A source sure of
        its offer gets that many; one that only believes (the store, as the router's
        index last saw it) may find more when asked, so every named block is allocated
        for it: the blocks it does not fill are freed when the load completes."""
        def blocks(load: KvLoad) -> int:
            chosen = _choose(load, 0, sources, recompute)
            if chosen.asked is None:
                self._count(chosen.passed)
                return 0
            return max(offer.blocks if offer.sure else load.num_blocks for offer in chosen.worth)
        return blocks

    def begin(self, load: KvLoad, sources: Sequence[KvSource], recompute: Recompute = None) -> None:
        """Walk a load `Engine.begin_load` gave through `sources` (`recompute`: what a
        block costs to compute, None for a load through the prompt's end); its end comes
        out of `tend`."""
        if load.request_id in self.loads:
            raise ValueError(f"{load.request_id!r} is loading already")
        flight = LoadInFlight(load, list(sources), recompute)
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

    def resume(self, request_id: str) -> None:
        """A source has more for a load that waits for it (its offer said `coming`): ask
        again."""
        flight = self.loads.get(request_id)
        if flight is not None and flight.waiting and flight.asking is None and not flight.cancelled:
            self._ask_next(flight)

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
        """Hand what is still missing to the cheapest source worth asking that takes it;
        end the load when nothing is missing or no source is worth asking, unless a
        source will have more: then the load waits for `resume`. A source whose offer is
        `coming` stays to be asked again."""
        load = flight.load
        flight.waiting = False
        while flight.landed < load.num_blocks and flight.untried:
            chosen = _choose(load, flight.landed, flight.untried, flight.recompute)
            self._count(chosen.passed)
            for source, why in chosen.passed:
                if why != COMING:
                    flight.untried.remove(source)
            if chosen.asked is None:
                if any(why == COMING for _, why in chosen.passed):
                    flight.waiting = True
                    return
                break
            source, rival_s, coming = chosen.asked
            if source.start(load, flight.landed, rival_s):
                self.choices.inc(source=source.name, choice="asked")
                if not coming:
                    flight.untried.remove(source)
                flight.asking = source
                return
            self.choices.inc(source=source.name, choice="declined")
            flight.untried.remove(source)
        self._end(flight)

    def _end(self, flight: LoadInFlight) -> None:
        del self.loads[flight.load.request_id]
        self.done.append(LoadDone(flight.load, flight.landed, tuple(flight.parts)))

    def _count(self, passed: Sequence[tuple[KvSource, str]]) -> None:
        for source, why in passed:
            self.choices.inc(source=source.name, choice=why)


@dataclass(frozen=True)
class Choice:
    """One round of the scheduler half: the source to ask, its rival's cost per block and
    whether it will have more later (None: none is worth asking), the offers worth
    asking, and the sources passed over with why."""

    asked: tuple[KvSource, float, bool] | None
    worth: tuple[Offer, ...]
    passed: tuple[tuple[KvSource, str], ...]


def _choose(load: KvLoad, start: int, sources: Sequence[KvSource], recompute: Recompute) -> Choice:
    """Match every source for the load's blocks from `start` on, and choose (module
    docstring)."""
    missing = load.num_blocks - start
    offers = [(source, source.match(load, start)) for source in sources]
    passed = [(source, COMING if offer.coming else offer.why or "nothing")
              for source, offer in offers if offer.blocks <= 0]
    offers = [(source, offer) for source, offer in offers if offer.blocks > 0]
    computed_s = recompute(load.first_block + start) if recompute is not None else None
    worth: list[tuple[KvSource, Offer, float]] = []
    for source, offer in offers:
        rivals = [other.block_s for peer, other in offers
                  if peer is not source and other.sure and other.blocks >= missing]
        if computed_s is not None:
            rivals.append(computed_s)
        rival_s = min(rivals, default=float("inf"))
        if offer.block_s < rival_s:
            worth.append((source, offer, rival_s))
        else:
            passed.append((source, "costlier"))
    if not worth:
        return Choice(None, (), tuple(passed))
    source, offer, rival_s = min(worth, key=lambda chosen: chosen[1].block_s)
    return Choice((source, rival_s, offer.coming), tuple(offer for _, offer, _ in worth), tuple(passed))
