"""A discrete-event simulator of a Baton cluster on virtual time (docs/evaluation.md §3).

Nothing here re-implements a policy. The router side is the live router's own objects
(ClusterState with its prefix index and loads, the placement policy, AdmissionControl);
each worker is the live engine's own Scheduler, BlockManager and waiting-queue policy.
Only the model is replaced: a step takes the time the cost model gives for its plan, and
every sampled token is a stand-in id. KV events go from each block manager to the index
as they happen, and finished requests at the end of the step that ended them; load
reports reach the router on heartbeats. All as they do live.

Step time of a plan (prefill chunks and decode tokens run as one forward pass, as in the
engine): the larger of the phases' fixed costs, plus each prefill chunk's marginal cost
over the context before it, plus the decode batch's marginal cost at its mean context;
the first step after the worker sat idle also pays the profile's wake extra for that long.

Quiet runs: most steps of a long run decode the same batch one token further and change
nothing anyone else sees (no block is allocated, named or freed, no request starts or
ends, no arrival comes in between). Such a run of steps is one event: its steps' times
are summed one by one as separate events would sum them, and its sequences advance
token by token when it ends, the last step through the scheduler as usual. The results
are the same as stepping one at a time (`fuse_quiet_steps=False`; tests compare both).
On a decode worker a quiet run also ends before a pull lands there, and there is none
while a request bound for it has not started its pull (when it lands is not known yet).
On the Mooncake trace this makes 6× fewer step events and ~15 % less wall time (most of
what remains is per-block work: hashing, naming, the index's KV events).

Disaggregated pools (docs/evaluation.md §3.1): co-located, prefill and decode workers may
coexist. The policy, admission and the prefix index of the prefill side (prefill and
co-located workers: where prefixes live) are one ClusterState; the decode pool has its
own, whose index and loads choose the decode worker (disagg.rank_decode_workers). A
request whose missing prefill on that decode worker (by its own cache, as the worker
decides) is at most max_local_prefill_tokens stays there whole (conditional
disaggregation; it skips admission). Otherwise the policy
places its prefill; on a prefill worker the first token is sampled and streamed at once,
the prompt's blocks stay under a lease, and the decode worker, once it has room to
allocate the blocks it lacks, pulls them over the modelled link (disagg.LinkQueues). When
they land the lease ends, the full blocks are named on the decode worker, and the request
joins its running batch with its prompt computed. A request's record splits its time
into queue, prefill, transfer (first token to landing: waiting for the decode worker's
memory and the link, then the bytes) and decode wait (landing to its first decode step);
its TPOT includes the transfer and the wait.

The KV store (docs/evaluation.md §3.2), with `SimConfig.store` enabled: one store for
the cluster (services/eval/sim_store.py, the live store's index). A worker's block
manager writes back each block it evicts, with the ancestors the store lacks, root-first.
When a step's plan has a prefill chunk (the request admitted with its prefix cached on
the worker, or a later chunk), the worker looks up the store for the blocks the chunk
would compute; when fetching a run of them beats recomputing it (StoreModel.fetch_s
against the cost model's prefill time of those tokens), the chunk starts after them,
they are named in the worker's cache, and the step takes the fetch time longer: a fetch
is synchronous with the step, which every sequence in the batch waits for (the live
engine overlaps what it can, so this is the store's worst case).
"""
from __future__ import annotations

import collections
import contextlib
import gc
import heapq
import itertools
import math
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, cast

import numpy as np

from common.cost_model import CostModel
from common.engine.block_manager import BlockManager, EvictedBlock
from common.engine.queue_policy import make_queue_policy
from common.engine.scheduler import ScheduledChunk, SchedulePlan, Scheduler, SchedulerConfig
from common.engine.sequence import Sequence, SequenceStatus
from common.hashing import chain_hashes, root_hash
from common.sampling_params import SamplingParams
from services.eval.disagg import (
    DEFAULT_LINK,
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    LINKS,
    DecodeCandidate,
    Link,
    LinkQueues,
    blocks_to_move,
    rank_decode_workers,
)
from services.eval.report import RequestRecord, RunTotals
from services.eval.sim_store import SimStore, StoreModel
from services.eval.workloads.base import WorkloadRequest
from services.router.admission import AdmissionConfig, AdmissionControl, Slo
from services.router.cluster import ClusterState
from services.router.policies import make_policy

STAND_IN_VOCAB = 30_000
_UINT32_ARRAY = array("I").itemsize == 4  # array("I") holds exactly the uint32 ids


