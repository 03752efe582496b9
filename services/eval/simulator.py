"""A discrete-event simulator of a Baton cluster on virtual time (docs/evaluation.md §3).

Nothing here re-implements a policy. The router side is the live router's own objects
(ClusterState with its prefix index and loads, the placement policy, AdmissionControl);
each worker is the live engine's own Scheduler, BlockManager and waiting-queue policy.
Only the model is replaced: a step takes the time the cost model gives for its plan, and
every sampled token is a stand-in id. KV events go from each block manager to the index
as they happen; load reports and finished requests reach the router on heartbeats, as
they do live.

Step time of a plan (prefill chunks and decode tokens run as one forward pass, as in the
engine): the larger of the phases' fixed costs, plus each prefill chunk's marginal cost
over the context before it, plus the decode batch's marginal cost at its mean context.

Quiet runs: most steps of a long run decode the same batch one token further and change
nothing anyone else sees (no block is allocated, named or freed, no request starts or
ends, no arrival comes in between). Such a run of steps is one event: its steps' times
are summed one by one as separate events would sum them, and its sequences advance
token by token when it ends, the last step through the scheduler as usual. The results
are the same as stepping one at a time (`fuse_quiet_steps=False`; tests compare both).
On the Mooncake trace this makes 6× fewer step events and ~15 % less wall time (most of
what remains is per-block work: hashing, naming, the index's KV events).

Co-located workers only for now; prefill/decode pools join when disaggregation does
(a SimWorker per role, and a transfer delay between them).
"""
from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.cost_model import CostModel
from common.engine.block_manager import BlockManager
from common.engine.queue_policy import make_queue_policy
from common.engine.scheduler import SchedulePlan, Scheduler, SchedulerConfig
from common.engine.sequence import Sequence
from common.hashing import root_hash
from common.sampling_params import SamplingParams
from services.eval.report import RequestRecord, RunTotals
from services.eval.workloads.base import WorkloadRequest
from services.router.admission import AdmissionConfig, AdmissionControl, Slo
from services.router.cluster import ClusterState
from services.router.policies import make_policy

STAND_IN_VOCAB = 30_000


@dataclass(frozen=True)
class SimConfig:
    workers: int
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

    def __post_init__(self) -> None:
        if self.network_s < 0 or self.network_s + self.first_token_extra_s < 0:
            raise ValueError(f"network_s ({self.network_s}) and network_s + first_token_extra_s "
                             f"({self.network_s + self.first_token_extra_s}) must not be negative")


@dataclass
class SimResult:
    records: list[RequestRecord]
    totals: RunTotals
    steps: int


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


class SimWorker:
    """One worker: the engine's scheduler and block manager, with modelled step times."""

    def __init__(self, worker_id: str, config: SimConfig, sink: _EventSink):
        self.worker_id = worker_id
        self.config = config
        self.block_manager = BlockManager(config.kv_blocks, config.block_size, sink)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs),
            self.block_manager, make_queue_policy(config.queue_policy))
        self.sink = sink
        self.busy = False
        self.changed = False  # since the last heartbeat: an idle worker's report would say nothing new
        self.finished: list[tuple[str, float, int]] = []  # (request id, ttft, outputs) since the last beat
        self.arrivals = itertools.count()

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


