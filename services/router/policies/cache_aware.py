"""`cache_aware`: the SGLang router's rule.

Load is requests in flight. When the cluster is imbalanced (max − min > balance_abs and
max > min × balance_rel) the least loaded worker wins; otherwise the best prefix match
wins if it covers more than cache_threshold of the prompt; otherwise the least loaded.
With the KV store holding the prompt's prefix, "covers" is priced: the share of the cold
prefill time the best holder saves over a worker that fetches from the store
(ClusterState.store_share, docs/router.md §7), so a prefix every worker can fetch cheaply
no longer ties the request to its holder.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback
from services.router.ranking import Ranking


@dataclass(frozen=True)
class CacheAwareConfig:
    balance_abs: int = 64
    balance_rel: float = 1.5
    cache_threshold: float = 0.3


class CacheAware(StatelessFeedback):
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig = CacheAwareConfig()):
        self.config = config

    def choose(self, request: Request, cluster: ClusterState, now: float) -> Ranking | list[str]:
        loads = cluster.batch_by_slot  # requests in flight
        if not loads:
            return []
        most, least = max(loads), min(loads)
        if most - least > self.config.balance_abs and most > least * self.config.balance_rel:
            return cluster.ranking(loads, cluster.zeros_by_slot)
        if cluster.store_share(request) > self.config.cache_threshold:
            return cluster.ranking(cluster.held_by_slot(request), loads)
        return cluster.ranking(loads, cluster.zeros_by_slot)
