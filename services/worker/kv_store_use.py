"""Whether fetching a prompt's blocks from the KV store beats computing them, or, on a
decode worker, pulling them from the prefill worker (docs/architecture.md §8).

Fetching n blocks costs the store call's latency plus their bytes over the measured
bandwidth of the tiers they sit on; computing them costs their tokens' prefill seconds,
from this engine's own measured prefill throughput; pulling them costs their bytes over
the KV transport's measured bandwidth (services/decode/lease_source.py; the pull of the
rest runs anyway, so its latency is not saved). Which way is chosen per request is
services/worker/kv_loads.py's, on these costs. Both sides are measured as they go
(EWMAs) and seeded conservatively: slow links and the cost profile's prefill, so an
unmeasured worker recomputes unless the store is clearly worth it. `decide` is pure.
StoreThread is the worker's one thread that calls the store; StoreSource
(services/worker/store_source.py) is the loop's side of it.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from common.cost_model import CostModel
from common.engine.kv_connector import KnownBlocks, WritebackQueue
from common.engine.kv_layout import KVLayout
from common.logs import get_logger

log = get_logger("worker")

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
    recompute it. `prefill_s` is the prefill seconds of ONE block's tokens (on a decode
    worker: the seconds to pull one block instead); with "auto" the longest-saving prefix
    is fetched when its predicted fetch time beats computing (or pulling) it."""
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


def cheapest_block_s(tiers: Sequence[int], bytes_per_block: int, links: Sequence[Link]) -> float:
    """The lowest cost per block of fetching a leading run of blocks on `tiers`: `decide`
    fetches some of them exactly when this is below the other way's cost per block."""
    cheapest, transfer, latency = math.inf, 0.0, 0.0
    for count, tier in enumerate(tiers, 1):
        transfer += bytes_per_block / links[tier].bytes_per_s
        latency = max(latency, links[tier].latency_s)
        cheapest = min(cheapest, (transfer + latency) / count)
    return cheapest


class FetchCosts:
    """What `decide` needs, measured: per tier bandwidth and latency from the store
    client's own calls (the store thread updates those), and the engine's prefill
    throughput from its prefill steps (the loop updates that). Each EWMA has one writer."""

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


# ---- the store thread --------------------------------------------------------------------

MAX_FETCHES_IN_FLIGHT = 32  # requests waiting on the store at once; more compute at once
PUT_BACKOFF_S = 1.0  # after a failed put, write-back waits this long (staged copies queue, then drop)
# A put is two round trips to the store's process. Put at each eviction (every step once
# the pool is full), the store, this thread and the engine's threads woke each other every
# step and took turns on a small machine's cores: batched, served decode after the pool
# fills gained ~3 % (docs/performance.md §10.1). So staged blocks wait for company: a put
# takes at least this many...
WRITEBACK_BATCH_BLOCKS = 64
WRITEBACK_MAX_WAIT_S = 0.5  # ...or whatever has waited this long
IDLE_POLL_S = 0.05  # how often the thread looks for due write-back while no fetch comes


class StoreAPI(Protocol):
    """What the store thread uses of services/kvstore/client.py StoreClient."""

    def lookup(self, namespace: int, keys: Sequence[int]) -> list[int]: ...

    def fetch(self, namespace: int, keys: Sequence[int], dst_pool: np.ndarray,
              dst_block_ids: Sequence[int]) -> int: ...

    def put(self, namespace: int, keys: Sequence[int], parents: Sequence[int], values: np.ndarray) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class FetchJob:
    """Blocks `keys` of `namespace` to land in the engine's `dst_block_ids`, in order."""

    request_id: str
    namespace: int
    keys: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    deadline: float  # monotonic; past it the thread answers 0 without calling the store
    block_other_s: float  # for `decide`: what a block costs if not fetched (prefill, or pull)


@dataclass(frozen=True)
class FetchResult:
    request_id: str
    landed: int  # leading blocks of the job's fetch that hold their KV
    decision: str  # fetch, recompute (not worth it), miss (not stored) or failed
    tiers: tuple[int, ...] = ()  # of the landed blocks
    bounce: np.ndarray | None = None  # the values when the engine's pool is not host memory
    error: str = ""


@dataclass
class StoreCounters:
    """Counted by the store thread, read by the loop for metrics (ints: no lock needed)."""

    written_blocks: int = 0
    put_failures: int = 0
    fetched_blocks: list[int] = field(default_factory=lambda: [0] * len(TIER_NAMES))
    fetch_failures: int = 0