@dataclass(frozen=True)
class SimConfig:
    workers: int  # co-located
    policy: str
    cost: CostModel
    kv_blocks: int = 32_768  # per worker
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 262_144
    queue_policy: str = "fcfs"
    heartbeat_interval_s: float = 0.5
    load_window_s: float = 180.0
    index_ttl_s: float | None = None  # set: the router's approximate index mode
    admission: bool = False
    slos: Mapping[str, Slo] = field(default_factory=dict)  # class -> object with ttft_s, tpot_s
    max_queued_requests: int = 256
    max_queued_tokens: int = 262_144 * 64
    network_s: float = 0.0  # one-way delay client -> worker and worker -> client
    # What a request's first token takes on its way out beyond network_s (negative: less).
    # Live, the first chunk's path does more work than later ones' (scripts/check_sim_fidelity.py
    # measures it), which shows in TPOT as (this) / (output tokens - 1).
    first_token_extra_s: float = 0.0
    fuse_quiet_steps: bool = True  # a quiet run of decode steps is one event (module docstring)
    prefill_workers: int = 0
    decode_workers: int = 0
    link: Link = LINKS[DEFAULT_LINK]  # what prefill-to-decode KV transfers move over
    kv_bytes_per_block: int = 0  # KVLayout.bytes_per_block of the model; needed with pools
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS
    store: StoreModel = StoreModel()  # both tiers 0: no store

    @property
    def instances(self) -> int:
        return self.workers + self.prefill_workers + self.decode_workers

    def __post_init__(self) -> None:
        if min(self.workers, self.prefill_workers, self.decode_workers) < 0:
            raise ValueError("worker counts must not be negative")
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ValueError(f"a prefill pool needs a decode pool and the other way round, got "
                             f"{self.prefill_workers} prefill and {self.decode_workers} decode workers")
        if self.workers + self.prefill_workers < 1:
            raise ValueError("no worker to prefill on: give co-located or prefill workers")
        if self.decode_workers and self.kv_bytes_per_block <= 0:
            raise ValueError("disaggregated pools need kv_bytes_per_block (the model's KV layout)")
        if self.store.enabled and self.kv_bytes_per_block <= 0:
            raise ValueError("the KV store needs kv_bytes_per_block (the model's KV layout)")
        if self.network_s < 0 or self.network_s + self.first_token_extra_s < 0:
            raise ValueError(f"network_s ({self.network_s}) and network_s + first_token_extra_s "
                             f"({self.network_s + self.first_token_extra_s}) must not be negative")


@dataclass
class SimResult:
    records: list[RequestRecord]
    totals: RunTotals
    steps: int
    store: dict | None = None  # with a store: Simulator.store_report()


class _EventSink:
    """BlockManager events go straight into the router's index at the current time."""

    def __init__(self, cluster: ClusterState, worker_id: str, clock: Callable[[], float]):
        self.cluster, self.worker_id, self.clock = cluster, worker_id, clock
        self.evicted = 0

    def stored(self, block_hashes: list[int]) -> None:
        self.cluster.kv_stored(self.worker_id, block_hashes, self.clock())

    def removed(self, block_hashes: list[int]) -> None:
        self.evicted += len(block_hashes)
        self.cluster.kv_removed(self.worker_id, block_hashes)


class _WriteBack:
    """The block manager's eviction hook: writes back the blocks an allocation evicts to
    the store, each with the ancestors the store lacks, root-first, as the engine's
    write-back does (a chain is put root-first). An ancestor neither cached here nor
    stored ends that block's chain: nothing to copy."""

    def __init__(self, block_manager: BlockManager, store: SimStore, clock: Callable[[], float]):
        self.block_manager, self.store, self.clock = block_manager, store, clock
        block_manager.on_evict = self

    def __call__(self, evicted: list[EvictedBlock]) -> None:
        now = self.clock()
        parents = {block.name: _parent(block.parent, block.root) for block in evicted}
        for name, parent in parents.items():
            if self.store.holds(name):
                self.store.put_chain([(name, parent)], now)  # touched: recently used again
                continue
            chain = [(name, parent)]
            while parent is not None and not self.store.holds(parent):
                try:
                    grandparent = self._parent_of(parent, parents)
                except LookupError:
                    chain = []
                    break
                chain.append((parent, grandparent))
                parent = grandparent
            self.store.put_chain(chain[::-1], now)

    def _parent_of(self, name: int, evicting: dict[int, int | None]) -> int | None:
        """The parent of a block being evicted or cached here (None: a chain's first);
        LookupError when this engine no longer has it."""
        if name in evicting:
            return evicting[name]
        record = self.block_manager.named(name)
        if record is None:
            raise LookupError(name)
        return _parent(record.parent, record.root)


def _parent(parent: int | None, root: int | None) -> int | None:
    """The store's parent of a block: None for a chain's first (whose parent is its root)."""
    return None if parent == root else parent


