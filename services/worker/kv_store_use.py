"""Whether fetching a prompt's blocks from the KV store beats computing them, or, on a
decode worker, pulling them from the prefill worker (docs/architecture.md §8).

Fetching n blocks costs the store call's latency plus their bytes over the measured
bandwidth of the tiers they sit on; computing them costs their tokens' prefill seconds,
from this engine's own measured prefill throughput; pulling them costs their bytes over
the KV transport's measured bandwidth (the pull of the rest runs anyway, so its latency
is not saved). Both sides are measured as they go
(EWMAs) and seeded conservatively: slow links and the cost profile's prefill, so an
unmeasured worker recomputes unless the store is clearly worth it. `decide` is pure.
StoreThread is the worker's one thread that calls the store; StoreSource is the loop's
side of it, the KV store as a KvSource (common/engine/kv_connector.py) and the sink of
the engine's write-back.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from common.config import ClusterConfig
from common.cost_model import CostModel, load_cost_model
from common.engine.engine import Engine
from common.engine.kv_connector import KnownBlocks, KvLoad, Landed, StoreHint, WritebackConfig, WritebackQueue
from common.engine.kv_layout import KVLayout
from common.logs import get_logger
from common.metrics import Registry
from common.protocol import Generate
from common.sampling_params import InvalidRequestError

log = get_logger("worker")

FETCH_MODES = ("auto", "always", "never")
TIER_NAMES = ("dram", "ssd")  # the store's tier numbers, as StoreEvents and lookup give them
SEED_BANDWIDTH = (1e9, 2e8)  # bytes/s of a fetch from DRAM, from SSD, before any is measured
SEED_LATENCY = (2e-3, 10e-3)  # seconds of one fetch call's fixed cost, per tier
# bytes/s of a pull from a prefill worker before any is measured: as fast as the store's
# DRAM, so an unmeasured decode worker pulls (the store's latency makes it the slower)
# until its pulls show the store faster
SEED_PULL_BANDWIDTH = 1e9
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
        self.pull_bandwidth = Ewma(SEED_PULL_BANDWIDTH)  # bytes/s of the KV transport's pulls

    def links(self) -> list[Link]:
        return [Link(b.value, lat.value) for b, lat in zip(self.bandwidth, self.latency)]

    def block_prefill_s(self, depth_tokens: int = 0) -> float:
        """Seconds to prefill one block's tokens: measured, else the cost profile's."""
        if self.prefill_rate.samples:
            return self.block_size / self.prefill_rate.value
        return self.cost_model.recompute_s(self.block_size, depth_tokens)

    def block_pull_s(self, bytes_per_block: int) -> float:
        """Seconds to pull one block from a prefill worker: measured, else the seed's."""
        return bytes_per_block / self.pull_bandwidth.value

    def observe_pull(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.pull_bandwidth.update(num_bytes / seconds)

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


# ---- the loop's side -----------------------------------------------------------------------

KNOWN_STORED_BLOCKS = 1 << 16  # (namespace, block) the store is remembered to hold, at most
STORE_RETRY_S = 2.0  # after a failed fetch, requests compute without asking the store this long


class StoreMetrics:
    def __init__(self, registry: Registry):
        self.written = registry.counter("baton_worker_kvstore_written_blocks_total",
                                        "Evicted blocks written back to the KV store")
        self.dropped = registry.counter("baton_worker_kvstore_dropped_blocks_total",
                                        "Evicted blocks not written back: the staging queue was full")
        self.fetched = registry.counter("baton_worker_kvstore_fetched_blocks_total",
                                        "Prompt blocks fetched from the KV store, by tier", labels=("tier",))
        self.decisions = registry.counter("baton_worker_kvstore_fetch_decisions_total",
                                          "Prompts with blocks past the local cache: fetched, recomputed "
                                          "(not worth it), missed (not stored) or known_miss (the router's "
                                          "index says the store holds none of them: not asked)",
                                          labels=("decision",))
        self.failures = registry.counter("baton_worker_kvstore_failures_total",
                                         "KV store calls that failed (the request recomputed, or the copy "
                                         "was lost)", labels=("op",))


class StoreSource:
    """The KV store as the engine's KvSource, and the sink of its write-back: the store
    thread, the fetches it has out, and what has been reported to metrics so far. A part
    it starts covers the load's named (full) blocks from `start` on; it lands a leading
    run of them, as many as the store holds and `decide` finds worth fetching."""

    name = "kvstore"

    def __init__(self, config: ClusterConfig, engine: Engine, make_client: Callable[[], StoreAPI], registry: Registry):
        self.config = config
        self.engine = engine
        self.metrics = StoreMetrics(registry)
        known = KnownBlocks(KNOWN_STORED_BLOCKS)
        writeback = engine.enable_writeback(
            WritebackConfig(config.kvstore_writeback_queue_blocks, config.kvstore_writeback_min_hits), known)
        self.costs = FetchCosts(load_cost_model(config.profile), engine.config.block_size)
        pool = None
        if engine.device.type == "cpu":  # the store copies straight into the engine's blocks
            pool = engine.kv_cache.data.view(-1).view(torch.uint8).numpy()
        self.thread = StoreThread(make_client, pool, engine.kv_cache.layout, writeback, known, self.costs,
                                  config.kvstore_fetch)
        self.in_flight: dict[str, tuple[int, ...]] = {}  # request id -> its fetch's destination blocks
        self.skip_until = 0.0  # monotonic: a dead store must not cost every request a deadline
        self.prefill_seen = (0, 0.0)
        self.reported = dict(written=0, dropped=0, put_failures=0, fetch_failures=0)
        self.reported_fetched = [0] * len(TIER_NAMES)

    def start_thread(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.thread.close(self.config.kvstore_timeout_s + 1)

    def accepting(self) -> bool:
        """Whether a fetch would be asked for now: fetching is on, not too many are out, and
        the store did not fail a moment ago."""
        return self.config.kvstore_fetch != "never" and len(self.in_flight) < MAX_FETCHES_IN_FLIGHT \
            and time.monotonic() >= self.skip_until

    def hint(self, request: Generate, num_tokens: int) -> StoreHint | None:
        """The request's store_from and store_tiers, for its load (InvalidRequestError names
        what is wrong)."""
        tiers = request.store_tiers
        if tiers is None:
            return None
        num_blocks = num_tokens // self.engine.config.block_size
        if not 0 <= request.store_from <= num_blocks - len(tiers):
            raise InvalidRequestError("store_from", f"{request.store_from} with {len(tiers)} store_tiers; the "
                                      f"prompt has {num_blocks} full blocks")
        if any(not 0 <= tier < len(TIER_NAMES) for tier in tiers):
            raise InvalidRequestError("store_tiers", f"a tier must be 0 to {len(TIER_NAMES) - 1}")
        return StoreHint(request.store_from, tuple(tiers))

    def may_hold(self, hint: StoreHint | None) -> bool:
        """False when the router's index says the store holds nothing right after this
        engine's cache (counted as a known miss): the load need not even be begun for the
        store. Where the cache ends elsewhere than the router believes, a fetch is lost, never
        a wrong block loaded."""
        if hint is None or hint.tiers:
            return True
        self.metrics.decisions.inc(decision="known_miss")
        return False

    # ---- KvSource

    def start(self, load: KvLoad, start: int) -> bool:
        """Ask the store thread for the load's named blocks from `start` on; False (nothing
        asked) when there are none, the router's index says the store lacks the first of
        them, or the store is not `accepting`."""
        keys = load.block_hashes[start:]
        if not keys or not self.accepting():
            return False
        if load.store_hint is not None and load.store_hint.run_from(load.first_block + start) == 0:
            self.metrics.decisions.inc(decision="known_miss")
            return False
        dst = load.dst_block_ids[start:start + len(keys)]
        if load.through_prompt_end:  # a decode worker: what the store does not give is pulled
            other_s = self.costs.block_pull_s(self.engine.kv_cache.layout.bytes_per_block)
            if not self._may_beat(len(keys), other_s):
                return False  # not even a lookup: it would only delay the pull
        else:
            other_s = self.costs.block_prefill_s((load.first_block + start) * self.engine.config.block_size)
        self.thread.submit(FetchJob(load.request_id, load.namespace, keys, dst,
                                    time.monotonic() + self.config.kvstore_timeout_s, other_s))
        self.in_flight[load.request_id] = dst
        return True

    def _may_beat(self, num_blocks: int, block_other_s: float) -> bool:
        """Whether `decide` would fetch the blocks if the store held them all on its
        fastest tier (the best a lookup could find)."""
        layout = self.engine.kv_cache.layout
        return decide(self.config.kvstore_fetch, [0] * num_blocks, layout.bytes_per_block, layout.block_size,
                      self.costs.links(), block_other_s).fetch

    def poll(self) -> list[Landed]:
        """Finished fetches (their bytes in the engine's blocks)."""
        landed: list[Landed] = []
        while True:
            try:
                result = self.thread.results.get_nowait()
            except queue.Empty:
                break
            landed.append(self._land(result))
        return landed

    def cancel(self, request_id: str) -> bool:
        """A store fetch cannot be stopped midway: it ends by its deadline, and `poll`
        reports it then."""
        return request_id not in self.in_flight

    def _land(self, result: FetchResult) -> Landed:
        dst = self.in_flight.pop(result.request_id, ())
        landed = result.landed
        if result.bounce is not None and landed:  # the engine's pool is on the device
            layout = self.engine.kv_cache.layout
            planes = 2 * layout.num_layers
            values = result.bounce.reshape(planes, -1, layout.bytes_per_block // planes)[:, :landed]
            self.engine.write_blocks(dst[:landed], values.transpose(1, 0, 2).reshape(landed, -1))
        if result.decision == "failed":
            self.skip_until = time.monotonic() + STORE_RETRY_S
        else:
            self.metrics.decisions.inc(decision=result.decision)
        return Landed(result.request_id, landed, self.name, error=result.error)

    # ---- the loop's upkeep

    def observe_engine(self) -> None:
        """Each turn: learn the engine's measured prefill throughput, for `decide`."""
        stats = self.engine.stats
        tokens, seconds = self.prefill_seen
        if stats.prefill_tokens > tokens:
            self.costs.observe_prefill(stats.prefill_tokens - tokens, stats.prefill_seconds - seconds)
            self.prefill_seen = (stats.prefill_tokens, stats.prefill_seconds)

    def report(self) -> None:
        """Move the thread's and the engine's counters into the metrics."""
        counters = self.thread.counters
        writeback = self.engine.writeback
        now = dict(written=counters.written_blocks, dropped=writeback.dropped_blocks if writeback else 0,
                   put_failures=counters.put_failures, fetch_failures=counters.fetch_failures)
        self.metrics.written.inc(now["written"] - self.reported["written"])
        self.metrics.dropped.inc(now["dropped"] - self.reported["dropped"])
        self.metrics.failures.inc(now["put_failures"] - self.reported["put_failures"], op="put")
        self.metrics.failures.inc(now["fetch_failures"] - self.reported["fetch_failures"], op="fetch")
        self.reported = now
        for tier, name in enumerate(TIER_NAMES):
            count = counters.fetched_blocks[tier]
            self.metrics.fetched.inc(count - self.reported_fetched[tier], tier=name)
            self.reported_fetched[tier] = count
