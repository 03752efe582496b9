"""Admission control: take a request only where it can meet its SLO (docs/router.md §5).

Walking the policy's preference order, a worker admits a request when its queue bounds
hold and, with admission on and an SLO class given, the predicted TTFT (the prefills
queued there, then this one's missing tokens) and TPOT (the decode batch it would join)
are within the class's targets. When no worker admits, the request is refused at once
with a retry-after: Mooncake's early rejection instead of a timeout later.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from services.router.cluster import ClusterState, Request

MIN_RETRY_AFTER_S = 0.1
_num_tokens = attrgetter("num_tokens")


class Slo(Protocol):
    @property
    def ttft_s(self) -> float: ...

    @property
    def tpot_s(self) -> float: ...


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = False
    max_queued_requests: int = 256  # per worker, beyond its running batch
    max_queued_tokens: int = 262144  # per worker


class Verdict:
    """Where a request goes (worker_id None: refused, and why). A plain class: compiled, a
    dataclass's generated __init__ would run as Python once per decision."""

    __slots__ = ("worker_id", "reason", "retry_after_s", "predicted_ttft_s", "predicted_tpot_s")

    def __init__(self, worker_id: str | None, reason: str = "", retry_after_s: float = 0.0,
                 predicted_ttft_s: float = 0.0, predicted_tpot_s: float = 0.0):
        self.worker_id = worker_id
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.predicted_ttft_s = predicted_ttft_s
        self.predicted_tpot_s = predicted_tpot_s


class AdmissionControl:
    def __init__(self, config: AdmissionConfig, classes: Mapping[str, Slo]):
        self.config = config
        self.classes = dict(classes)

    def decide(self, request: Request, preference: Sequence[str], cluster: ClusterState, now: float) -> Verdict:
        slo = self.classes.get(request.slo_class) if self.config.enabled else None
        soonest_fit = math.inf
        queues_full = True
        for worker_id in preference:
            if not self._has_room(request, cluster, worker_id):
                continue
            queues_full = False
            if slo is None:
                return Verdict(worker_id)
            prefill = cluster.prefill_s(request, worker_id)
            ttft = cluster.queue_s(worker_id, now) + prefill
            tpot = cluster.tpot_s(request, worker_id)
            if ttft <= slo.ttft_s and tpot <= slo.tpot_s:
                return Verdict(worker_id, predicted_ttft_s=ttft, predicted_tpot_s=tpot)
            if tpot <= slo.tpot_s:
                soonest_fit = min(soonest_fit, ttft - slo.ttft_s)
        if queues_full:
            return Verdict(None, "every worker's queue is full", 1.0)
        retry = soonest_fit if soonest_fit != math.inf else cluster.window_s / 36
        return Verdict(None, f"predicted to miss the {request.slo_class!r} SLO on every worker",
                       max(MIN_RETRY_AFTER_S, retry))

    def _has_room(self, request: Request, cluster: ClusterState, worker_id: str) -> bool:
        """The worker's queue (placed there beyond what it reports running) has room.
        The newest placements are taken to be the ones still waiting."""
        worker = cluster.workers[worker_id]
        queued = len(worker.in_flight) - worker.running
        if queued <= 0:
            return True
        if queued >= self.config.max_queued_requests:
            return False
        limit = self.config.max_queued_tokens - request.num_tokens
        if worker.prompt_tokens_sum <= limit:  # all in flight fit, so do the newest `queued`
            return True
        waiting = itertools.islice(reversed(worker.in_flight.values()), queued)
        return sum(map(_num_tokens, waiting)) <= limit
