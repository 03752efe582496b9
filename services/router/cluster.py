"""The router's picture of the cluster: workers, their windowed loads, the prefix index.

Policies read it, the router (or the simulator) writes it. Loads are seconds of work
from the cost model (docs/router.md §3, docs/evaluation.md §1), not request counts:
  * prefill: the prefill time of every request placed in the last window;
  * decode: requests in flight × their expected output length × the TPOT of the batch
    they share.
Each worker also has a prefill queue model (when its queued prefills will be done),
which admission control uses to predict TTFT. Every method takes `now`; nothing here
reads a clock, so virtual time works the same.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.cost_model import CostModel, LatencyFit, StorePricing
from services.router.index import BlockKeys, BlockNode, Credit, PrefixIndex, window_hits
from services.router.ranking import Ranking

RECENT_OUTPUTS = 256  # output lengths kept to estimate a request's decode work
CENSORED_REFRESH_S = 0.05  # how long a censored median stands: it reads every request in flight
EVICTION_SAMPLE = 32  # LRU blocks read to estimate what an eviction would cost
MAX_UTILIZATION = 0.99  # prefill_utilization's cap: a queue model's 1 − ρ stays positive


class Request:
    """A request being placed, with what the index knows of its prompt. A plain class, not
    a dataclass: compiled, a dataclass's generated __init__ still runs as Python, once per
    decision."""

    __slots__ = ("request_id", "root_hash", "block_keys", "num_tokens", "max_tokens", "slo_class", "path",
                 "matched", "block_size", "best_blocks")

    def __init__(self, request_id: str, root_hash: int, block_keys: BlockKeys, num_tokens: int, max_tokens: int,
                 slo_class: str = "", path: list[BlockNode] | None = None, matched: dict[str, int] | None = None,
                 block_size: int = 16):
        self.request_id = request_id
        self.root_hash = root_hash
        self.block_keys = block_keys  # each full block's token ids as little-endian uint32 bytes
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens
        self.slo_class = slo_class
        self.path: list[BlockNode] = path if path is not None else []  # indexed prefix, any holder
        self.matched: dict[str, int] = matched if matched is not None else {}  # worker id -> leading blocks held
        self.block_size = block_size
        self.best_blocks = max(self.matched.values(), default=0)  # the most leading blocks any worker holds

    def pins(self, sample: EvictionSample, held: int) -> bool:
        """Whether any block of the sample is among the prompt's first `held` blocks (which
        a worker holding them keeps while the request runs). The path's block i has depth
        i, so each block costs one comparison or two, and no node is read: the eviction
        estimate asks this of several workers' samples."""
        if held:
            path, depths, nodes = self.path, sample.depths, sample.nodes
            for i in range(len(depths)):
                depth = depths[i]
                if 0 <= depth < held and path[depth] is nodes[i]:
                    return True
        return False

    def cached_tokens(self, worker_id: str) -> int:
        """Prompt tokens the worker would reuse (the engine always computes the last one)."""
        return max(0, min(self.matched.get(worker_id, 0) * self.block_size, self.num_tokens - 1))

    @property
    def best_cached_tokens(self) -> int:
        return min(self.best_blocks * self.block_size, max(self.num_tokens - 1, 0))

    @property
    def prefix_key(self) -> int | None:
        """Names the prefix this request shares: its deepest block that some worker holds."""
        best = self.best_blocks
        return self.path[best - 1].block_hash if best else None

    def blocks_needed(self, worker_id: str) -> int:
        return -(-self.num_tokens // self.block_size) - self.matched.get(worker_id, 0)


class Placement:
    """A request the router placed and has not seen finish. A plain class, as Request is."""

    __slots__ = ("request_id", "worker_id", "placed_at", "prefill_s", "expected_output", "num_tokens",
                 "prefix_key", "predicted_ttft_s", "credited", "new_blocks")

    def __init__(self, request_id: str, worker_id: str, placed_at: float, prefill_s: float, expected_output: int,
                 num_tokens: int, prefix_key: int | None, predicted_ttft_s: float, credited: Credit | None = None,
                 new_blocks: int = 0):
        self.request_id = request_id
        self.worker_id = worker_id
        self.placed_at = placed_at
        self.prefill_s = prefill_s
        self.expected_output = expected_output
        self.num_tokens = num_tokens
        self.prefix_key = prefix_key
        self.predicted_ttft_s = predicted_ttft_s
        self.credited = credited  # what the index holds on credit for it (events mode)
        self.new_blocks = new_blocks  # KV blocks it allocates beyond the prefix the worker held


class EvictionSample:
    """A worker's least recently used blocks as read once: the cumulative recompute cost
    of evicting the first k of them, hit-weighted (`cumulative`: each block's recompute
    times its hits in the window) and once per hit block (`cumulative_once`: its
    recompute if it had any hit), the blocks read (`nodes`, and their `depths` apart: a
    pair per block would be one more object to make and free per block), and the mean
    cost per block of each (what an eviction larger than the sample is extrapolated by)."""

    __slots__ = ("cumulative", "cumulative_once", "depths", "nodes", "per_block", "per_block_once")

    def __init__(self, cumulative: list[float], cumulative_once: list[float], depths: list[int],
                 nodes: list[BlockNode]):
        self.cumulative = cumulative
        self.cumulative_once = cumulative_once
        self.depths = depths
        self.nodes = nodes
        self.per_block = cumulative[-1] / len(cumulative) if cumulative else 0.0
        self.per_block_once = cumulative_once[-1] / len(cumulative_once) if cumulative_once else 0.0

    def cost(self, to_evict: int, per_hit: bool = True) -> float:
        cumulative = self.cumulative if per_hit else self.cumulative_once
        if to_evict <= 0 or not cumulative:
            return 0.0
        if to_evict >= len(cumulative):
            return (self.per_block if per_hit else self.per_block_once) * to_evict
        return cumulative[to_evict - 1]


class Fit:
    """A LatencyFit's T(n, ctx) as compiled code: the router prices a prefill or a decode
    step several times a decision, and the fit's own call runs in the interpreter. The
    same terms summed in the same order, so the same doubles."""

    def __init__(self, fit: LatencyFit):
        self.a, self.b, self.c, self.d, self.e = float(fit.a), float(fit.b), float(fit.c), float(fit.d), float(fit.e)

    def at(self, n: float, ctx: float) -> float:
        return self.a + self.b * n + self.c * ctx + self.d * n * ctx + self.e * n * n


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    kv_blocks_total: int
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    in_flight: dict[str, Placement] = field(default_factory=dict)
    window: deque[Placement] = field(default_factory=deque)  # placed in the load window, oldest first
    window_prefill_s: float = 0.0
    expected_output_sum: int = 0  # over in_flight
    prompt_tokens_sum: int = 0  # over in_flight
    new_blocks_sum: int = 0  # over in_flight: the blocks each allocates beyond its held prefix
    decode_work_s: float = 0.0  # of in_flight, kept current by ClusterState
    prefill_free_at: float = 0.0  # when the prefills queued here will be done
    idle_since: float = -math.inf  # when its last request in flight finished (-inf: none yet)
    blocks_since_report: int = 0  # blocks placements took since the last load report

    @property
    def free_blocks(self) -> int:
        """Blocks neither in use nor caching a prefix, as far as the router knows."""
        unnamed = self.kv_blocks_total - self.kv_blocks_used - self.kv_blocks_cached
        return max(0, unnamed - self.blocks_since_report)


class ClusterState:
    def __init__(self, block_size: int, cost: CostModel, window_s: float = 180.0,
                 index_ttl_s: float | None = None, store: StorePricing | None = None,
                 prefill_chunk_tokens: int = 0):
        """`store`: how fetching from the cluster's KV store is priced; None without a store.
        `prefill_chunk_tokens`: the engines' per-step token budget, in which a longer
        prefill runs in chunks and is priced so (0: as one step)."""
        self.block_size = block_size
        self.cost = cost
        self.prefill_fit, self.decode_fit = Fit(cost.prefill), Fit(cost.decode)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.store = store
        self.window_s = window_s
        self.index = PrefixIndex(block_size, window_s, index_ttl_s)
        self.workers: dict[str, WorkerState] = {}
        self.worker_ids: list[str] = []  # sorted, for reproducible tie-breaks
        self.current_loads: dict[str, float] = {}  # load_s of each worker, kept current
        self.free_blocks: dict[str, int] = {}  # each worker's free_blocks, kept current
        # current_loads and free_blocks again as lists by worker slot (its place in
        # self.workers): a decision reads them whole, 64 items in a row where 64 dict entries,
        # scattered by the events between decisions, are 200 cache misses. Lists, not arrays:
        # compiled code reads a list's float or int in place, where an array item is a generic
        # call that makes a new object per read (docs/router.md §8.3).
        self.slots: dict[str, int] = {}
        self.slot_ids: list[str] = []
        self.loads_by_slot: list[float] = []
        self.free_by_slot: list[int] = []
        self.rank_by_slot: list[int] = []
        self.zeros_by_slot: list[float] = []
        # By slot too: each worker's window_prefill_s and its window's first placed_at (inf
        # when empty), for prefill_utilization; its requests in flight and their prompt
        # tokens (len(in_flight), prompt_tokens_sum), for cost_aware.
        self.window_prefill: list[float] = []
        self.window_starts: list[float] = []
        self.batch_by_slot: list[int] = []
        self.context_by_slot: list[int] = []
        self.idle_by_slot: list[float] = []  # idle_since by slot, for cost_aware's wake price
        self.prefill_free_by_slot: list[float] = []  # prefill_free_at by slot, for cost_aware's queue term
        self.loads_expired_at = -float("inf")
        self.placements: dict[str, Placement] = {}
        self.recent_outputs: deque[int] = deque(maxlen=RECENT_OUTPUTS)
        self.sorted_outputs: list[int] = []  # recent_outputs, sorted, for the median
        self.censored_median = 0  # censored_expected_output's median before the cap, made at censored_at
        self.censored_at = -math.inf
        # Per worker, its LRU as last sampled; valid while the worker is not in
        # index.changed and the hit window's half has not moved on from sample_epoch.
        self.eviction_samples: dict[str, EvictionSample] = {}
        self.sample_epoch: int | None = None
        fit = cost.prefill  # recompute_s(block_size, depth × block_size), as base + slope × depth
        self.block_recompute = (fit.b * block_size, (fit.c + fit.d * block_size) * block_size)
        # Per store tier, the seconds one block adds to a fetch (the latency is the fetch's, not the block's).
        self.block_fetch = tuple(store.bytes_per_block / link.bandwidth_bytes_s for link in store.tiers) \
            if store is not None else ()

    @property
    def approximate(self) -> bool:
        return self.index.ttl_s is not None

    # ---- membership and reports --------------------------------------------------------

    def _reslot(self) -> None:
        """Rebuild the lists by slot after a worker joined or left."""
        self.slot_ids = list(self.workers)
        self.slots = {worker_id: slot for slot, worker_id in enumerate(self.slot_ids)}
        self.loads_by_slot = [self.current_loads[w] for w in self.slot_ids]
        self.free_by_slot = [self.free_blocks[w] for w in self.slot_ids]
        self.window_prefill = [self.workers[w].window_prefill_s for w in self.slot_ids]
        self.window_starts = [self._window_start(self.workers[w]) for w in self.slot_ids]
        self.batch_by_slot = [len(self.workers[w].in_flight) for w in self.slot_ids]
        self.context_by_slot = [self.workers[w].prompt_tokens_sum for w in self.slot_ids]
        self.idle_by_slot = [self.workers[w].idle_since for w in self.slot_ids]
        self.prefill_free_by_slot = [self.workers[w].prefill_free_at for w in self.slot_ids]
        self.rank_by_slot = [0] * len(self.slot_ids)  # each slot's place among the sorted ids, for ranking()
        self.zeros_by_slot = [0.0] * len(self.slot_ids)  # a ranking's `then` where there is no second key
        for rank, worker_id in enumerate(self.worker_ids):
            self.rank_by_slot[self.slots[worker_id]] = rank

    def _set_load(self, worker_id: str, load_s: float) -> None:
        self.current_loads[worker_id] = load_s
        self.loads_by_slot[self.slots[worker_id]] = load_s

    def _set_free(self, worker_id: str, free: int) -> None:
        self.free_blocks[worker_id] = free
        self.free_by_slot[self.slots[worker_id]] = free

    def add_worker(self, worker_id: str, kv_blocks_total: int) -> None:
        self.workers[worker_id] = WorkerState(worker_id, kv_blocks_total)
        self.worker_ids = sorted(self.workers)
        self.current_loads[worker_id] = 0.0
        self.free_blocks[worker_id] = kv_blocks_total
        self._reslot()

    def remove_worker(self, worker_id: str) -> list[Placement]:
        """Forget a worker and what it cached; returns the placements it still had."""
        worker = self.workers.pop(worker_id, None)
        self.worker_ids = sorted(self.workers)
        self.current_loads.pop(worker_id, None)
        self.free_blocks.pop(worker_id, None)
        self._reslot()
        self.index.drop_worker(worker_id)
        if worker is None:
            return []
        self.eviction_samples.pop(worker_id, None)
        for request_id in worker.in_flight:
            self.placements.pop(request_id, None)
        return list(worker.in_flight.values())

    def report(self, worker_id: str, running: int, waiting: int, kv_blocks_used: int,
               kv_blocks_cached: int) -> None:
        worker = self.workers[worker_id]
        worker.running, worker.waiting = running, waiting
        worker.kv_blocks_used, worker.kv_blocks_cached = kv_blocks_used, kv_blocks_cached
        worker.blocks_since_report = 0
        self._set_free(worker_id, worker.free_blocks)

    def kv_stored(self, worker_id: str, block_hashes: list[int], now: float) -> None:
        if worker_id in self.workers and not self.approximate:
            self.index.stored(worker_id, block_hashes, now)

    def kv_removed(self, worker_id: str, block_hashes: list[int]) -> None:
        if worker_id in self.workers and not self.approximate:
            self.index.removed(worker_id, block_hashes)

    def store_stored(self, block_hashes: list[int], tiers: list[int]) -> None:
        """The KV store holds these blocks now (stored, or moved to `tiers`)."""
        self.index.store_stored(block_hashes, tiers)

    def store_evicted(self, block_hashes: list[int]) -> None:
        self.index.store_evicted(block_hashes)

    # ---- requests ----------------------------------------------------------------------

    def prepare(self, request_id: str, root_hash: int, token_ids: np.ndarray, max_tokens: int,
                now: float, slo_class: str = "") -> Request:
        """Match the prompt against the index once; policies and admission read the result.
        The request keeps a copy of the prompt's bytes (its block keys), so the caller may
        reuse `token_ids`."""
        if self.approximate:
            self.index.expire(now)
        keys = self.index.block_keys(np.ascontiguousarray(token_ids, dtype="<u4"))
        path = self.index.walk(root_hash, keys)
        return Request(request_id, root_hash, keys, len(token_ids), max_tokens, slo_class, path,
                       self.index.match(path), self.block_size)

    def store_hint(self, request: Request, worker_id: str) -> tuple[int, list[int] | None]:
        """What `worker_id`, sent `request`, is told of the KV store (Generate.store_from and
        store_tiers): how many of the prompt's blocks it holds, and the tiers of the run of
        blocks the store holds right after them (the store lacks the block after the run).
        (0, None) without a store the engines fetch from. Costs the run's length: nothing
        for a prompt the store lacks."""
        if self.store is None:
            return 0, None
        held = request.matched.get(worker_id, 0)
        tiers = self.index.store_tiers
        path = request.path
        run: list[int] = []
        for depth in range(held, len(path)):
            tier = tiers.get(path[depth].block_hash)
            if tier is None:
                break
            run.append(tier)
        return held, run

    def place(self, request: Request, worker_id: str, now: float) -> Placement:
        """Record that `request` goes to `worker_id`."""
        worker = self.workers[worker_id]
        held = request.matched.get(worker_id, 0)
        prefill_s = self.held_prefill_s(request, held)
        start = max(now, worker.prefill_free_at)
        queued_s = self.expected_prefill_s(request, held, prefill_s, self.cache_survival(worker_id))
        self.set_prefill_free_at(worker_id, start + self._queued_prefill_s(worker, queued_s))
        placement = Placement(request.request_id, worker_id, now, prefill_s, self.expected_output(request),
                              request.num_tokens, request.prefix_key, worker.prefill_free_at - now,
                              new_blocks=request.blocks_needed(worker_id))
        self._expire_window(worker, now)
        worker.window.append(placement)
        worker.window_prefill_s += prefill_s
        self._note_window(worker)
        worker.in_flight[request.request_id] = placement
        worker.expected_output_sum += placement.expected_output
        worker.prompt_tokens_sum += request.num_tokens
        worker.new_blocks_sum += placement.new_blocks
        self._update_decode_work(worker)
        worker.blocks_since_report += placement.new_blocks
        self._set_free(worker_id, worker.free_blocks)
        self.placements[request.request_id] = placement
        self.index.record_hits(request.path[:held], worker_id, now)
        if self.approximate:
            self.index.placed(worker_id, request.root_hash, request.block_keys, request.path, now)
        else:
            placement.credited = self.index.expect(worker_id, request.root_hash, request.block_keys,
                                                   request.path, held, now)
        return placement

    def resume(self, request_id: str, worker_id: str, num_tokens: int, expected_output: int,
               now: float) -> Placement:
        """Record a request a rejoining worker is already serving (its prompt is past
        prefill, its blocks come with the worker's cache report): it counts towards the
        worker's decode load until it finishes."""
        worker = self.workers[worker_id]
        placement = Placement(request_id, worker_id, now, 0.0, expected_output, num_tokens, None, 0.0)
        worker.in_flight[request_id] = placement
        worker.expected_output_sum += expected_output
        worker.prompt_tokens_sum += num_tokens
        self._update_decode_work(worker)
        self.placements[request_id] = placement
        return placement

    def finish(self, request_id: str, output_tokens: int | None = None, now: float | None = None) -> Placement | None:
        """The worker ended the request; returns its placement if the router had one.
        `now` (when the router learned it) starts the worker's idle time if it was the last
        request in flight there."""
        placement = self.placements.pop(request_id, None)
        if placement is None:
            return None
        if placement.credited is not None:
            self.index.settle(placement.credited)
        worker = self.workers.get(placement.worker_id)
        if worker is not None and worker.in_flight.pop(request_id, None) is not None:
            worker.expected_output_sum -= placement.expected_output
            worker.prompt_tokens_sum -= placement.num_tokens
            worker.new_blocks_sum -= placement.new_blocks
            self._update_decode_work(worker)
            if now is not None and not worker.in_flight:
                worker.idle_since = self.idle_by_slot[self.slots[worker.worker_id]] = now
        if output_tokens:
            self._note_output(output_tokens)
        return placement

    # ---- what policies read ------------------------------------------------------------

    def expected_output(self, request: Request) -> int:
        """The median output of recent requests, capped by this one's max_tokens."""
        if not self.sorted_outputs:
            return request.max_tokens
        return max(1, min(request.max_tokens, self.sorted_outputs[len(self.sorted_outputs) // 2]))

    def censored_expected_output(self, request: Request, now: float) -> int:
        """expected_output, but until RECENT_OUTPUTS requests have finished, the median is
        Kaplan-Meier's over them and the requests in flight, each censored at the tokens it
        is estimated to have made by `now`: the first requests to finish are the short
        ones, so their median alone runs low (docs/router.md §4.7). The median is made
        again at most every CENSORED_REFRESH_S, since it reads every request in flight."""
        finished = self.sorted_outputs
        if not finished or len(finished) >= RECENT_OUTPUTS:
            return self.expected_output(request)
        if not 0.0 <= now - self.censored_at < CENSORED_REFRESH_S:
            self.censored_median = kaplan_meier_median(finished, self._outputs_so_far(now))
            self.censored_at = now
        return max(1, min(request.max_tokens, self.censored_median))

    def _outputs_so_far(self, now: float) -> list[int]:
        """Sorted, the tokens each request in flight is estimated to have made by `now`:
        from the end of its predicted queue and prefill, at its worker's step time."""
        made: list[int] = []
        for worker in self.workers.values():
            batch = len(worker.in_flight)
            if not batch:
                continue
            step_s = self.decode_fit.at(batch, worker.prompt_tokens_sum / batch)  # cost.decode_step_s
            for placement in worker.in_flight.values():
                decoding_s = now - placement.placed_at - placement.predicted_ttft_s
                made.append(int(decoding_s / step_s) if decoding_s > 0.0 else 0)
        made.sort()
        return made

    def load_s(self, worker_id: str, now: float) -> float:
        """Windowed prefill seconds plus the decode seconds its requests still need."""
        worker = self.workers[worker_id]
        self._expire_window(worker, now)
        return worker.window_prefill_s + worker.decode_work_s

    def exact_loads(self, now: float) -> list[float]:
        """load_s(w, now) of every worker, by slot (read-only): every window expired at
        `now`, where loads() lets the oldest placements go at most once a window/180."""
        for worker in self.workers.values():
            self._expire_window(worker, now)
        return self.loads_by_slot

    def loads(self, now: float) -> dict[str, float]:
        """load_s of every worker (read-only). Placements and finishes keep it current;
        the window's oldest placements are let go at most once a window/180 (1 s of 3 min)."""
        if now - self.loads_expired_at >= self.window_s / 180:
            self.loads_expired_at = now
            horizon = now - self.window_s
            for worker in self.workers.values():
                if worker.window and worker.window[0].placed_at < horizon:
                    self._expire_window(worker, now)
        return self.current_loads

    def explore_costs(self, request: Request, now: float) -> dict[str, float]:
        """Preble's C = L + M + P of placing `request` on each worker.

        This runs on every explore decision for every worker, so it is written for
        speed: the workers that hold none of the prompt share one prefill time, holders
        that hold the same number of blocks share another, and M is priced only where
        the prompt needs more blocks than the worker has free."""
        costs, evicting = self._explore_costs_before_eviction(request, now)
        slot_ids = self.slot_ids
        for slot in evicting:
            costs[slot] += self.eviction_cost_s(request, slot_ids[slot], now)
        return dict(zip(slot_ids, costs))

    def explore_order(self, request: Request, now: float) -> Ranking:
        """Every worker id by ascending explore_costs, ties by id, M priced only for the
        workers the order reaches (L + P bounds C from below)."""
        costs, evicting = self._explore_costs_before_eviction(request, now)
        slot_ids = self.slot_ids

        def price(slot: int) -> float:
            return costs[slot] + self.eviction_cost_s(request, slot_ids[slot], now)

        return self.ranking(costs, self.zeros_by_slot, evicting, price)

    def load_order(self, now: float, lead: str | None = None) -> Ranking:
        """Every worker id by ascending loads(now), ties by id, but `lead` (if given) first:
        ranked as it is read, so a caller that takes the first worker pays no sort of a
        thousand workers."""
        self.loads(now)
        loads = self.loads_by_slot
        return Ranking(self.worker_ids, self.rank_by_slot, loads, self.zeros_by_slot, (), float,
                       self.slots[lead] if lead is not None else -1)

    def held_by_slot(self, request: Request) -> list[float]:
        """Minus the blocks of the prompt each worker holds (request.matched), by slot: the
        longest match first when ranked ascending."""
        held = [0.0] * len(self.slot_ids)
        slots = self.slots
        for worker_id, blocks in request.matched.items():
            slot = slots.get(worker_id)
            if slot is not None:
                held[slot] = -float(blocks)
        return held

    def ranking(self, costs: Sequence[float], then: Sequence[float], pending: Iterable[int] = (),
                price: Callable[[int], float] = float) -> Ranking:
        """The worker ids by ascending (exact cost, then, id) as a Ranking: `costs` and `then`
        by slot, the costs lower bounds where `pending`, which price(slot) makes exact when
        the order reaches them."""
        return Ranking(self.worker_ids, self.rank_by_slot, costs, then, pending, price)

    def _explore_costs_before_eviction(self, request: Request, now: float) -> tuple[list[float], list[int]]:
        """By slot (in self.workers' order), explore_costs' L + P, and the slots where M is
        priced (the prompt needs more blocks than the worker has free)."""
        self.loads(now)
        loads = self.loads_by_slot
        cold_prefill_s = self.held_prefill_s(request, 0)
        costs = [load + cold_prefill_s for load in loads]
        slots = self.slots
        prefill_by_held: dict[int, float] = {}
        for worker_id, held in request.matched.items():
            slot = slots.get(worker_id)
            if slot is not None:
                prefill_s = prefill_by_held.get(held)
                if prefill_s is None:
                    prefill_s = prefill_by_held[held] = self.held_prefill_s(request, held)
                costs[slot] = loads[slot] + prefill_s
        blocks = -(-request.num_tokens // self.block_size)
        return costs, [slot for slot, free in enumerate(self.free_by_slot) if free < blocks]

    def _update_decode_work(self, worker: WorkerState) -> None:
        """Σ over requests in flight of expected output × the batch's TPOT (docs/router.md §3).
        Called on every change of the worker's requests in flight: it copies their count
        and prompt tokens where the lists by slot keep them."""
        batch = len(worker.in_flight)
        slot = self.slots[worker.worker_id]
        self.batch_by_slot[slot] = batch
        self.context_by_slot[slot] = worker.prompt_tokens_sum
        worker.decode_work_s = worker.expected_output_sum * self.decode_fit.at(
            batch, worker.prompt_tokens_sum / batch) if batch else 0.0  # cost.decode_step_s
        self._set_load(worker.worker_id, worker.window_prefill_s + worker.decode_work_s)

    def _note_output(self, output_tokens: int) -> None:
        if len(self.recent_outputs) == self.recent_outputs.maxlen:
            del self.sorted_outputs[bisect.bisect_left(self.sorted_outputs, self.recent_outputs[0])]
        self.recent_outputs.append(output_tokens)
        bisect.insort(self.sorted_outputs, output_tokens)

    def prefill_s(self, request: Request, worker_id: str) -> float:
        """P: the time to prefill what the worker does not hold of the prompt."""
        return self.held_prefill_s(request, request.matched.get(worker_id, 0))

    def held_prefill_s(self, request: Request, held: int) -> float:
        """The time to prefill the prompt on a worker holding its first `held` blocks.

        With the KV store, the blocks it holds after those are priced as the cheaper of
        fetching them (StorePricing.fetch_s) and computing them (docs/router.md §7): the
        store is as close to every worker, so it lowers every worker's time alike."""
        num_tokens = request.num_tokens
        cached = max(0, min(held * self.block_size, num_tokens - 1))
        compute_s = self.chunked_prefill_s(num_tokens - cached, cached)
        if self.store is None or not self.index.store_tiers:
            return compute_s
        run = self.index.store_run(request.path, held)
        if not run:
            return compute_s
        fetched = max(0, min((held + sum(run)) * self.block_size, num_tokens - 1))
        if fetched <= cached:
            return compute_s
        fetch_s = self.store.fetch_s(run) + self.chunked_prefill_s(num_tokens - fetched, fetched)
        return fetch_s if self.store.always_fetch else min(compute_s, fetch_s)

    def chunked_prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """The prefill of `new_tokens` after `cached_tokens` as the engines run it: in
        chunks of prefill_chunk_tokens, each a step of its own that attends to everything
        before it. The fit's one-step price of a long prefill leaves that out: 36k tokens
        in 8,192-token chunks take 8.70 s on a6000/mistral-7b, where one step would take
        5.66 s (docs/router.md §3)."""
        chunk = self.prefill_chunk_tokens
        if new_tokens <= 0:  # as cost.prefill_s, which this computes by prefill_fit
            return 0.0
        if not chunk or new_tokens <= chunk:
            return self.prefill_fit.at(new_tokens, cached_tokens)
        total_s, start, end = 0.0, cached_tokens, cached_tokens + new_tokens
        while start < end:
            size = min(chunk, end - start)
            total_s += self.prefill_fit.at(size, start)
            start += size
        return total_s

    def store_share(self, request: Request) -> float:
        """The share of the prompt's cold prefill time that its best holder saves over a
        worker that holds none of it but fetches what the store holds (1 - the ratio of
        their times). With no store, or a store without the prompt's first block: the
        share of the prompt's tokens the best holder holds."""
        token_share = request.best_cached_tokens / max(request.num_tokens, 1)
        path = request.path
        if self.store is None or not path or path[0].block_hash not in self.index.store_tiers:
            return token_share
        cold_s = self.chunked_prefill_s(request.num_tokens, 0)
        saved_s = self.held_prefill_s(request, 0) - self.held_prefill_s(request, request.best_blocks)
        return max(0.0, saved_s) / cold_s if cold_s > 0 else token_share

    def prefill_utilization(self, now: float) -> float:
        """The share of the workers' time that the prefills placed in the load window take
        (their predicted seconds over the window's span, shorter while the first window
        fills), below 1."""
        busy_s = 0.0
        for prefill_s in self.window_prefill:  # summed in the workers' order
            busy_s += prefill_s
        start = now
        for window_start in self.window_starts:
            if window_start < start:
                start = window_start
        span_s = max(1.0, min(self.window_s, now - start)) * max(1, len(self.workers))
        return min(MAX_UTILIZATION, busy_s / span_s)

    def _queued_prefill_s(self, worker: WorkerState, prefill_s: float) -> float:
        """What a prefill adds to the worker's queue. Beside sequences in flight it joins a
        step that pays the fit's fixed cost anyway (chunked prefill batches it with their
        decodes and the prefills queued before it), so it adds its marginal time only."""
        if worker.in_flight and prefill_s > 0.0:
            return max(0.0, prefill_s - self.cost.prefill.a)
        return prefill_s

    def cache_survival(self, worker_id: str) -> float:
        """The share of the worker's cached prefixes expected to outlive the requests
        queued there: an engine matches a waiting request's prefix only when it schedules
        it, so what the requests ahead allocate first may evict it (docs/router.md §3).

        The requests waiting at its last report allocate about `waiting` × the mean new
        blocks of its requests in flight; what the free blocks cannot take is evicted
        from the cached ones, least recent first, and a prefix's place in that order is
        unknown here, so the share evicted is the share of the cached blocks that goes."""
        worker = self.workers[worker_id]
        if not worker.waiting or not worker.in_flight:
            return 1.0
        short = worker.waiting * worker.new_blocks_sum / len(worker.in_flight) - worker.free_blocks
        if short <= 0:
            return 1.0
        cached = worker.kv_blocks_cached
        return 1.0 - short / cached if short < cached else 0.0

    def expected_prefill_s(self, request: Request, held: int, held_prefill_s: float, survival: float) -> float:
        """The prefill a worker holding `held` blocks (prefilled in `held_prefill_s` while
        they last) is expected to run when its held prefix survives with `survival`."""
        if survival >= 1.0 or not held:
            return held_prefill_s
        return survival * held_prefill_s + (1.0 - survival) * self.held_prefill_s(request, 0)

    def queue_s(self, worker_id: str, now: float) -> float:
        """How long a new prefill would wait behind those placed there already."""
        wait = self.workers[worker_id].prefill_free_at - now
        return wait if wait > 0.0 else 0.0

    def set_prefill_free_at(self, worker_id: str, free_at: float) -> None:
        """The queue model: the prefills placed on the worker are done at `free_at`."""
        self.workers[worker_id].prefill_free_at = self.prefill_free_by_slot[self.slots[worker_id]] = free_at

    def tpot_s(self, request: Request, worker_id: str) -> float:
        """The decode step time of the batch this request would join."""
        worker = self.workers[worker_id]
        batch = len(worker.in_flight) + 1
        return self.decode_fit.at(batch, (worker.prompt_tokens_sum + request.num_tokens) / batch)  # cost.decode_step_s

    def eviction_cost_s(self, request: Request, worker_id: str, now: float, per_hit: bool = True) -> float:
        """M: recompute seconds that placing the request would cause, weighted by how often
        the evicted blocks were hit in the window (LRU blocks go first, as in the engine).
        With per_hit False, an evicted block that was hit at all costs one recompute: its
        next use computes it again, and it is cached from then on (docs/router.md §4.7).

        A block the KV store holds costs the cheaper of its recompute and its fetch
        (docs/router.md §7); store events alone do not renew a kept sample.
        Reads at most EVICTION_SAMPLE LRU blocks and extrapolates. The sample is kept per
        worker until its LRU changes or the hit window moves on, except on workers that
        hold part of the prompt: the request pins those blocks, so they are skipped."""
        to_evict = request.blocks_needed(worker_id) - self.free_blocks[worker_id]
        if to_evict <= 0:
            return 0.0
        held = request.matched.get(worker_id, 0)
        samples = self._current_samples(now)
        sample = samples.get(worker_id)
        if sample is None or worker_id in self.index.changed:
            sample = self._sample_lru(worker_id, now)
        if request.pins(sample, held):
            sample = self._lru_costs(worker_id, now, request.path[:held])
        return sample.cost(to_evict, per_hit)

    def _current_samples(self, now: float) -> dict[str, EvictionSample]:
        """The kept samples, dropped whole when the hit window's half moves on."""
        epoch = int(now / self.index.half_window_s)
        if epoch != self.sample_epoch:
            self.eviction_samples.clear()
            self.sample_epoch = epoch
        return self.eviction_samples

    def _sample_lru(self, worker_id: str, now: float) -> EvictionSample:
        self.index.changed.discard(worker_id)
        sample = self.eviction_samples[worker_id] = self._lru_costs(worker_id, now, [])
        return sample

    def _lru_costs(self, worker_id: str, now: float, pinned: list[BlockNode]) -> EvictionSample:
        """The sample of the worker's LRU blocks, oldest first, leaving out `pinned` (a
        prompt's leading blocks: node i of it has depth i)."""
        cumulative: list[float] = []
        cumulative_once: list[float] = []
        depths: list[int] = []
        nodes: list[BlockNode] = []
        total = total_once = 0.0
        base, slope = self.block_recompute
        fetch = self.block_fetch
        always = self.store is not None and self.store.always_fetch
        store_tiers = self.index.store_tiers
        num_pinned = len(pinned)
        self.index.flush_hits()  # once, then PrefixIndex.hits' count per block without its checks
        current = int(now / self.index.half_window_s)
        for node in self.index.lru_blocks(worker_id):
            if len(nodes) == EVICTION_SAMPLE:
                break
            depth = node.depth
            if 0 <= depth < num_pinned and pinned[depth] is node:
                continue
            node_hits = window_hits(node, current)
            if node_hits:
                block_s = base + slope * max(depth, 0)
                tier = store_tiers.get(node.block_hash) if fetch else None
                if tier is not None:  # the store holds it: getting it back costs a fetch
                    block_s = fetch[tier] if always else min(block_s, fetch[tier])
                total += node_hits * block_s
                total_once += block_s
            cumulative.append(total)
            cumulative_once.append(total_once)
            depths.append(depth)
            nodes.append(node)
        return EvictionSample(cumulative, cumulative_once, depths, nodes)

    def in_window(self, worker_id: str, now: float) -> deque[Placement]:
        worker = self.workers[worker_id]
        self._expire_window(worker, now)
        return worker.window

    def _expire_window(self, worker: WorkerState, now: float) -> None:
        horizon = now - self.window_s
        window = worker.window
        expired = bool(window) and window[0].placed_at < horizon
        while window and window[0].placed_at < horizon:
            worker.window_prefill_s -= window.popleft().prefill_s
        if not window:
            worker.window_prefill_s = 0.0  # no float drift accumulates across windows
        if expired:
            self._note_window(worker)
        self._set_load(worker.worker_id, worker.window_prefill_s + worker.decode_work_s)

    def _note_window(self, worker: WorkerState) -> None:
        """Copy the worker's window sum and start where prefill_utilization reads them."""
        slot = self.slots[worker.worker_id]
        self.window_prefill[slot] = worker.window_prefill_s
        self.window_starts[slot] = self._window_start(worker)

    @staticmethod
    def _window_start(worker: WorkerState) -> float:
        return worker.window[0].placed_at if worker.window else math.inf


def kaplan_meier_median(finished: list[int], censored: list[int]) -> int:
    """The median of a length whose `finished` values were seen whole and whose `censored`
    ones only as lower bounds (both sorted): Kaplan-Meier's survival S(t) = Π (1 − d/r) over
    the finished values t ≤ it (d finished at t, r at risk: finished or censored at ≥ t),
    first at or below a half. Where it never gets there, the largest value seen."""
    survival = 1.0
    start = 0
    while start < len(finished):
        value = finished[start]
        stop = bisect.bisect_right(finished, value, start)
        at_risk = len(finished) - start + len(censored) - bisect.bisect_left(censored, value)
        survival *= 1.0 - (stop - start) / at_risk
        if survival <= 0.5:
            return value
        start = stop
    return max(finished[-1] if finished else 0, censored[-1] if censored else 0)
