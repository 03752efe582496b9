"""What every placement policy is: a plain object that ranks workers for a request.

Policies own no sockets or clocks; they read a ClusterState at a caller-given time, so
the live router and the simulator run the same objects.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.router.cluster import ClusterState, Placement, Request


class PlacementPolicy(Protocol):
    name: str

    def choose(self, request: Request, cluster: ClusterState, now: float) -> Sequence[str]:
        """Every worker id, most preferred first (the router takes the first that admits).
        A policy may rank them as they are read (ranking.Ranking)."""

    def finished(self, placement: Placement, ttft_s: float, now: float) -> None:
        """A request this policy placed ended; `ttft_s` < 0 when it produced no token."""


class StatelessFeedback:
    """For policies that learn nothing from finished requests."""

    def finished(self, placement: Placement, ttft_s: float, now: float) -> None:
        return None

