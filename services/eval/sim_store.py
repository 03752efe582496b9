"""The tiered KV store as the simulator models it (docs/evaluation.md §3.2).

The bookkeeping is the live store's own KVIndex (services/kvstore/index.py): leaf-first
LRU eviction between watermarks, DRAM → SSD demotion, SSD drops, promotion of what a get
reads from SSD. Only the bytes are replaced: a tier here counts slots and holds nothing,
and moving a block costs the time `StoreModel.fetch_s` gives (bytes / tier bandwidth +
tier latency per tier touched).

One namespace holds every block: the simulated cluster serves one model, and block
hashes are chained from each tenant's root, so tenants' chains never share a key (per
tenant quotas are not modelled).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.cost_model import CostModel
from services.kvstore.dram import SlottedTier
from services.kvstore.index import IndexConfig, KVIndex, KVStoreError, ReadLease

NAMESPACE = "sim"
TIER_NAMES = ("dram", "ssd")
GB = 1e9  # the store's sizes are decimal GB, as ClusterConfig.kvstore_dram_gb


@dataclass(frozen=True)
class StoreModel:
    """The simulated store: tier sizes (0 = the tier is absent; both 0 = no store) and
    what moving a block from each tier costs."""

    dram_gb: float = 0.0
    ssd_gb: float = 0.0
    dram_gbps: float = 5.0  # GB/s from the store's DRAM into an engine's pool
    dram_latency_s: float = 0.001  # per fetch that touches the tier
    ssd_gbps: float = 1.0
    ssd_latency_s: float = 0.002
    high_watermark: float = 0.9
    low_watermark: float = 0.8

    def __post_init__(self) -> None:
        for name in ("dram_gb", "ssd_gb", "dram_latency_s", "ssd_latency_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"store {name} must be a finite number >= 0, got {value}")
        if not (self.dram_gbps > 0 and self.ssd_gbps > 0):
            raise ValueError(f"store bandwidths must be positive, got dram {self.dram_gbps}, ssd {self.ssd_gbps}")
        IndexConfig(high_watermark=self.high_watermark, low_watermark=self.low_watermark)  # checks them

    @property
    def enabled(self) -> bool:
        return self.dram_gb > 0 or self.ssd_gb > 0

    def tiers(self) -> tuple[tuple[str, float], ...]:
        """(name, GB) of each present tier, fastest first."""
        return tuple((name, gb) for name, gb in zip(TIER_NAMES, (self.dram_gb, self.ssd_gb)) if gb > 0)

    def fetch_s(self, tiers: Iterable[str], block_bytes: int) -> float:
        """Seconds to move blocks held in `tiers` (one name per block) into a pool: per
        tier touched, its latency plus its blocks' bytes over its bandwidth."""
        counts = dict.fromkeys(TIER_NAMES, 0)
        for name in tiers:
            counts[name] += 1
        return self.fetch_s_counts(counts, block_bytes)

    def fetch_s_counts(self, counts: dict[str, int], block_bytes: int) -> float:
        """`fetch_s` of {tier name: blocks}."""
        total = 0.0
        for name, count in counts.items():
            if count:
                gbps, latency = (self.dram_gbps, self.dram_latency_s) if name == "dram" else \
                    (self.ssd_gbps, self.ssd_latency_s)
                total += latency + count * block_bytes / (gbps * GB)
        return total


class CountingTier(SlottedTier):
    """A tier of `capacity` slots that tracks which are taken and stores no bytes."""

    def read(self, slot: int, nbytes: int) -> memoryview:
        return memoryview(b"")

    def write(self, slot: int, data: memoryview | bytes) -> None:
        return None


def _no_checksum(_data: memoryview) -> int:
    return 0


class SimStore:
    """The cluster's one store: KVIndex over counting tiers, with the engine side's
    decisions (write back a chain root-first; fetch only when it beats recomputing)."""

    def __init__(self, model: StoreModel, block_bytes: int):
        if not model.enabled:
            raise ValueError("the store model has no tier (both sizes are 0)")
        if block_bytes <= 0:
            raise ValueError("the store needs the model's KV bytes per block")
        tiers = []
        for name, gb in model.tiers():
            capacity = int(gb * GB // block_bytes)
            if capacity < 1:
                raise ValueError(f"a {gb} GB {name} tier holds no {block_bytes}-byte block")
            tiers.append(CountingTier(name, capacity, block_bytes))
        self.model, self.block_bytes = model, block_bytes
        self.index = KVIndex(IndexConfig(high_watermark=model.high_watermark, low_watermark=model.low_watermark,
                                         demote_min_hits=0, max_events=1), tiers, _no_checksum)
        self.written_back = 0  # blocks newly stored
        self.put_failures = 0  # chains cut short: the first tier had no block it could free

    def holds(self, key: int) -> bool:
        return self.index.lookup(NAMESPACE, (key,)).length == 1

    def put_chain(self, chain: Sequence[tuple[int, int | None]], now: float) -> None:
        """Store (key, parent) blocks root-first; a block already stored is only touched."""
        for key, parent in chain:
            try:
                ticket = self.index.start_put(NAMESPACE, key, parent, self.block_bytes, now)
                self.index.commit(ticket, 0)
            except KVStoreError:
                self.put_failures += 1
                return
            if not ticket.already_stored:
                self.written_back += 1

    def lookup(self, keys: Sequence[int]) -> tuple[str, ...]:
        """The tier of each block of the longest stored prefix of `keys`."""
        return self.index.lookup(NAMESPACE, keys).tiers

    def plan_fetch(self, tiers: Sequence[str], start_tokens: int, block_size: int,
                   cost: CostModel) -> tuple[int, float]:
        """(blocks to fetch, seconds the fetch takes): the leading run of the stored blocks
        `tiers` (beyond `start_tokens` the engine holds) whose fetch saves the most prefill
        time, or (0, 0.0) when no fetch beats recomputing those tokens. Runs end where the
        tier changes (a tier touched costs its latency)."""
        best, best_s, best_saving = 0, 0.0, 0.0
        counts = dict.fromkeys(TIER_NAMES, 0)
        for count, name in enumerate(tiers, start=1):
            counts[name] += 1
            if count < len(tiers) and tiers[count] == name:
                continue
            fetch_s = self.model.fetch_s_counts(counts, self.block_bytes)
            saving = cost.recompute_s(count * block_size, start_tokens) - fetch_s
            if saving > best_saving:
                best, best_s, best_saving = count, fetch_s, saving
        return best, best_s

    def get(self, keys: Sequence[int], now: float) -> ReadLease:
        """Lease the blocks for the fetch (promoting those on SSD when DRAM has room)."""
        return self.index.get(NAMESPACE, keys, now)

    def release(self, lease: ReadLease) -> None:
        self.index.release(lease)

    def stats(self) -> dict:
        counters = self.index.counters
        tiers = {tier.name: {"capacity_blocks": tier.capacity, "used_blocks": tier.used}
                 for tier in self.index.tiers}
        return {"tiers": tiers, "written_back_blocks": self.written_back, "put_failures": self.put_failures,
                "demoted": counters["demoted"], "promoted": counters["promoted"], "evicted": counters["evicted"]}
