"""KvLoads chooses a load's sources on their offers and walks the load through them
(services/worker/kv_loads.py): the cheapest worth asking first, each asked for what the
ones before it did not land, and the load's end says what came.
The sources here copy real KV, block by block, from an engine that computed the prompt
(as a transport or the store would), into a real engine: fp32, greedy, token for token."""
from __future__ import annotations

import pytest

from common.engine.engine import Engine
from common.engine.kv_connector import KvLoad, Landed, Offer, no_offer
from common.engine.leases import KvLease
from common.metrics import Registry
from common.sampling_params import SamplingParams
from services.worker.kv_loads import KvLoads

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class CopySource:
    """Offers, and copies, at most `limit` blocks of the lease per part at `block_s` a
    block, landing them at the next poll; `stoppable` False: a part out cannot be
    cancelled (it lands anyway)."""

    def __init__(self, name: str, src: Engine, dst: Engine, lease: KvLease, limit: int, stoppable: bool = True,
                 block_s: float = 1.0, sure: bool = False, claims: int | None = None):
        self.name, self.src, self.dst, self.lease = name, src, dst, lease
        self.limit, self.stoppable, self.block_s, self.sure = limit, stoppable, block_s, sure
        self.claims = limit if claims is None else claims  # the blocks it offers
        self.out: list[tuple[KvLoad, int]] = []
        self.asked: list[tuple[int, float]] = []  # (start, rival_block_s) of each part asked

    def match(self, load: KvLoad, start: int) -> Offer:
        count = min(self.claims, load.num_blocks - start)
        return Offer(count, self.block_s, self.sure) if count > 0 else no_offer("empty")

    def start(self, load: KvLoad, start: int, rival_block_s: float) -> bool:
        self.asked.append((start, rival_block_s))
        self.out.append((load, start))
        return True

    def poll(self) -> list[Landed]:
        parts = []
        for load, start in self.out_and_clear():
            count = min(self.limit, len(load.dst_block_ids) - start)
            src_ids = self.lease.block_ids[load.first_block + start:load.first_block + start + count]
            self.dst.write_blocks(load.dst_block_ids[start:start + count], self.src.read_blocks(src_ids))
            parts.append(Landed(load.request_id, count, self.name))
        return parts

    def out_and_clear(self) -> list[tuple[KvLoad, int]]:
        out, self.out = self.out, []
        return out

    def cancel(self, request_id: str) -> bool:
        if self.stoppable:
            self.out = [(load, start) for load, start in self.out if load.request_id != request_id]
        return self.stoppable or not any(load.request_id == request_id for load, _ in self.out)


@pytest.fixture(scope="module")
def prefilled(make_engine, random_prompts):
    """A prompt computed on one engine, its blocks held under a lease, and its first token."""
    engine = make_engine()
    prompt = random_prompts([100], seed=71)[0]  # 6 full blocks and a partial one
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold_kv=True)
    while True:
        for output in engine.step():
            if output.finished:
                return engine, prompt, output.new_token_ids[0], output.kv_lease


def finish(engine: Engine, loads: KvLoads, request_id: str) -> list[int]:
    [done] = loads.tend()
    assert done.whole and done.settled
    tokens = []
    for output in engine.complete_load(request_id, done.landed):
        tokens += output.new_token_ids
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
    return tokens


def choices(registry: Registry, source: str, choice: str) -> float:
    return registry.collectors.get_sample_value("baton_worker_kv_source_choices_total",
                                                {"source": source, "choice": choice}) or 0.0


