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
NUM_PRIORITY_GROUPS = 10


class QueuePolicy(Protocol):
    name: str

    def order(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[Sequence]:
        """The waiting sequences in the order to try admitting them."""

    def admitted(self, seq: Sequence) -> None:
        """`seq`, from the latest `order()`, was admitted; stateful policies advance."""


class FcfsPolicy:
    """First come, first served; blind to sharing."""

    name = "fcfs"

    def order(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[Sequence]:
        return sorted(waiting, key=lambda seq: seq.arrival_index)

    def admitted(self, seq: Sequence) -> None:
        pass


class LongestPrefixMatchPolicy:
    """Most cached prefix blocks first (SGLang's LPM); ties by arrival. Can starve
    requests that share nothing; PriorityQuotaPolicy bounds that."""

    name = "lpm"

    def order(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[Sequence]:
        return sorted(waiting, key=lambda seq: (-cached_blocks(seq), seq.arrival_index))

    def admitted(self, seq: Sequence) -> None:
        pass


def hit_group(cached_tokens: int, num_tokens: int) -> int:
    """Preble's priority group of a request: ceil(hit ratio · 10) − 1, clamped to 0..9, so
    group g holds hit ratios in (g/10, (g+1)/10] and a request with no hit is in group 0.
    Integer arithmetic keeps the boundaries exact."""
    group = -(-cached_tokens * NUM_PRIORITY_GROUPS // num_tokens) - 1
    return min(max(group, 0), NUM_PRIORITY_GROUPS - 1)


class PriorityQuotaPolicy:
    """Preble's priority quotas: local fairness on top of LPM.

    Waiting requests fall into 10 groups by cache-hit ratio (`hit_group`). Groups take
    turns round-robin, group g admitting up to (g+1)·quota_unit requests per turn, in LPM
    order within the group; a group with nothing waiting is skipped without using a turn.
    High-hit requests still get most of the admissions, but a low-hit one waits at most
    about one round of turns instead of starving under LPM.

    The turn in progress (`group`, and `used` slots of its quota) persists across steps:
    `order()` lays out the whole walk from it, and `admitted()` advances it by each
    request the scheduler actually admitted, so admitting any prefix of the order leaves
    the walk consistent.
    """

    name = "priority"

    def __init__(self, quota_unit: int = 10):
        if quota_unit < 1:
            raise ValueError(f"quota_unit: must be >= 1, got {quota_unit}")
        self.quota_unit = quota_unit
        self.group = 0
        self.used = 0
        self._groups: dict[str, int] = {}  # request_id -> group, as of the latest order()

    def quota(self, group: int) -> int:
        return (group + 1) * self.quota_unit

    def order(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[Sequence]:
        return self._walk(self._buckets(waiting, cached_blocks))

    def admitted(self, seq: Sequence) -> None:
        group = self._groups[seq.request_id]
        if group != self.group:
            # The walk only leaves a turn early when its group has run out of requests.
            self.group, self.used = group, 0
        self.used += 1
        if self.used == self.quota(group):
            self.group, self.used = (group + 1) % NUM_PRIORITY_GROUPS, 0

    def _buckets(self, waiting: list[Sequence], cached_blocks: CachedBlocksProbe) -> list[list[Sequence]]:
        """The waiting sequences of each group in LPM order; records each one's group."""
        probed = sorted(((cached_blocks(seq), seq) for seq in waiting),
                        key=lambda pair: (-pair[0], pair[1].arrival_index))
        buckets: list[list[Sequence]] = [[] for _ in range(NUM_PRIORITY_GROUPS)]
        self._groups = {}
        for blocks, seq in probed:
            group = hit_group(blocks * seq.block_size, seq.num_tokens)
            self._groups[seq.request_id] = group
            buckets[group].append(seq)
        return buckets

    def _walk(self, buckets: list[list[Sequence]]) -> list[Sequence]:
        """Every bucketed sequence, in the order the turns admit them from the current one."""
        total = sum(map(len, buckets))
        taken = [0] * NUM_PRIORITY_GROUPS
        ordered: list[Sequence] = []
        group, used = self.group, self.used
        while len(ordered) < total:
            start = taken[group]
            end = min(start + self.quota(group) - used, len(buckets[group]))
            ordered.extend(buckets[group][start:end])
            taken[group] = end
            group, used = (group + 1) % NUM_PRIORITY_GROUPS, 0
        return ordered


_POLICIES = {policy.name: policy
             for policy in (FcfsPolicy, LongestPrefixMatchPolicy, PriorityQuotaPolicy)}


def make_queue_policy(name: str) -> QueuePolicy:
    if name not in _POLICIES:
        raise ValueError(f"queue_policy: unknown policy {name!r}; choose one of {sorted(_POLICIES)}")
    return _POLICIES[name]()
