"""`least_load`: cache-blind, the least windowed work (docs/router.md §3) first."""
from __future__ import annotations

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback, ranked


class LeastLoad(StatelessFeedback):
    name = "least_load"

    def choose(self, request: Request, cluster: ClusterState, now: float) -> list[str]:
        return ranked(cluster, lambda w: (cluster.load_s(w, now), len(cluster.workers[w].in_flight)))
