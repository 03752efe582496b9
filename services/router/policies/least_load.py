"""`least_load`: cache-blind, the least windowed work (docs/router.md §3) first."""
from __future__ import annotations

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback
from services.router.ranking import Ranking


class LeastLoad(StatelessFeedback):
    name = "least_load"

    def choose(self, request: Request, cluster: ClusterState, now: float) -> Ranking:
        return cluster.ranking(cluster.exact_loads(now), cluster.batch_by_slot)