class StoreThread:
    """The worker's one thread that talks to the KV store, so that the engine's loop never
    waits on it: fetch jobs come in on a bounded queue (lookup, `decide`, fetch), their
    results go back on another; between jobs it drains the engine's write-back queue,
    each eviction's chains root-first. Every store call has the client's deadline, so a
    dead store costs a job its deadline at most and the request recomputes."""

    def __init__(self, make_client: Callable[[], StoreAPI], engine_pool: np.ndarray | None,
                 layout: KVLayout, writeback: WritebackQueue | None,
                 known: KnownBlocks, costs: FetchCosts, mode: str):
        if mode not in FETCH_MODES:
            raise ValueError(f"kvstore_fetch: {mode!r} is not one of {FETCH_MODES}")
        self.make_client = make_client
        self.engine_pool = engine_pool  # the flat uint8 pool when the engine's KV is in host memory
        self.layout = layout
        self.writeback = writeback
        self.known = known
        self.costs = costs
        self.mode = mode
        self.jobs: queue.Queue[FetchJob] = queue.Queue(MAX_FETCHES_IN_FLIGHT)
        self.results: queue.Queue[FetchResult] = queue.Queue(MAX_FETCHES_IN_FLIGHT + 1)
        self.counters = StoreCounters()
        self.stop = threading.Event()
        self.put_blocked_until = 0.0
        # half the queue at most, so that a put is due before the queue drops copies
        self.writeback_batch = min(WRITEBACK_BATCH_BLOCKS, max(1, writeback.capacity_blocks // 2)) if writeback else 0
        self._thread = threading.Thread(target=self._run, name="kvstore", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float) -> None:
        self.stop.set()
        self._thread.join(timeout_s)

    def submit(self, job: FetchJob) -> None:
        """Queue a fetch; the caller keeps fewer than MAX_FETCHES_IN_FLIGHT unanswered, so
        neither queue fills."""
        self.jobs.put_nowait(job)

    def _run(self) -> None:
        client: StoreAPI | None = None
        try:
            while not self.stop.is_set():
                try:
                    job: FetchJob | None = self.jobs.get(timeout=0.001 if self._writeback_due() else IDLE_POLL_S)
                except queue.Empty:
                    job = None
                if client is None and (job is not None or self._writeback_due()):
                    client = self._connect()
                if job is not None:
                    self.results.put(self._fetch(client, job))
                elif client is not None and self._writeback_due():
                    self._write_back(client)
        finally:
            if client is not None:
                client.close()

    def _connect(self) -> StoreAPI | None:
        """A client, or None (logged; tried again after PUT_BACKOFF_S or on the next fetch)."""
        try:
            return self.make_client()
        except Exception as error:  # noqa: BLE001 (each request recomputes meanwhile)
            log.error("kvstore_client_failed", error=str(error))
            self.put_blocked_until = time.monotonic() + PUT_BACKOFF_S
            return None

    def _fetch(self, client: StoreAPI | None, job: FetchJob) -> FetchResult:
        request_id = job.request_id
        try:
            if client is None:
                raise ConnectionError("no KV store client")
            if time.monotonic() >= job.deadline:
                raise TimeoutError("the fetch waited past its deadline")
            started = time.monotonic()
            tiers = client.lookup(job.namespace, job.keys)
            self.costs.observe_call(0, time.monotonic() - started)
            self.known.add(job.namespace, job.keys[:len(tiers)])
            decision = decide(self.mode, tiers, self.layout.bytes_per_block, self.layout.block_size,
                              self.costs.links(), job.block_other_s)
            if not decision.fetch:
                return FetchResult(request_id, 0, "miss" if decision.reason == "not_stored" else "recompute")
            if time.monotonic() >= job.deadline:
                raise TimeoutError("the lookup ended past the fetch's deadline")
            count = decision.num_blocks
            bounce = None
            if self.engine_pool is not None:
                pool, dst = self.engine_pool, list(job.dst_block_ids[:count])
            else:
                bounce = pool = np.empty(count * self.layout.bytes_per_block, np.uint8)
                dst = list(range(count))
            started = time.monotonic()
            landed = client.fetch(job.namespace, job.keys[:count], pool, dst)
            landed_tiers = tuple(tiers[:landed])
            self.costs.observe_fetch(landed_tiers, landed * self.layout.bytes_per_block,
                                     time.monotonic() - started)
            for tier in landed_tiers:
                if 0 <= tier < len(TIER_NAMES):
                    self.counters.fetched_blocks[tier] += 1
            return FetchResult(request_id, landed, "fetch", landed_tiers, bounce)
        except Exception as error:  # noqa: BLE001 (StoreUnavailable, a refusal, a bad reply: recompute)
            self.counters.fetch_failures += 1
            log.warning("kvstore_fetch_failed", request_id=request_id, error=str(error))
            return FetchResult(request_id, 0, "failed", error=str(error))

    def _writeback_due(self) -> bool:
        """Staged blocks enough to share a put's round trips, or staged long enough, and no
        failed put being waited out."""
        writeback = self.writeback
        if writeback is None or writeback.num_blocks == 0 or time.monotonic() < self.put_blocked_until:
            return False
        return writeback.num_blocks >= self.writeback_batch or writeback.oldest_age_s() >= WRITEBACK_MAX_WAIT_S

    def _write_back(self, client: StoreAPI) -> None:
        """Put everything staged, namespace by namespace, each in its root-first order."""
        assert self.writeback is not None  # _writeback_due checked
        batch = self.writeback.pop_all()
        if batch is None:
            return
        namespaces = list(dict.fromkeys(batch.namespaces))
        for index, namespace in enumerate(namespaces):
            rows = [i for i, ns in enumerate(batch.namespaces) if ns == namespace]
            keys = [batch.keys[i] for i in rows]
            values = batch.values if len(rows) == len(batch.keys) else batch.values[rows]  # one namespace: no copy
            try:
                self.counters.written_blocks += client.put(namespace, keys, [batch.parents[i] for i in rows], values)
            except Exception as error:  # noqa: BLE001 (a put that fails loses copies, nothing else)
                self.counters.put_failures += 1
                for lost in namespaces[index:]:  # not stored after all: stage them again when evicted again
                    self.known.discard(lost, [key for key, ns in zip(batch.keys, batch.namespaces) if ns == lost])
                self.put_blocked_until = time.monotonic() + PUT_BACKOFF_S
                log.warning("kvstore_put_failed", blocks=len(keys), error=str(error))
                return