class SimWorker:
    """One worker: the engine's scheduler and block manager, with modelled step times."""

    def __init__(self, worker_id: str, config: SimConfig, sink: _EventSink, role: str = "colocated",
                 store: SimStore | None = None):
        self.worker_id = worker_id
        self.role = role  # colocated, prefill or decode
        self.config = config
        self.block_manager = BlockManager(config.kv_blocks, config.block_size, sink)
        if store is not None:
            _WriteBack(self.block_manager, store, sink.clock)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs),
            self.block_manager, make_queue_policy(config.queue_policy))
        self.sink = sink
        self.busy = False
        self.idle_since = -math.inf  # when it last ran out of work (-inf: it has not worked yet)
        self.changed = False  # since the last heartbeat: an idle worker's report would say nothing new
        self.arrivals = itertools.count()
        self.run: _Run | None = None  # the step (or quiet run) in flight

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.changed = True

    def step_time(self, plan: SchedulePlan, decode_offset: int = 0) -> float:
        """Seconds the plan's step takes; `decode_offset` steps later in a quiet run (every
        decode token that much further on)."""
        cost = self.config.cost
        fixed, marginal = 0.0, 0.0
        decode_batch, decode_context = 0, 0
        for chunk in plan.chunks:
            if chunk.start >= chunk.seq.prompt_len:
                decode_batch += 1
                decode_context += chunk.start + decode_offset
            else:
                fixed = max(fixed, cost.prefill.a)
                marginal += cost.prefill.marginal(chunk.num_new, chunk.start)
        if decode_batch:
            fixed = max(fixed, cost.decode.a)
            marginal += cost.decode.marginal(decode_batch, decode_context / decode_batch)
        return fixed + marginal

    def decode_step_times(self, plan: SchedulePlan) -> Callable[[int], float]:
        """step_time(plan, offset) as a function of the offset, for a plan of decodes only
        (a quiet run's): the same sums, without walking the batch per step."""
        decode = self.config.cost.decode
        batch = len(plan.chunks)
        context = sum(chunk.start for chunk in plan.chunks)
        fixed = max(0.0, decode.a)
        return lambda offset: fixed + decode.marginal(batch, (context + batch * offset) / batch)


