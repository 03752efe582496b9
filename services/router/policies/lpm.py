"""`lpm`: locality only. The longest cached prefix wins whatever its holder's queue,
the failure mode the seeds warn of; ties go to the fewest requests in flight."""
from __future__ import annotations

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback, ranked


class LongestPrefixMatch(StatelessFeedback):
    name = "lpm"

    def choose(self, request: Request, cluster: ClusterState, now: float) -> list[str]:
        return ranked(cluster, lambda w: (-request.matched.get(w, 0), len(cluster.workers[w].in_flight)))
