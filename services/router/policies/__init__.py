"""Placement policies, one module each, selectable by name (docs/router.md §4)."""
from __future__ import annotations

from common.config import ROUTER_POLICIES
from services.router.policies.base import PlacementPolicy
from services.router.policies.cache_aware import CacheAware
from services.router.policies.cost_aware import CostAware
from services.router.policies.dynamo import Dynamo
from services.router.policies.e2 import E2
from services.router.policies.least_load import LeastLoad
from services.router.policies.lpm import LongestPrefixMatch
from services.router.policies.round_robin import RoundRobin

POLICIES: dict[str, type] = {policy.name: policy for policy in
                             (RoundRobin, LeastLoad, LongestPrefixMatch, CacheAware, Dynamo, E2,
                              CostAware)}
# The config validates names against ROUTER_POLICIES (common/ cannot import this package):
# the two lists must be one.
if tuple(POLICIES) != ROUTER_POLICIES:
    raise ImportError(f"policies {tuple(POLICIES)} differ from common.config.ROUTER_POLICIES {ROUTER_POLICIES}")


def make_policy(name: str) -> PlacementPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()


__all__ = ["POLICIES", "PlacementPolicy", "make_policy"]