class Simulator:
    def __init__(self, config: SimConfig):
        self.config = config
        self.now = 0.0
        ttl = config.index_ttl_s
        chunk = config.max_num_batched_tokens
        self.cluster = ClusterState(config.block_size, config.cost, config.load_window_s, ttl,
                                    prefill_chunk_tokens=chunk)
        self.policy = make_policy(config.policy)
        self.admission = AdmissionControl(
            AdmissionConfig(config.admission, config.max_queued_requests, config.max_queued_tokens),
            config.slos)
        # The decode pool's own router state: its index says which decode worker holds what.
        self.decode_cluster = ClusterState(config.block_size, config.cost, config.load_window_s, ttl,
                                           prefill_chunk_tokens=chunk) if config.decode_workers else None
        self.links = LinkQueues(config.link)
        self.store = SimStore(config.store, config.kv_bytes_per_block) if config.store.enabled else None
        self.fetched: dict[str, collections.Counter[str]] = {}  # request id -> tokens fetched per tier
        self.store_tokens = dict.fromkeys(("engine", "dram", "ssd", "computed"), 0)
        self.fetches, self.fetches_skipped, self.fetched_blocks, self.fetch_s = 0, 0, 0, 0.0
        self.workers: dict[str, SimWorker] = {}
        for role, prefix, count in (("colocated", "worker", config.workers), ("prefill", "prefill",
                                    config.prefill_workers), ("decode", "decode", config.decode_workers)):
            for index in range(count):
                self._add_worker(f"{prefix}-{index}", role)
        self.handoffs: dict[str, str] = {}  # request id -> its decode worker, until the prefill hands off
        # Per decode worker: requests bound for it whose pull has not started (their landing
        # time is unknown), and request id -> landing time of those whose pull has.
        self.awaiting: collections.Counter[str] = collections.Counter()
        self.landing: dict[str, dict[str, float]] = {}
        self.pulls: dict[str, collections.deque[_Pull]] = {}  # decode worker id -> pulls waiting for its memory
        self.transfer_bytes = 0
        self.events: list[tuple[float, int, _Event]] = []  # (time, order, event)
        self.order = itertools.count()
        self.records: dict[str, RequestRecord] = {}
        self.sequences: dict[str, tuple[Sequence, WorkloadRequest]] = {}
        self.root_hashes: dict[str, int] = {}
        self.prompt_hashes = _PromptHashes(config.block_size)
        self.steps = 0
        self.arrival_times: list[float] = []  # every arrival event's time, in order
        self.arrived = 0  # how many of them have been handled

    def _add_worker(self, worker_id: str, role: str) -> None:
        cluster = self.decode_cluster if role == "decode" else self.cluster
        assert cluster is not None  # decode workers come with decode_cluster (config.decode_workers > 0)
        cluster.add_worker(worker_id, self.config.kv_blocks)
        sink = _EventSink(cluster, worker_id, lambda: self.now)
        self.workers[worker_id] = SimWorker(worker_id, self.config, sink, role, self.store)

    # ---- driving -----------------------------------------------------------------------

    def run(self, requests: Iterable[WorkloadRequest], progress=None) -> SimResult:
        """Simulate until every request has finished or been refused."""
        with _rare_gc():
            return self._run(requests, progress)

    def _run(self, requests: Iterable[WorkloadRequest], progress) -> SimResult:
        # Arrivals are known up front: a sorted list beside the heap, not a million heap
        # entries. An arrival goes before any other event at the same instant, and equal
        # arrivals in the requests' order, as if all had been queued first.
        arrivals = sorted(((request.arrival_s + self.config.network_s, request) for request in requests),
                          key=lambda pair: pair[0])
        self.arrival_times = [time for time, _ in arrivals]
        self._at(self.config.heartbeat_interval_s, ("heartbeat",))
        pending = len(arrivals)
        while pending:
            if self.arrived < len(arrivals) and arrivals[self.arrived][0] <= self.events[0][0]:
                self.now, request = arrivals[self.arrived]
                self.arrived += 1
                self._arrive(request)
                if self.records[request.request_id].rejected:
                    pending -= 1
                if progress is not None:
                    progress(self.now)
                continue
            self.now, order, event = heapq.heappop(self.events)
            # Each test of event[0] narrows the rest of the event to that kind's fields.
            if event[0] == "step_done":
                run = event[1].run
                if run is None or run.order != order:
                    continue  # a quiet run cut short since (_cut_quiet_run)
                event[1].run = None
                pending -= self._step_done(*event[1:])
            elif event[0] == "kv_landed":
                self._kv_landed(*event[1:])
            elif event[0] == "heartbeat":
                self._heartbeat()
                self._at(self.now + self.config.heartbeat_interval_s, ("heartbeat",))
            if progress is not None and event[0] != "heartbeat":
                progress(self.now)
        evictions = sum(worker.sink.evicted for worker in self.workers.values())
        totals = RunTotals(duration_s=self.now, gpus=self.config.instances, evictions=evictions,
                           eviction_recompute_s=evictions * self.config.cost.recompute_s(self.config.block_size),
                           transfer_bytes=self.transfer_bytes)
        return SimResult(list(self.records.values()), totals, self.steps,
                         self.store_report() if self.store is not None else None)

    def _at(self, time: float, event: _Event) -> int:
        """Queue the event; returns its order (ties at one instant go in this order)."""
        order = next(self.order)
        heapq.heappush(self.events, (time, order, event))
        return order

    # ---- the router ----------------------------------------------------------------------

    def _arrive(self, request: WorkloadRequest) -> None:
        record = RequestRecord(request.request_id, request.slo_class, request.arrival_s,
                               request.num_tokens)
        self.records[request.request_id] = record
        record.ideal_s = self._ideal_s(request)
        root = self._root_hash(request.tenant)
        tokens = request.token_ids  # its parts joined: read once
        seq = Sequence(request_id=request.request_id, prompt_len=len(tokens), token_ids=_token_list(tokens),
                       params=SamplingParams(max_tokens=request.output_tokens, ignore_eos=True),
                       arrival_index=0, root_hash=root, block_size=self.config.block_size,
                       eos_token_ids=frozenset(), max_model_len=self.config.max_model_len,
                       arrival_time=self.now, block_hashes=self.prompt_hashes(root, request, tokens))
        self.sequences[request.request_id] = (seq, request)
        decode = self._pair_decode(request, root) if self.decode_cluster is not None else None
        if decode is not None and self._prefills_locally(self.workers[decode[1]], seq):
            assert self.decode_cluster is not None  # a decode worker is paired only with a decode pool
            self._start(seq, decode[0], decode[1], self.decode_cluster, record)
            return
        candidate = self.cluster.prepare(request.request_id, root, tokens, request.output_tokens, self.now,
                                         request.slo_class)
        preference = self.policy.choose(candidate, self.cluster, self.now)
        verdict = self.admission.decide(candidate, preference, self.cluster, self.now)
        if verdict.worker_id is None:
            record.rejected = True
            del self.sequences[request.request_id]
            return
        if self.workers[verdict.worker_id].role == "prefill" and decode is not None:
            assert self.decode_cluster is not None  # a decode worker is paired only with a decode pool
            self.decode_cluster.place(decode[0], decode[1], self.now)
            self.handoffs[request.request_id] = decode[1]
            self.awaiting[decode[1]] += 1
            seq.params = SamplingParams(max_tokens=1, ignore_eos=True)
        self._start(seq, candidate, verdict.worker_id, self.cluster, record)

    def _prefills_locally(self, decode: SimWorker, seq: Sequence) -> bool:
        """Conditional disaggregation, decided as the decode worker would: by the prompt
        tokens its own cache lacks (not the router's credit for blocks still in flight)."""
        held = decode.block_manager.num_matched_cached(seq.block_hashes, (seq.prompt_len - 1) // seq.block_size)
        return seq.prompt_len - held * seq.block_size <= self.config.max_local_prefill_tokens

    def _pair_decode(self, request: WorkloadRequest, root: int):
        """(the decode pool's view of the request, its best decode worker), or None for a
        request that ends at its first token and so needs no decode worker."""
        if request.output_tokens <= 1:
            return None
        cluster = self.decode_cluster
        assert cluster is not None  # _arrive pairs a decode worker only with a decode pool
        candidate = cluster.prepare(request.request_id, root, request.token_ids, request.output_tokens,
                                    self.now, request.slo_class)
        per_block = self.config.kv_bytes_per_block / self.config.link.bandwidth_bytes_s
        candidates = [DecodeCandidate(worker_id, state.decode_work_s, _room_blocks(state),
                                      candidate.matched.get(worker_id, 0))
                      for worker_id, state in cluster.workers.items()]
        ranking = rank_decode_workers(candidates, candidate.num_tokens, self.config.block_size, per_block)
        return candidate, ranking[0]

    def _start(self, seq: Sequence, candidate, worker_id: str, cluster: ClusterState, record: RequestRecord) -> None:
        """Place the request on `worker_id` (of `cluster`) and queue its sequence there."""
        cluster.place(candidate, worker_id, self.now)
        record.worker_id = worker_id
        worker = self.workers[worker_id]
        seq.arrival_index = next(worker.arrivals)
        worker.add(seq)
        if not worker.busy:
            self._start_step(worker)
        else:
            self._cut_quiet_run(worker)

    # ---- the KV store --------------------------------------------------------------------

    def _fetch(self, worker: SimWorker, plan: SchedulePlan) -> float:
        """Fetch from the store what the plan's prefill chunks would compute, where that
        beats recomputing it: each such chunk then starts after the fetched blocks, which
        are named in the worker's cache. Returns the seconds the fetches take. A chunk
        keeps at least one token to compute."""
        store, manager = self.store, worker.block_manager
        assert store is not None  # _start_step fetches only with a store
        size, total = self.config.block_size, 0.0
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.start >= seq.prompt_len or chunk.start % size:
                continue
            first = chunk.start // size
            last = min((seq.prompt_len - 1) // size, first + (chunk.num_new - 1) // size)
            if last <= first:
                continue
            keys = seq.block_hashes[first:last]
            tiers = store.lookup(keys)
            count, fetch_s = store.plan_fetch(tiers, chunk.start, size, self.config.cost)
            if not count:
                self.fetches_skipped += bool(tiers)
                continue
            store.release(store.get(keys[:count], self.now))  # the read (and its promotion)
            manager.commit(seq.block_ids, seq.block_hashes, seq.token_ids, first, first + count)
            chunk.start += count * size
            chunk.num_new -= count * size
            seq.num_computed = chunk.start
            if seq.first_token_time is None and not seq.num_preemptions:
                fetched = self.fetched.setdefault(seq.request_id, collections.Counter())
                for name in tiers[:count]:
                    fetched[name] += size
            self.fetches += 1
            self.fetched_blocks += count
            self.fetch_s += fetch_s
            total += fetch_s
        return total

    def _count_store_hits(self, seq: Sequence, record: RequestRecord) -> None:
        """At the request's first token: its prompt tokens by where they came from. The
        record's cached tokens count the store's too (the report's hit rate is all reuse)."""
        fetched = self.fetched.pop(seq.request_id, collections.Counter())
        counts = self.store_tokens
        counts["engine"] += seq.num_cached_tokens
        counts["dram"] += fetched["dram"]
        counts["ssd"] += fetched["ssd"]
        record.num_cached_tokens = seq.num_cached_tokens + fetched["dram"] + fetched["ssd"]
        counts["computed"] += seq.prompt_len - record.num_cached_tokens

    def store_report(self) -> dict:
        """Prompt tokens by source (and each one's share), the fetches, and the store's own counters."""
        assert self.store is not None  # reported only with a store
        total = sum(self.store_tokens.values())
        rates = {f"{name}_hit_rate" if name != "computed" else "computed_rate": (count / total if total else 0.0)
                 for name, count in self.store_tokens.items()}
        fetches = {"fetches": self.fetches, "fetched_blocks": self.fetched_blocks, "fetch_s": self.fetch_s,
                   "fetches_skipped": self.fetches_skipped}
        return {"tokens": dict(self.store_tokens), **rates, **fetches, **self.store.stats()}

    # ---- the KV transfer -----------------------------------------------------------------

    def _hand_off(self, worker: SimWorker, seq: Sequence) -> None:
        """The prefill worker sampled the first token: it ends the request there and keeps
        the prompt's blocks under a lease until the decode worker's pull lands."""
        decode_id = self.handoffs.pop(seq.request_id)
        lease = list(seq.block_ids)
        worker.block_manager.take(lease)
        worker.scheduler.finish(seq, "length")
        assert seq.first_token_time is not None  # _sample hands off after setting it (the prefill's only token)
        self._report_finished(worker, seq.request_id, seq.first_token_time - seq.arrival_time, 0)
        self.records[seq.request_id].worker_id = f"{worker.worker_id}>{decode_id}"
        self.pulls.setdefault(decode_id, collections.deque()).append(_Pull(worker, lease, seq, self.now))
        self._start_pulls(self.workers[decode_id])

    def _start_pulls(self, decode: SimWorker) -> None:
        """Start the decode worker's waiting pulls, in order, while it has room for the
        blocks each needs: it allocates them before it pulls into them (docs/evaluation.md §3.1)."""
        queue = self.pulls.get(decode.worker_id)
        manager, size = decode.block_manager, self.config.block_size
        while queue:
            pull = queue[0]
            held = manager.match_prefix(pull.seq.block_hashes, pull.seq.token_ids, pull.seq.prompt_len // size)
            moving = blocks_to_move(pull.seq.prompt_len, len(held), size)
            if manager.blocks_to_take(held, moving) > manager.num_available:
                return  # a step that frees blocks tries again
            queue.popleft()
            manager.take(held)
            pull.blocks = held + manager.allocate(moving)
            num_bytes = moving * self.config.kv_bytes_per_block
            _, end = self.links.reserve(self.now, pull.prefill.worker_id, decode.worker_id, num_bytes)
            self.transfer_bytes += num_bytes
            self.records[pull.seq.request_id].transfer_s = end - pull.asked_at
            self.awaiting[decode.worker_id] -= 1
            self.landing.setdefault(decode.worker_id, {})[pull.seq.request_id] = end
            self._at(end, ("kv_landed", pull, decode))

    def _kv_landed(self, pull: _Pull, decode: SimWorker) -> None:
        """The pulled blocks are on the decode worker: the prefill worker's lease ends, the
        full blocks are named there, and the request joins the running batch with its
        prompt computed and its first token already sent."""
        request_id = pull.seq.request_id
        del self.landing[decode.worker_id][request_id]
        pull.prefill.block_manager.release(pull.lease)
        _, request = self.sequences[request_id]
        seq = Sequence(request_id=request_id, prompt_len=pull.seq.prompt_len, token_ids=pull.seq.token_ids[:],
                       params=SamplingParams(max_tokens=request.output_tokens, ignore_eos=True),
                       arrival_index=next(decode.arrivals), root_hash=pull.seq.root_hash,
                       block_size=self.config.block_size, eos_token_ids=frozenset(),
                       max_model_len=self.config.max_model_len, arrival_time=self.now)
        seq.first_token_time = pull.seq.first_token_time
        seq.block_ids, seq.num_computed = pull.blocks, seq.prompt_len
        full = seq.prompt_len // self.config.block_size
        decode.block_manager.commit(seq.block_ids, seq.block_hashes, seq.token_ids, 0, full)
        seq.status = SequenceStatus.RUNNING
        decode.scheduler.running.append(seq)
        self.sequences[request_id] = (seq, request)
        decode.changed = True
        if not decode.busy:
            self._start_step(decode)

    def _heartbeat(self) -> None:
        for worker_id, worker in self.workers.items():
            if not worker.changed:
                continue
            worker.changed = worker.busy
            manager, scheduler = worker.block_manager, worker.scheduler
            worker.sink.cluster.report(worker_id, len(scheduler.running), len(scheduler.waiting), manager.num_used,
                                       manager.num_cached)

    def _report_finished(self, worker: SimWorker, request_id: str, ttft_s: float, outputs: int) -> None:
        """The router learns a request ended when the step that ended it does (live: the
        worker's RequestsFinished, or a prefill worker's KvReady for a hand-off)."""
        cluster = worker.sink.cluster
        placement = cluster.finish(request_id, outputs, self.now)
        if placement is not None and cluster is self.cluster:
            self.policy.finished(placement, ttft_s, self.now)

    def _root_hash(self, tenant: str) -> int:
        if tenant not in self.root_hashes:
            self.root_hashes[tenant] = root_hash("sim-model", "sim-tokenizer", "", "sim", self.config.block_size,
                                                 tenant)
        return self.root_hashes[tenant]

    def _ideal_s(self, request: WorkloadRequest) -> float:
        """The request alone on an idle worker: its prefill, then its decode steps."""
        return self.config.cost.prefill_s(request.num_tokens) + decode_alone_s(request, self.config.cost)

    # ---- the workers ---------------------------------------------------------------------

    def _start_step(self, worker: SimWorker) -> None:
        plan = worker.scheduler.schedule()
        if plan.is_empty:
            if worker.busy:
                worker.idle_since = self.now
            worker.busy = False
            return
        cost = self.config.cost
        wake_s = cost.wake_s(self.now - worker.idle_since) if cost.wake and not worker.busy else 0.0
        worker.busy = True
        for chunk in plan.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = self.now
                if chunk.seq.first_token_time is not None:  # handed off: landed at its arrival_time
                    self.records[chunk.seq.request_id].decode_wait_s = self.now - chunk.seq.arrival_time
        fetch_s = self._fetch(worker, plan) if self.store is not None else 0.0
        end = first_end = self.now + fetch_s + wake_s + worker.step_time(plan)
        steps = 1
        # A request placed here cuts a quiet run short (_cut_quiet_run); on a decode worker
        # every arrival and landing bounds it instead.
        next_arrival = math.inf
        if worker.role == "decode":  # landing KV adds work too
            if self.arrived < len(self.arrival_times):
                next_arrival = self.arrival_times[self.arrived]
            landing = self.landing.get(worker.worker_id)
            if self.awaiting[worker.worker_id]:
                next_arrival = self.now  # a landing at a time not yet known: no quiet run
            elif landing:
                next_arrival = min(next_arrival, min(landing.values()))
        # Step `steps` starts at `end`; an arrival at or before that instant is handled
        # first (arrivals were queued first), and might join it.
        if self.config.fuse_quiet_steps and end < next_arrival:
            quiet = self._quiet_steps(worker, plan)
            if quiet:
                step_s = worker.decode_step_times(plan)
                while steps <= quiet and end < next_arrival:
                    end += step_s(steps)
                    steps += 1
        self.steps += steps
        worker.run = _Run(self._at(end, ("step_done", worker, plan, steps)), plan, first_end, steps)

    def _cut_quiet_run(self, worker: SimWorker) -> None:
        """A request joined the queue of a worker in a quiet run: the run ends at its first
        step end at or after now, where the worker schedules the request, as if the run
        had been bounded by this arrival from its start; its event for the longer run is
        void. A quiet run changes nothing another worker or the router sees, so the
        arrivals placed elsewhere need not end it."""
        run = worker.run
        if run is None or run.steps == 1:
            return
        end, steps = run.first_end, 1
        step_s = worker.decode_step_times(run.plan)
        while steps < run.steps and end < self.now:
            end += step_s(steps)
            steps += 1
        if steps < run.steps:
            self.steps -= run.steps - steps
            worker.run = _Run(self._at(end, ("step_done", worker, run.plan, steps)), run.plan, run.first_end, steps)

    def _quiet_steps(self, worker: SimWorker, plan: SchedulePlan) -> int:
        """How many steps from this one on change nothing but their sequences' progress:
        a decode of every running sequence, none of which then fills or needs a block
        or finishes; 0 for any other plan."""
        scheduler = worker.scheduler
        if scheduler.waiting or plan.preempted or len(plan.chunks) != len(scheduler.running):
            return 0
        size = self.config.block_size
        quiet = size
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.start
            params = seq.params
            if (chunk.num_new != 1 or not chunk.samples or seq.first_token_time is None or params.stop_token_ids
                    or (seq.eos_token_ids and not params.ignore_eos)):
                return 0  # not a decode, or one whose token could stop it
            # After step s the sequence has computed start + s + 1 tokens: a multiple of the
            # block size names a block (and the next step needs a new one). It then holds
            # start + s + 2 tokens, which its length limits may end it at.
            quiet = min(quiet, (-(start + 1)) % size, params.max_tokens + seq.prompt_len - start - 2,
                        seq.max_model_len - start - 2)
        return max(quiet, 0)

    def _step_done(self, worker: SimWorker, plan: SchedulePlan, steps: int) -> int:
        """Apply a finished step (the last of `steps`, the others quiet); returns how
        many requests it completed."""
        if steps > 1:
            for chunk in plan.chunks:
                _advance_quietly(chunk, steps - 1)
        worker.scheduler.complete(plan)
        completed = 0
        for chunk in plan.chunks:
            if chunk.samples and self._sample(worker, chunk.seq):
                completed += 1
        if worker.role == "decode" and self.pulls.get(worker.worker_id):
            self._start_pulls(worker)
        self._start_step(worker)
        return completed

    def _sample(self, worker: SimWorker, seq: Sequence) -> bool:
        """Append a stand-in token (_stand_in); True when the request is done."""
        if seq.first_token_time is None:
            record = self.records[seq.request_id]  # read at the first token and the last only: a million-entry table
            seq.first_token_time = self.now
            record.first_token_s = self.now + self.config.network_s + self.config.first_token_extra_s
            scheduled = seq.first_scheduled_time
            assert scheduled is not None  # _start_step set it when it scheduled the chunk
            record.queue_s = scheduled - seq.arrival_time
            record.prefill_s = self.now - scheduled
            record.num_cached_tokens = seq.num_cached_tokens
            if self.store is not None:
                self._count_store_hits(seq, record)
        seq.append_token(_stand_in(seq.num_tokens, seq.arrival_index))
        if seq.check_stop(seq.token_ids[-1]) is None:
            return False
        if seq.request_id in self.handoffs:
            self._hand_off(worker, seq)
            return False
        worker.scheduler.finish(seq, "length")
        record = self.records[seq.request_id]
        assert record.first_token_s is not None and seq.first_token_time is not None  # set at its first token
        assert seq.first_scheduled_time is not None  # _start_step set it when it scheduled the chunk
        record.finish_s = max(self.now + self.config.network_s, record.first_token_s)
        record.output_tokens = seq.num_output_tokens
        # A handed-off request's decode runs from its first step on the decode worker,
        # which came after its first token.
        record.decode_s = self.now - max(seq.first_token_time, seq.first_scheduled_time)
        self._report_finished(worker, seq.request_id, seq.first_token_time - seq.arrival_time, seq.num_output_tokens)
        del self.sequences[seq.request_id]
        return True


class _PromptHashes:
    """A prompt's block hashes (common.hashing.chain_hashes from its root), memoised per
    named span (WorkloadRequest.span_ids) where the workload names them: the full blocks
    of the same span after the same parent hash have the same hashes, so a trace's or a
    generated shape's shared prefixes are hashed once per run, not once per request.
    Spans of whole blocks are memoised one after another; where a span ends inside a
    block, only the first span's full blocks are (the next span starts mid-block).
    docs/evaluation.md §3.3"""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.spans: dict[tuple[int, int], list[int]] = {}  # (parent hash, span id) -> its blocks' hashes

    def __call__(self, root: int, request: WorkloadRequest, tokens: np.ndarray) -> list[int]:
        """The hashes of the request's full blocks; `tokens` is its `token_ids`, which the
        caller has joined already."""
        size, span = self.block_size, request.span_tokens
        if not request.span_ids or span < size:
            return chain_hashes(root, tokens, size)
        hashes: list[int] = []
        parent = root
        whole = min(len(request.span_ids), len(tokens) // span)
        named_tokens = span - span % size  # the span's full blocks
        for index, span_id in enumerate(request.span_ids[:whole if span == named_tokens else min(whole, 1)]):
            named = self.spans.get((parent, span_id))
            if named is None:
                start = index * span
                named = self.spans[parent, span_id] = chain_hashes(parent, tokens[start:start + named_tokens], size)
            hashes.extend(named)
            parent = named[-1]
        hashes.extend(chain_hashes(parent, tokens[len(hashes) * size:], size))  # the rest, from a block boundary
        return hashes


def _token_list(tokens: np.ndarray) -> list[int]:
    """A prompt's token ids as the sequence's growable list: an array of C unsigned ints
    (one copy of the buffer, where tolist() makes an int object per token, and cheap for
    common.hashing to encode again), or a list where that type is not 32 bits. The array
    does all the scheduler and block manager ask of the list (len, items, slices, append,
    extend), so it stands in for one here."""
    if _UINT32_ARRAY:
        return cast(list[int], array("I", np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()))
    return tokens.tolist()


def _stand_in(position: int, arrival_index: int) -> int:
    """The stand-in token a sequence samples at `position` (its length before it)."""
    return 1 + (position * 7919 + arrival_index) % STAND_IN_VOCAB


def _advance_quietly(chunk: ScheduledChunk, steps: int) -> None:
    """The decode chunk's sequence after `steps` quiet steps (Simulator._quiet_steps):
    a stand-in token each, none of which can stop it or has a first token's bookkeeping,
    so they are appended at once and the chunk then starts `steps` tokens later."""
    seq = chunk.seq
    first = seq.num_tokens
    seq.token_ids.extend(_stand_in(position, seq.arrival_index) for position in range(first, first + steps))
    seq.extend_hashes()  # what append_token does at each block boundary, all at once
    chunk.start += steps
    seq.num_computed = chunk.start


@dataclass(frozen=True, slots=True)
class _Run:
    """A worker's step event in flight: `steps` steps of `plan` (more than one: a quiet
    run), the first ending at `first_end`. Only the event of this `order` is live."""

    order: int
    plan: SchedulePlan
    first_end: float
    steps: int


@dataclass(slots=True)
class _Pull:
    """A decode worker's pull of one request's KV from the prefill worker holding it."""

    prefill: SimWorker
    lease: list[int]  # the prefill worker's blocks, held until the pull lands
    seq: Sequence  # the request as the prefill worker ended it (prompt and first token)
    asked_at: float
    blocks: list[int] = field(default_factory=list)  # the decode worker's, once it has room


# What a simulator event carries, by its kind (the first item).
_Event: TypeAlias = (tuple[Literal["step_done"], SimWorker, SchedulePlan, int]  # worker, plan, steps it ends
                     | tuple[Literal["kv_landed"], _Pull, SimWorker]  # the pull and its decode worker
                     | tuple[Literal["heartbeat"]])


def _room_blocks(state) -> int:
    """Blocks a worker could still allocate as the router knows it: free or evictable
    cache, less what placements took since its last report."""
    return max(0, state.kv_blocks_total - state.kv_blocks_used - state.blocks_since_report)


@contextlib.contextmanager
def _rare_gc():
    """Millions of short-lived index nodes and blocks would trigger the cycle collector
    thousands of times (13 % of a Mooncake-trace run); collect rarely while simulating."""
    previous = gc.get_threshold()
    gc.set_threshold(200_000, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*previous)


def simulate(requests: list[WorkloadRequest], config: SimConfig, progress=None) -> SimResult:
    return Simulator(config).run(requests, progress)


def decode_alone_s(request: WorkloadRequest, cost: CostModel) -> float:
    """The request's decode steps after its first token, in a batch of one at its
    prompt's context: no batch or context makes a step cheaper, so its decode takes at
    least this long."""
    return max(request.output_tokens - 1, 0) * cost.decode_step_s(1, request.num_tokens)
