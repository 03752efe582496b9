"""Arrival processes: when each request of a workload is sent (docs/evaluation.md §5).

Each returns new requests (the inputs are frozen and left alone) sorted by arrival.
Poisson and bursty arrivals follow the requests' list order, so a conversation's turns
keep their order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from common.cost_model import CostModel
from services.eval.workloads.base import WorkloadRequest


def poisson(requests: Sequence[WorkloadRequest], rate: float, seed: int = 0) -> list[WorkloadRequest]:
    """Exponential gaps of mean 1/rate seconds; the first request arrives after one gap."""
    _check_positive("rate", rate)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(requests))
    return _with_arrivals(requests, np.cumsum(gaps))


def bursty(requests: Sequence[WorkloadRequest], rate: float, seed: int = 0, *,
           on_s: float = 5.0, off_s: float = 5.0) -> list[WorkloadRequest]:
    """On/off arrivals: Poisson at rate·(on_s + off_s)/on_s during each `on_s`-second
    burst, nothing in the `off_s` seconds between bursts, so the mean rate over whole
    on+off periods is `rate`. The first burst starts at 0."""
    _check_positive("rate", rate)
    _check_positive("on_s", on_s)
    if off_s < 0:
        raise ValueError(f"off_s must be >= 0, got {off_s}")
    burst_rate = rate * (on_s + off_s) / on_s
    on_time = np.cumsum(np.random.default_rng(seed).exponential(1.0 / burst_rate, len(requests)))
    bursts, into_burst = np.divmod(on_time, on_s)
    return _with_arrivals(requests, bursts * (on_s + off_s) + into_burst)


def trace(requests: Sequence[WorkloadRequest], time_scale: float = 1.0) -> list[WorkloadRequest]:
    """The requests' own arrival times multiplied by `time_scale` (< 1 replays faster)."""
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    return _with_arrivals(requests, [request.arrival_s * time_scale for request in requests])


def rate_for_load(requests: Sequence[WorkloadRequest], load: float, workers: int, cost_model: CostModel,
                  batch_size: int = 32) -> float:
    """The arrival rate (requests/s) that is `load` times what `workers` workers can serve
    with no cache reuse: a request costs its whole prefill plus its share of decode steps
    run `batch_size` at a time, prefill(len(prompt)) + output_tokens ·
    decode_step(batch_size, len(prompt)) / batch_size, and capacity is workers / the mean
    of that."""
    if not requests:
        raise ValueError("rate_for_load needs at least one request")
    if load < 0:
        raise ValueError(f"load must be >= 0, got {load}")
    if workers < 1 or batch_size < 1:
        raise ValueError(f"workers and batch_size must be >= 1, got {workers} and {batch_size}")
    # The model's prices by prompt length, each made once (a million requests have a few
    # thousand lengths); the sum is over requests in order, as before.
    prices: dict[int, tuple[float, float]] = {}
    service_s = []
    for request in requests:
        length = request.num_tokens
        price = prices.get(length)
        if price is None:
            price = prices[length] = (cost_model.prefill_s(length, 0), cost_model.decode_step_s(batch_size, length))
        service_s.append(price[0] + request.output_tokens * price[1] / batch_size)
    return load * workers * len(service_s) / sum(service_s)


def _with_arrivals(requests: Sequence[WorkloadRequest], arrivals: Iterable[float]) -> list[WorkloadRequest]:
    timed = [dataclasses.replace(request, arrival_s=float(arrival)) for request, arrival in zip(requests, arrivals)]
    return sorted(timed, key=lambda request: request.arrival_s)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
