"""Waiting-queue policies: which waiting request an engine admits first.

A policy is a plain object fed with the waiting sequences and a probe that says how many
leading blocks of a sequence the local prefix cache holds; it owns no clock or socket,
so the live engine and the simulator run the same code.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from common.engine.sequence import Sequence

CachedBlocksProbe = Callable[[Sequence], int]


class QueuePolicy(Protocol):
    name: str

    def order(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[Sequence]:
        """The waiting sequences in the order to try admitting them."""


class FcfsPolicy:
    """First come, first served; blind to sharing."""

    name = "fcfs"

    def order(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[Sequence]:
        return sorted(waiting, key=lambda seq: seq.arrival_index)


class LongestPrefixMatchPolicy:
    """Most cached prefix blocks first (SGLang's LPM); ties by arrival. Can starve
    requests that share nothing; Preble's priority quotas (a later issue) bound that."""

    name = "lpm"

    def order(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[Sequence]:
        return sorted(waiting, key=lambda seq: (-cached_blocks(seq), seq.arrival_index))


def make_queue_policy(name: str) -> QueuePolicy:
    policies = {"fcfs": FcfsPolicy, "lpm": LongestPrefixMatchPolicy}
    if name not in policies:
        raise ValueError(f"queue_policy: unknown policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
