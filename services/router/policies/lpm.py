"""`lpm`: locality only. The longest cached prefix wins whatever its holder's queue,
the failure mode the seeds warn of; ties go to the fewest requests in flight."""
from __future__ import annotations

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback
from services.router.ranking import Ranking


class LongestPrefixMatch(StatelessFeedback):
    name = "lpm"

    def choose(self, request: Request, cluster: ClusterState, now: float) -> Ranking:
        return cluster.ranking(cluster.held_by_slot(request), cluster.batch_by_slot)