class Simulator:
    def __init__(self, config: SimConfig):
        self.config = config
        self.now = 0.0
        ttl = config.index_ttl_s
        self.cluster = ClusterState(config.block_size, config.cost, config.load_window_s, ttl)
        self.policy = make_policy(config.policy)
        self.admission = AdmissionControl(
            AdmissionConfig(config.admission, config.max_queued_requests, config.max_queued_tokens),
            config.slos)
        self.workers: dict[str, SimWorker] = {}
        for index in range(config.workers):
            worker_id = f"worker-{index}"
            self.cluster.add_worker(worker_id, config.kv_blocks)
            self.workers[worker_id] = SimWorker(worker_id, config, _EventSink(self.cluster, worker_id,
                                                                              lambda: self.now))
        # (time, order, kind, payload): a WorkloadRequest ("arrive"), (worker, plan, steps)
        # ("step_done") or None ("heartbeat")
        self.events: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.records: dict[str, RequestRecord] = {}
        self.sequences: dict[str, tuple[Sequence, WorkloadRequest]] = {}
        self.root_hashes: dict[str, int] = {}
        self.steps = 0
        self.arrival_times: list[float] = []  # every arrival event's time, in order
        self.arrived = 0  # how many of them have been handled

    # ---- driving -----------------------------------------------------------------------

    def run(self, requests: Iterable[WorkloadRequest], progress=None) -> SimResult:
        """Simulate until every request has finished or been refused."""
        with _rare_gc():
            return self._run(requests, progress)

    def _run(self, requests: Iterable[WorkloadRequest], progress) -> SimResult:
        for request in requests:
            self._at(request.arrival_s + self.config.network_s, "arrive", request)
        self.arrival_times = sorted(time for time, _, _, _ in self.events)
        self._at(self.config.heartbeat_interval_s, "heartbeat", None)
        pending = len(self.events) - 1
        while self.events and pending:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrived += 1
                self._arrive(payload)
            elif kind == "step_done":
                pending -= self._step_done(*payload)
            elif kind == "heartbeat":
                self._heartbeat()
                self._at(self.now + self.config.heartbeat_interval_s, "heartbeat", None)
            if kind == "arrive" and self.records[payload.request_id].rejected:
                pending -= 1
            if progress is not None and kind != "heartbeat":
                progress(self.now)
        evictions = sum(worker.sink.evicted for worker in self.workers.values())
        totals = RunTotals(duration_s=self.now, gpus=self.config.workers, evictions=evictions,
                           eviction_recompute_s=evictions * self.config.cost.recompute_s(self.config.block_size))
        return SimResult(list(self.records.values()), totals, self.steps)

    def _at(self, time: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (time, next(self.order), kind, payload))

    # ---- the router ----------------------------------------------------------------------

    def _arrive(self, request: WorkloadRequest) -> None:
        record = RequestRecord(request.request_id, request.slo_class, request.arrival_s,
                               len(request.token_ids))
        self.records[request.request_id] = record
        root = self._root_hash(request.tenant)
        candidate = self.cluster.prepare(request.request_id, root, request.token_ids, request.output_tokens,
                                         self.now, request.slo_class)
        preference = self.policy.choose(candidate, self.cluster, self.now)
        verdict = self.admission.decide(candidate, preference, self.cluster, self.now)
        if verdict.worker_id is None:
            record.rejected = True
            return
        self.cluster.place(candidate, verdict.worker_id, self.now)
        record.worker_id = verdict.worker_id
        record.ideal_s = self._ideal_s(request)
        worker = self.workers[verdict.worker_id]
        seq = Sequence(request_id=request.request_id, prompt_len=len(request.token_ids),
                       token_ids=request.token_ids.tolist(),
                       params=SamplingParams(max_tokens=request.output_tokens, ignore_eos=True),
                       arrival_index=next(worker.arrivals), root_hash=root, block_size=self.config.block_size,
                       eos_token_ids=frozenset(), max_model_len=self.config.max_model_len,
                       arrival_time=self.now)
        self.sequences[request.request_id] = (seq, request)
        worker.add(seq)
        if not worker.busy:
            self._start_step(worker)

    def _heartbeat(self) -> None:
        for worker_id, worker in self.workers.items():
            if not worker.changed:
                continue
            worker.changed = worker.busy
            manager, scheduler = worker.block_manager, worker.scheduler
            self.cluster.report(worker_id, len(scheduler.running), len(scheduler.waiting), manager.num_used,
                                manager.num_cached)
            for request_id, ttft, outputs in worker.finished:
                placement = self.cluster.finish(request_id, outputs)
                if placement is not None:
                    self.policy.finished(placement, ttft, self.now)
            worker.finished = []

    def _root_hash(self, tenant: str) -> int:
        if tenant not in self.root_hashes:
            self.root_hashes[tenant] = root_hash("sim-model", "sim-tokenizer", "", "sim", self.config.block_size,
                                                 tenant)
        return self.root_hashes[tenant]

    def _ideal_s(self, request: WorkloadRequest) -> float:
        """The request alone on an idle worker: its prefill, then its decode steps."""
        return self.config.cost.prefill_s(len(request.token_ids)) + decode_alone_s(request, self.config.cost)

    # ---- the workers ---------------------------------------------------------------------

    def _start_step(self, worker: SimWorker) -> None:
        plan = worker.scheduler.schedule()
        if plan.is_empty:
            worker.busy = False
            return
        worker.busy = True
        for chunk in plan.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = self.now
        end = self.now + worker.step_time(plan)
        steps = 1
        next_arrival = self.arrival_times[self.arrived] if self.arrived < len(self.arrival_times) else math.inf
        # Step `steps` starts at `end`; an arrival at or before that instant is handled
        # first (arrivals were queued first), and might join it.
        if self.config.fuse_quiet_steps and end < next_arrival:
            quiet = self._quiet_steps(worker, plan)
            while steps <= quiet and end < next_arrival:
                end += worker.step_time(plan, steps)
                steps += 1
        self.steps += steps
        self._at(end, "step_done", (worker, plan, steps))

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
        for _ in range(steps - 1):
            for chunk in plan.chunks:
                chunk.seq.num_computed = chunk.start + 1
                self._sample(worker, chunk.seq)
                chunk.start += 1
        worker.scheduler.complete(plan)
        completed = 0
        for chunk in plan.chunks:
            if chunk.samples and self._sample(worker, chunk.seq):
                completed += 1
        self._start_step(worker)
        return completed

    def _sample(self, worker: SimWorker, seq: Sequence) -> bool:
        """Append a stand-in token; True when the request is done."""
        record = self.records[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = self.now
            record.first_token_s = self.now + self.config.network_s + self.config.first_token_extra_s
            scheduled = seq.first_scheduled_time
            assert scheduled is not None  # _start_step set it when it scheduled the chunk
            record.queue_s = scheduled - seq.arrival_time
            record.prefill_s = self.now - scheduled
            record.num_cached_tokens = seq.num_cached_tokens
        seq.append_token(1 + (seq.num_tokens * 7919 + seq.arrival_index) % STAND_IN_VOCAB)
        if seq.check_stop(seq.token_ids[-1]) is None:
            return False
        worker.scheduler.finish(seq, "length")
        assert record.first_token_s is not None and seq.first_token_time is not None  # set at its first token
        record.finish_s = max(self.now + self.config.network_s, record.first_token_s)
        record.output_tokens = seq.num_output_tokens
        record.decode_s = self.now - seq.first_token_time
        worker.finished.append((seq.request_id, seq.first_token_time - seq.arrival_time, seq.num_output_tokens))
        del self.sequences[seq.request_id]
        return True


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
    return max(request.output_tokens - 1, 0) * cost.decode_step_s(1, len(request.token_ids))