def test_the_cheaper_source_is_asked_first_and_each_for_what_the_ones_before_it_left(prefilled, make_engine):
    """The lease holds every block; the store offers 4 at a lower cost, so it is asked
    first (against the lease's cost), and the lease for the rest. A source offering
    nothing is never asked."""
    src, prompt, first, lease = prefilled
    want = make_engine().generate([prompt], GREEDY)[0].token_ids
    dst = make_engine()
    load = dst.begin_load("r", prompt, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert load is not None and len(load.dst_block_ids) == 7
    nothing, lease_source, store = (CopySource("none", src, dst, lease, 0),
                                    CopySource("lease", src, dst, lease, 99, block_s=2.0, sure=True),
                                    CopySource("store", src, dst, lease, 4, block_s=1.0))
    registry = Registry()
    loads = KvLoads(dst, registry)
    loads.begin(load, (nothing, lease_source, store))
    assert nothing.asked == [] and store.asked == [(0, 2.0)] and lease_source.asked == []
    assert loads.tend() == [] and lease_source.asked == [(4, float("inf"))]  # the store landed blocks 0-3
    assert finish(dst, loads, "r") == want
    assert [choices(registry, name, "asked") for name in ("none", "store", "lease")] == [0, 1, 1]
    assert choices(registry, "none", "empty") == 1
    dst.check_integrity()


def test_a_source_dearer_than_its_rival_is_passed_over(prefilled, make_engine):
    """The store's blocks cost more than the lease's, which holds them all: only the
    lease is asked."""
    src, prompt, first, lease = prefilled
    want = make_engine().generate([prompt], GREEDY)[0].token_ids
    dst = make_engine()
    load = dst.begin_load("r", prompt, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert load is not None
    store, lease_source = (CopySource("store", src, dst, lease, 4, block_s=3.0),
                           CopySource("lease", src, dst, lease, 99, block_s=2.0, sure=True))
    registry = Registry()
    loads = KvLoads(dst, registry)
    loads.begin(load, (store, lease_source))
    assert store.asked == [] and lease_source.asked == [(0, float("inf"))]
    assert finish(dst, loads, "r") == want
    assert choices(registry, "store", "costlier") == 1 and choices(registry, "lease", "asked") == 1


def test_a_source_that_only_believes_it_holds_every_block_does_not_stand_in_for_the_lease(prefilled,
                                                                                          make_engine):
    """The store offers every block, cheaper, but lands 2 (its index was stale): the lease,
    which is sure to hold them, is still asked for the rest."""
    src, prompt, first, lease = prefilled
    want = make_engine().generate([prompt], GREEDY)[0].token_ids
    dst = make_engine()
    load = dst.begin_load("r", prompt, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert load is not None
    store = CopySource("store", src, dst, lease, 2, block_s=0.5, claims=99)
    lease_source = CopySource("lease", src, dst, lease, 99, sure=True)
    loads = KvLoads(dst)
    loads.begin(load, (store, lease_source))
    assert store.asked == [(0, 1.0)] and loads.tend() == [] and lease_source.asked == [(2, float("inf"))]
    assert finish(dst, loads, "r") == want


def test_the_plan_allocates_for_the_sources_worth_asking(prefilled, make_engine):
    """A load that may stop short (not through the prompt's end) is planned before its
    blocks are allocated: when computing the blocks is cheaper than any source, nothing is
    allocated and the request is not taken as a load (`add_request` queues it to prefill);
    a source sure of its offer gets blocks for it; one that only believes its offer (it
    may hold more when asked) gets every named block."""
    src, prompt, _, lease = prefilled
    want = make_engine().generate([prompt], GREEDY)[0].token_ids
    dst = make_engine()
    registry = Registry()
    loads = KvLoads(dst, registry)
    sure = CopySource("sure", src, dst, lease, 4, block_s=1.0, sure=True)
    believed = CopySource("believed", src, dst, lease, 4, block_s=1.0)
    assert dst.begin_load("dear", prompt, GREEDY, plan=loads.plan((sure,), lambda block: 0.5)) is None
    assert dst.block_manager.num_used == 0 and choices(registry, "sure", "costlier") == 1
    load = dst.begin_load("b", prompt, GREEDY, plan=loads.plan((believed,), lambda block: 5.0))
    assert load is not None and len(load.dst_block_ids) == 6  # every full block
    dst.cancel_load("b")
    load = dst.begin_load("r", prompt, GREEDY, plan=loads.plan((sure,), lambda block: 5.0))
    assert load is not None and load.first_block == 0 and len(load.dst_block_ids) == 4  # of the 6 full blocks
    loads.begin(load, (sure,), lambda block: 5.0)
    assert sure.asked == [(0, 5.0)]
    assert finish(dst, loads, "r") == want
    dst.check_integrity()
    other = make_engine()  # add_request with a plan that allocates nothing queues the request to prefill
    assert other.add_request("q", prompt, GREEDY, plan=KvLoads(other).plan((sure,), lambda block: 0.5)) is None
    queued = []
    while other.has_unfinished():
        queued += [token for output in other.step() for token in output.new_token_ids]
    assert queued == want


def test_a_part_that_cannot_be_stopped_ends_the_load_without_asking_further(prefilled, make_engine):
    src, prompt, first, lease = prefilled
    dst = make_engine()
    load = dst.begin_load("r", prompt, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert load is not None
    store = CopySource("store", src, dst, lease, 4, stoppable=False, block_s=0.5)
    lease_source = CopySource("lease", src, dst, lease, 99, sure=True)
    loads = KvLoads(dst)
    loads.begin(load, (store, lease_source))
    assert not loads.cancel("r")  # the store's part is out: it lands, and nothing more is asked
    assert dst.abort("r") and dst.block_manager.num_used == 7  # a late copy may land: the blocks stay
    [done] = loads.tend()
    assert done.landed == 4 and not done.whole and lease_source.asked == []
    assert dst.complete_load("r", done.landed) == []  # the aborted request ends here
    assert dst.block_manager.num_used == 0 and not dst.has_unfinished()
    dst.check_integrity()


class GrowingSource(CopySource):
    """A source that holds the load's first `held` blocks so far and will hold more until
    `whole` (a prompt whose parts still come): its offers are `coming` until then."""

    def __init__(self, src: Engine, dst: Engine, lease: KvLease):
        super().__init__("lease", src, dst, lease, 99, sure=True)
        self.held, self.whole = 0, False

    def match(self, load: KvLoad, start: int) -> Offer:
        count = (load.num_blocks if self.whole else min(self.held, load.num_blocks)) - start
        if count <= 0:
            return Offer(0, float("inf"), why="nothing", coming=not self.whole)
        return Offer(count, self.block_s, sure=True, coming=not self.whole)

    def start(self, load: KvLoad, start: int, rival_block_s: float) -> bool:
        self.limit = self.match(load, start).blocks
        return super().start(load, start, rival_block_s)


def test_a_load_waits_for_a_source_that_will_have_more_and_goes_on_when_resumed(prefilled, make_engine):
    """A source whose offer is `coming` is asked for what it has, and asked again; with
    nothing yet, the load waits (no end, nothing out) until `resume` says more came; then
    the rest lands and the request decodes as one engine would."""
    src, prompt, first, lease = prefilled
    want = make_engine().generate([prompt], GREEDY)[0].token_ids
    dst = make_engine()
    registry = Registry()
    loads = KvLoads(dst, registry)
    growing = GrowingSource(src, dst, lease)
    load = dst.begin_load("r", prompt, GREEDY, through_prompt_end=True)
    assert load is not None and len(load.dst_block_ids) == 7
    loads.begin(load, [growing])
    assert growing.asked == [] and "r" in loads and loads.tend() == []  # nothing yet: it waits
    growing.held = 2
    loads.resume("r")
    assert growing.asked == [(0, float("inf"))] and loads.tend() == []  # blocks 0-1 landed; waits again
    loads.resume("r")  # nothing more came: still waiting, nothing asked
    assert growing.asked == [(0, float("inf"))] and "r" in loads
    growing.held, growing.whole = 4, True
    loads.resume("r")
    assert growing.asked[-1] == (2, float("inf"))
    [done] = loads.tend()
    assert done.whole and done.landed == 7 and [part.landed for part in done.parts] == [2, 5]
    assert choices(registry, "lease", "coming") == 3 and choices(registry, "lease", "asked") == 2  # waited 3 times
    tokens = []
    for output in dst.complete_load("r", done.landed, first_token_id=first):
        tokens += output.new_token_ids
    while dst.has_unfinished():
        for output in dst.step():
            tokens += output.new_token_ids
    assert tokens == want
    dst.check_integrity()


def test_a_waiting_load_is_cancelled_at_once(prefilled, make_engine):
    """Nothing is out while a load waits for more: cancelling it needs no settling."""
    src, prompt, _, lease = prefilled
    dst = make_engine()
    loads = KvLoads(dst)
    load = dst.begin_load("r", prompt, GREEDY, through_prompt_end=True)
    assert load is not None
    loads.begin(load, [GrowingSource(src, dst, lease)])
    assert loads.cancel("r") and "r" not in loads
    dst.cancel_load("r")
    dst.check_integrity()
    assert dst.block_manager.num_used == 0
