"""Whether fetching a prompt's blocks from the KV store beats computing them
(docs/architecture.md §8).

Fetching n blocks costs the store call's latency plus their bytes over the measured
bandwidth of the tiers they sit on; computing them costs their tokens' prefill seconds,
from this engine's own measured prefill throughput. Both sides are measured as they go
(EWMAs) and seeded conservatively: slow links and the cost profile's prefill, so an
unmeasured worker recomputes unless the store is clearly worth it. `decide` is pure.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.cost_model import CostModel

FETCH_MODES = ("auto", "always", "never")
TIER_NAMES = ("dram", "ssd")  # the store's tier numbers, as StoreEvents and lookup give them
SEED_BANDWIDTH = (1e9, 2e8)  # bytes/s of a fetch from DRAM, from SSD, before any is measured
SEED_LATENCY = (2e-3, 10e-3)  # seconds of one fetch call's fixed cost, per tier
EWMA_ALPHA = 0.2
MIN_PREFILL_SAMPLE_TOKENS = 16  # a prefill too short to time says nothing of throughput


class Ewma:
    """An exponentially weighted moving average, starting at a seed."""

    def __init__(self, seed: float, alpha: float = EWMA_ALPHA):
        self.value = seed
        self.alpha = alpha
        self.samples = 0

    def update(self, sample: float) -> None:
        self.value += self.alpha * (sample - self.value)
        self.samples += 1


@dataclass(frozen=True)
class Link:
    """One tier's fetch cost: seconds = latency_s + bytes / bytes_per_s."""

    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Decision:
    fetch: bool
    num_blocks: int  # the leading stored blocks to fetch (0: recompute)
    fetch_s: float  # predicted seconds to fetch them ...
    compute_s: float  # ... and to compute their tokens instead
    reason: str


def decide(mode: str, tiers: Sequence[int], bytes_per_block: int, block_size: int,
           links: Sequence[Link], prefill_s: float) -> Decision:
    """Fetch the stored prefix whose tiers are `tiers` (tier of each leading block) or
    recompute it. `prefill_s` is the prefill seconds of ONE block's tokens; with "auto"
    the longest-saving prefix is fetched when its predicted fetch time beats computing it."""
    if mode not in FETCH_MODES:
        raise ValueError(f"kvstore_fetch: {mode!r} is not one of {FETCH_MODES}")
    if not tiers:
        return Decision(False, 0, 0.0, 0.0, "not_stored")
    if any(not 0 <= tier < len(links) for tier in tiers):
        raise ValueError(f"tiers {list(tiers)} outside the {len(links)} known tiers")
    best = (0.0, 0, 0.0, 0.0)  # saving, blocks, fetch_s, compute_s
    transfer = 0.0
    for count, tier in enumerate(tiers, 1):
        transfer += bytes_per_block / links[tier].bytes_per_s
        fetch_s = transfer + max(links[t].latency_s for t in tiers[:count])
        compute_s = count * prefill_s
        if mode == "always" or compute_s - fetch_s > best[0]:
            best = (compute_s - fetch_s, count, fetch_s, compute_s)
    _, count, fetch_s, compute_s = best
    if mode == "never":
        return Decision(False, 0, fetch_s, compute_s, "never")
    if mode == "always":
        return Decision(True, len(tiers), fetch_s, compute_s, "always")
    if count == 0:
        return Decision(False, 0, fetch_s, compute_s, "slower_than_prefill")
    return Decision(True, count, fetch_s, compute_s, "faster_than_prefill")


class FetchCosts:
    """What `decide` needs, measured: per tier bandwidth and latency from the store
    client's own calls, and the engine's prefill throughput from its prefill steps.
    Used from the worker's loop only (the store thread hands its timings back)."""

    def __init__(self, cost_model: CostModel, block_size: int):
        self.cost_model = cost_model
        self.block_size = block_size
        self.bandwidth = [Ewma(seed) for seed in SEED_BANDWIDTH]
        self.latency = [Ewma(seed) for seed in SEED_LATENCY]
        self.prefill_rate = Ewma(0.0)  # tokens/s; unused until measured

    def links(self) -> list[Link]:
        return [Link(b.value, lat.value) for b, lat in zip(self.bandwidth, self.latency)]

    def block_prefill_s(self, depth_tokens: int = 0) -> float:
        """Seconds to prefill one block's tokens: measured, else the cost profile's."""
        if self.prefill_rate.samples:
            return self.block_size / self.prefill_rate.value
        return self.cost_model.recompute_s(self.block_size, depth_tokens)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            self.prefill_rate.update(tokens / seconds)

    def observe_call(self, tier: int, seconds: float) -> None:
        """A store call that moved no bytes (a lookup): its round trip is the latency."""
        if 0 <= tier < len(self.latency) and seconds > 0:
            self.latency[tier].update(seconds)

    def observe_fetch(self, tiers: Sequence[int], num_bytes: int, seconds: float) -> None:
        """A fetch of blocks on `tiers` moved `num_bytes` in `seconds`; the time past the
        slowest tier's latency is its transfer (attributed to that tier)."""
        if not tiers or num_bytes <= 0 or seconds <= 0:
            return
        tier = max(tiers)
        if not 0 <= tier < len(self.bandwidth):
            return
        transfer_s = max(seconds - self.latency[tier].value, seconds / 2)
        self.bandwidth[tier].update(num_bytes / transfer_s)

    def decide(self, mode: str, tiers: Sequence[int], bytes_per_block: int, depth_tokens: int = 0) -> Decision:
        return decide(mode, tiers, bytes_per_block, self.block_size, self.links(),
                      self.block_prefill_s(depth_tokens))
