"""Placement policies: plain objects that pick a worker from the cluster's state.

They own no sockets or clocks, so the live router and the simulator run the same code.
Prefix-aware policies (lpm, cache_aware, e2, dynamo) join these in the router issue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WorkerLoad:
    """What a policy may know of a worker."""

    worker_id: str
    running: int
    waiting: int
    in_flight: int  # requests placed there and not reported finished
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    num_prompt_tokens: int
    tenant: str = ""


class PlacementPolicy(Protocol):
    name: str

    def choose(self, request: PlacementRequest, workers: list[WorkerLoad]) -> list[str]:
        """Worker ids in order of preference (the router takes the first with room)."""


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request: PlacementRequest, workers: list[WorkerLoad]) -> list[str]:
        ordered = sorted(w.worker_id for w in workers)
        if not ordered:
            return []
        start = self.turn % len(ordered)
        self.turn += 1
        return ordered[start:] + ordered[:start]


class LeastLoad:
    """Fewest requests in flight, then the lowest KV usage."""

    name = "least_load"

    def choose(self, request: PlacementRequest, workers: list[WorkerLoad]) -> list[str]:
        ranked = sorted(workers, key=lambda w: (w.in_flight, w.kv_blocks_used / max(w.kv_blocks_total, 1),
                                                w.worker_id))
        return [w.worker_id for w in ranked]


def make_policy(name: str) -> PlacementPolicy:
    policies = {"round_robin": RoundRobin, "least_load": LeastLoad}
    if name not in policies:
        raise ValueError(f"policy: unknown {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
