"""`round_robin`: cache-blind, each worker in turn."""
from __future__ import annotations

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback


class RoundRobin(StatelessFeedback):
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request: Request, cluster: ClusterState, now: float) -> list[str]:
        ordered = cluster.worker_ids
        if not ordered:
            return []
        start = self.turn % len(ordered)
        self.turn += 1
        return ordered[start:] + ordered[:start]
