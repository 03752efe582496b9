"""KvLoads walks a load through its sources in order (services/worker/kv_loads.py): each
is asked for what the ones before it did not land, and the load's end says what came.
The sources here copy real KV, block by block, from an engine that computed the prompt
(as a transport or the store would), into a real engine: fp32, greedy, token for token."""
from __future__ import annotations

import pytest

from common.engine.engine import Engine
from common.engine.kv_connector import KvLoad, Landed
from common.engine.leases import KvLease
from common.sampling_params import SamplingParams
from services.worker.kv_loads import KvLoads

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class CopySource:
    """Copies at most `limit` blocks of the lease per part, landing them at the next poll;
    `stoppable` False: a part out cannot be cancelled (it lands anyway)."""

    def __init__(self, name: str, src: Engine, dst: Engine, lease: KvLease, limit: int, stoppable: bool = True):
        self.name, self.src, self.dst, self.lease = name, src, dst, lease
        self.limit, self.stoppable = limit, stoppable
        self.out: list[tuple[KvLoad, int]] = []
        self.asked: list[int] = []

    def start(self, load: KvLoad, start: int) -> bool:
        self.asked.append(start)
        if self.limit == 0:
            return False
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


def test_each_source_is_asked_for_what_the_ones_before_it_left(prefilled, make_engine):
    src, prompt, first, lease = prefilled
    want = make_engine().generate([prompt], GREEDY)[0].token_ids
    dst = make_engine()
    load = dst.begin_load("r", prompt, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert load is not None and len(load.dst_block_ids) == 7
    nothing, store, lease_source = (CopySource("none", src, dst, lease, 0), CopySource("store", src, dst, lease, 4),
                                    CopySource("lease", src, dst, lease, 99))
    loads = KvLoads(dst)
    loads.begin(load, (nothing, store, lease_source))
    assert nothing.asked == [0] and store.asked == [0] and lease_source.asked == []
    assert loads.tend() == [] and lease_source.asked == [4]  # the store landed blocks 0-3
    assert finish(dst, loads, "r") == want
    dst.check_integrity()


def test_a_part_that_cannot_be_stopped_ends_the_load_without_asking_further(prefilled, make_engine):
    src, prompt, first, lease = prefilled
    dst = make_engine()
    load = dst.begin_load("r", prompt, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert load is not None
    store, lease_source = CopySource("store", src, dst, lease, 4, stoppable=False), CopySource("lease", src, dst,
                                                                                               lease, 99)
    loads = KvLoads(dst)
    loads.begin(load, (store, lease_source))
    assert not loads.cancel("r")  # the store's part is out: it lands, and nothing more is asked
    assert dst.abort("r") and dst.block_manager.num_used == 7  # a late copy may land: the blocks stay
    [done] = loads.tend()
    assert done.landed == 4 and not done.whole and lease_source.asked == []
    assert dst.complete_load("r", done.landed) == []  # the aborted request ends here
    assert dst.block_manager.num_used == 0 and not dst.has_unfinished()
    dst.check_integrity()
