"""`e2`: Preble's exploit / explore placement with rebalancing and replication (docs/router.md §4.6).

With T prompt tokens and h the longest prefix any worker holds:
  * exploit (h > T − h): among the workers holding h (and replicas of that prefix), the
    least loaded;
  * explore: the worker with the least C = L + M + P (windowed load, recompute cost of
    the hit blocks it would evict, prefill time of what it lacks).
Rebalancing: when the heaviest worker's load reaches `rebalance_ratio` × the lightest's,
the heavy worker's prefixes are redirected to the light one, cheapest to recompute first,
until about half the gap has moved. Replication: when the TTFT a prefix saw in the recent
half-window is `replicate_ratio` × that of the older half, the prefix gets a replica on
the least loaded other worker and its traffic splits between the holders by load.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.cluster import ClusterState, Placement, Request


@dataclass(frozen=True)
class E2Config:
    rebalance: bool = True
    rebalance_ratio: float = 1.5
    replicate_ratio: float = 2.0
    min_requests_to_rebalance: int = 4  # in the heavy worker's window: too few is noise
    check_every: float = 1 / 36  # of the load window, between balance checks (5 s of 3 min)
    min_ttft_samples: int = 3  # per half-window before replication may trigger


class HalfWindowMeans:
    """Sum and count of samples in the current half-window and the one before it."""

    def __init__(self) -> None:
        self.epoch = 0
        self.now = [0.0, 0]
        self.before = [0.0, 0]

    def add(self, value: float, epoch: int) -> None:
        self._roll(epoch)
        self.now[0] += value
        self.now[1] += 1

    def halves(self, epoch: int) -> tuple[list, list]:
        """(recent, older) as [sum, count]."""
        self._roll(epoch)
        return self.now, self.before

    def _roll(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.before = self.now if epoch == self.epoch + 1 else [0.0, 0]
            self.now, self.epoch = [0.0, 0], epoch


@dataclass
class Redirect:
    worker_id: str
    until: float


class E2:
    name = "e2"

    def __init__(self, config: E2Config = E2Config()):
        self.config = config
        self.redirects: dict[int, Redirect] = {}  # prefix key -> where its next request goes
        self.replicas: dict[int, Redirect] = {}  # prefix key -> an extra holder
        self.ttfts: dict[int, HalfWindowMeans] = {}  # prefix key -> its TTFTs by half-window
        self.checked_balance_at = -float("inf")
        self.half_window_s = 0.0  # the cluster's, learned on the first decision

    def choose(self, request: Request, cluster: ClusterState, now: float) -> Sequence[str]:
        if not cluster.workers:
            return []
        self.half_window_s = cluster.window_s / 2
        if self.config.rebalance and now - self.checked_balance_at >= cluster.window_s * self.config.check_every:
            self.checked_balance_at = now
            self._maybe_rebalance(cluster, cluster.loads(now), now)
        if request.best_cached_tokens > request.num_tokens - request.best_cached_tokens:
            loads = cluster.loads(now)
            return cluster.load_order(now, lead=self._exploit(request, cluster, loads, now))
        return cluster.explore_order(request, now)

    def finished(self, placement: Placement, ttft_s: float, now: float) -> None:
        key = placement.prefix_key
        if key is None or ttft_s < 0 or not self.half_window_s:  # not placed by this policy
            return
        self.ttfts.setdefault(key, HalfWindowMeans()).add(ttft_s, int(now / self.half_window_s))

    # ---- exploit, rebalance, replicate -----------------------------------------------

    def _exploit(self, request: Request, cluster: ClusterState, loads: dict[str, float], now: float) -> str:
        key = request.prefix_key
        assert key is not None  # exploiting: some worker holds a prefix (best_blocks > 0)
        redirect = self._live(self.redirects, key, cluster, now)
        if redirect is not None:
            # One request moves the prefix: the light worker computes it and becomes a
            # holder, and from then on the least-loaded-holder rule splits the traffic.
            del self.redirects[key]
            return redirect
        best = request.best_blocks
        holders = [w for w, blocks in request.matched.items() if blocks == best and w in cluster.workers]
        replica = self._live(self.replicas, key, cluster, now)
        if replica is None and self._overloads_holder(key, now):
            replica = self._replicate(key, holders, loads, now)
        if replica is not None and replica not in holders:
            holders.append(replica)
        holders.sort()  # ties go to the smallest id: min keeps the first of equal keys
        return min(holders, key=loads.__getitem__)

    def _overloads_holder(self, key: int, now: float) -> bool:
        stats = self.ttfts.get(key)
        if stats is None:
            return False
        recent, older = stats.halves(int(now / self.half_window_s))
        enough = self.config.min_ttft_samples
        if recent[1] < enough or older[1] < enough:
            return False
        return recent[0] / recent[1] >= self.config.replicate_ratio * older[0] / older[1]

    def _replicate(self, key: int, holders: list[str], loads: dict[str, float], now: float) -> str | None:
        others = [w for w in loads if w not in holders]
        if not others:
            return None
        target = min(others, key=lambda w: (loads[w], w))
        self.replicas[key] = Redirect(target, now + self.half_window_s)
        del self.ttfts[key]  # judge the split on fresh samples
        return target

    def _maybe_rebalance(self, cluster: ClusterState, loads: dict[str, float], now: float) -> None:
        if len(loads) < 2:
            return
        heavy = max(loads, key=lambda w: (loads[w], w))
        light = min(loads, key=lambda w: (loads[w], w))
        if loads[heavy] <= 0 or loads[heavy] < self.config.rebalance_ratio * loads[light]:
            return
        window = cluster.in_window(heavy, now)
        if len(window) < self.config.min_requests_to_rebalance:
            return
        by_prefix: dict[int, list[Placement]] = {}
        for placement in window:
            if placement.prefix_key is not None:
                by_prefix.setdefault(placement.prefix_key, []).append(placement)
        # Each prefix carries its share of the heavy worker's load; moving one costs its
        # recompute on the light worker, so the shortest prompts move first.
        share = loads[heavy] / len(window)
        movable = sorted(by_prefix.items(), key=lambda item: (min(p.num_tokens for p in item[1]), item[0]))
        to_move = (loads[heavy] - loads[light]) / 2
        until = now + cluster.window_s / 2
        for key, placements in movable:
            if to_move <= 1e-9 * loads[heavy]:  # float residue of moving exactly half
                break
            self.redirects[key] = Redirect(light, until)
            to_move -= share * len(placements)

    @staticmethod
    def _live(table: dict[int, Redirect], key: int | None, cluster: ClusterState, now: float) -> str | None:
        entry = table.get(key) if key is not None else None
        if key is None or entry is None:
            return None
        if entry.until <= now or entry.worker_id not in cluster.workers:
            del table[key]
            return None
        return entry.worker_id
