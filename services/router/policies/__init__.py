"""Placement policies, one module each, selectable by name (docs/router.md §4)."""
from __future__ import annotations

from common.config import ROUTER_POLICIES
from services.router.native import use_compiled

use_compiled(__name__, __path__)  # before the policies: cost_aware may load compiled

from services.router.policies.base import PlacementPolicy  # noqa: E402
from services.router.policies.cache_aware import CacheAware  # noqa: E402
from services.router.policies.cost_aware import CostAware  # noqa: E402
from services.router.policies.dynamo import Dynamo  # noqa: E402
from services.router.policies.e2 import E2  # noqa: E402
from services.router.policies.least_load import LeastLoad  # noqa: E402
from services.router.policies.lpm import LongestPrefixMatch  # noqa: E402
from services.router.policies.round_robin import RoundRobin  # noqa: E402

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
