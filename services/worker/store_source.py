"""The KV store as the engine's KvSource (common/engine/kv_connector.py), and the owner of
its write-back sink, on the worker's loop (docs/architecture.md §8): it hands the store thread
(services/worker/kv_store_use.py) its fetches, takes their results without waiting, and
offers blocks only where the router's index does not say the store lacks them.
"""
from __future__ import annotations

import queue
import time
from collections.abc import Callable

import torch

from common.config import ClusterConfig
from common.cost_model import load_cost_model
from common.engine.engine import Engine
from common.engine.kv_connector import (
    KnownBlocks,
    KvLoad,
    Landed,
    Offer,
    StoreHint,
    Writeback,
    WritebackConfig,
    no_offer,
)
from common.metrics import Registry
from common.protocol import Generate
from common.sampling_params import InvalidRequestError
from services.worker.kv_store_use import (
    MAX_FETCHES_IN_FLIGHT,
    TIER_NAMES,
    FetchCosts,
    FetchJob,
    FetchResult,
    StoreAPI,
    StoreThread,
    cheapest_block_s,
)

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
                                          "Store lookups of prompt blocks past the local cache: fetched, "
                                          "recomputed (not worth it) or missed (not stored)",
                                          labels=("decision",))
        self.failures = registry.counter("baton_worker_kvstore_failures_total",
                                         "KV store calls that failed (the request recomputed, or the copy "
                                         "was lost)", labels=("op",))


class StoreSource:
    """The KV store as the engine's KvSource, and its write-back (`Writeback`, the sink it
    adds to the engine): the store thread, the fetches it has out, and what has been reported to metrics so far. A part
    it starts covers the load's named (full) blocks from `start` on; it lands a leading
    run of them, as many as the store holds and `decide` finds worth fetching."""

    name = "kvstore"

    def __init__(self, config: ClusterConfig, engine: Engine, make_client: Callable[[], StoreAPI], registry: Registry):
        self.config = config
        self.engine = engine
        self.metrics = StoreMetrics(registry)
        known = KnownBlocks(KNOWN_STORED_BLOCKS)
        self.writeback = Writeback(WritebackConfig(config.kvstore_writeback_queue_blocks,
                                                   config.kvstore_writeback_min_hits),
                                   known, engine.block_manager, engine.read_blocks)
        engine.add_sink(self.writeback)
        self.costs = FetchCosts(load_cost_model(config.profile), engine.config.block_size)
        pool = None
        if engine.device.type == "cpu":  # the store copies straight into the engine's blocks
            pool = engine.kv_cache.data.view(-1).view(torch.uint8).numpy()
        self.thread = StoreThread(make_client, pool, engine.kv_cache.layout, self.writeback.queue, known, self.costs,
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

    # ---- KvSource

    def match(self, load: KvLoad, start: int) -> Offer:
        """The load's named blocks from `start` on, at the cost of the cheapest prefix of
        the tiers they are on, as `decide` weighs them: the run the router's index names
        (none when it says the store lacks the first of them, or holds no run at all),
        else, where the index does not say (no hint, or the engine's cache ends elsewhere
        than the router believes), all of them at the fastest tier's cost. Never sure:
        the router's view may be stale, and a lookup tells."""
        count = len(load.block_hashes) - start
        if count <= 0:
            return no_offer("nothing")
        if not self.accepting():
            return no_offer("off")
        hint = load.store_hint
        first = load.first_block + start
        run = hint.run_from(first) if hint is not None else None
        if run == 0 or (hint is not None and not hint.tiers):
            # A prompt with no stored run at all past the blocks the router believes are
            # cached here is not looked up even where the cache ends elsewhere: asking
            # would cost most prompts the store lacks a round trip, to find, at best, a
            # few blocks written back a moment ago.
            return no_offer("known_miss")
        if self.config.kvstore_fetch == "always":  # the operator's choice: no cost is weighed
            return Offer(run or count, 0.0)
        if run is not None and hint is not None:
            tiers = hint.tiers[first - hint.start:][:count]
            return Offer(len(tiers), self._block_s(tiers))
        return Offer(count, self._block_s((0,) * count))

    def start(self, load: KvLoad, start: int, rival_block_s: float) -> bool:
        """Ask the store thread for the load's named blocks from `start` on; its lookup
        then fetches the leading run `decide` finds cheaper than `rival_block_s` a block."""
        keys = load.block_hashes[start:]
        if not keys or not self.accepting():
            return False
        dst = load.dst_block_ids[start:start + len(keys)]
        self.thread.submit(FetchJob(load.request_id, load.namespace, keys, dst,
                                    time.monotonic() + self.config.kvstore_timeout_s, rival_block_s))
        self.in_flight[load.request_id] = dst
        return True

    def _block_s(self, tiers: tuple[int, ...]) -> float:
        """Seconds a block of the cheapest leading run of blocks on `tiers` costs to fetch."""
        layout = self.engine.kv_cache.layout
        return cheapest_block_s(tiers, layout.bytes_per_block, self.costs.links())

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

    def recompute_s(self, block: int) -> float:
        """Seconds this engine takes to compute prompt block `block` (the rival of a fetch
        that may stop short: services/worker/kv_loads.py)."""
        return self.costs.block_prefill_s(block * self.engine.config.block_size)

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
        now = dict(written=counters.written_blocks, dropped=self.writeback.queue.dropped_blocks,
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
