"""Benchmark the router's placement path alone, per policy, in one single-threaded process.

Measured per decision (time.perf_counter_ns, the prompt's uint32 token array built before):
cluster.prepare (hashing and index match) + policy.choose + admission.decide +
cluster.place, with the router's default admission (no SLO classes, queue bounds only).
Nothing else of the router runs: no sockets, no tokenizer.

Workload (the same for every policy, from --seed): prompts of --prompt-tokens tokens, each
a shared prefix of one of --families families (a random length between 25% and 90% of the
prompt; families drawn with Zipf popularity, s = 1) followed by a unique random suffix.
Time is virtual, --rate decisions per second. The workers are simulated the way the live
router hears them in events mode: KV stored events for the blocks each placement computes,
removed events for a worker's least recently used blocks when it stores more than
--kv-blocks, and every HEARTBEAT_S a load report per worker that also finishes its oldest
requests beyond --in-flight. Each policy gets a fresh ClusterState and first places
--warmup requests (more while the index holds fewer than --min-index-blocks blocks), so
its cache contents are its own placements'; then --decisions decisions are timed.
With --store the cluster state prices the KV store (docs/router.md §7) and a simulated store
takes every block a worker evicts into its DRAM tier (stored events), up to --store-blocks,
dropping its oldest (evicted events); the store's events, like the workers', are applied
outside the timed span.

A placement holds the prompt's blocks on credit until the worker's events confirm them
(docs/router.md §2), and the index names a credit only when something could see it: here
the stored events that follow each placement. So the workers' events are timed apart
(events_ms: their mean per decision), and the results also give the requests finished, the
blocks still on credit at the end, the index's size when timing started and ended, and a
digest of every decision (warm-up included) that changes iff some placement does.
Beside the wall time, each decision's thread CPU time is read (outside the wall span):
cpu_ms and cpu_p99_ms leave out the time slices other processes take on a shared machine.

    PYTHONPATH=. .venv/bin/python scripts/bench_router.py --json
    PYTHONPATH=. .venv/bin/python scripts/bench_router.py --policies e2 --decisions 10000
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
from tqdm import tqdm

from common.cost_model import CostModel, StorePricing, load_cost_model
from common.hashing import chain_hashes, root_hash
from services.router.admission import AdmissionConfig, AdmissionControl
from services.router.cluster import ClusterState, Request
from services.router.main import quiet_gc
from services.router.native import compiled
from services.router.policies import POLICIES, PlacementPolicy, make_policy

BLOCK_SIZE = 16
VOCAB_SIZE = 32000
NUM_SPECIAL_IDS = 4  # ids 0..3 are never drawn
PREFIX_SHARE = (0.25, 0.90)  # a family's prefix, as a share of the prompt
ZIPF_S = 1.0
MAX_TOKENS = 512
HEARTBEAT_S = 0.5  # each worker's load report interval, as in the default cluster config
TARGET_DECISIONS_PER_S, TARGET_P99_MS = 10_000.0, 1.0  # issue 21
TARGET_POLICIES = ("e2", "cost_aware")  # Preble's, and the default-to-be
WARMUP_LIMIT_FACTOR = 10  # give up when the index stays small after this many × --warmup


# ---------------------------------------------------------------------- set-up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--families", type=int, default=48, help="shared-prefix families")
    parser.add_argument("--warmup", type=int, default=1500, help="untimed decisions first, per policy")
    parser.add_argument("--decisions", type=int, default=3000, help="timed decisions per policy")
    parser.add_argument("--min-index-blocks", type=int, default=100_000,
                        help="warm up until the prefix index holds at least this many blocks")
    parser.add_argument("--kv-blocks", type=int, default=20_000, help="KV blocks per worker")
    # Not 32: admission's queued-token bound (262,144) counts running prompts too, so 32
    # in flight × 8,192 tokens fills every worker and most requests would be refused.
    parser.add_argument("--in-flight", type=int, default=24,
                        help="requests per worker a heartbeat leaves unfinished")
    parser.add_argument("--rate", type=float, default=1000.0, help="decisions per virtual second")
    parser.add_argument("--profile", default="", help="JSON cost profile ('' = the built-in one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy names")
    parser.add_argument("--store", action="store_true",
                        help="price the KV store; a simulated store keeps the blocks workers evict")
    parser.add_argument("--store-blocks", type=int, default=1_000_000, help="blocks the simulated store holds")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    args.policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in args.policies if name not in POLICIES]
    if unknown or not args.policies:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    for name in ("workers", "prompt_tokens", "families", "decisions", "kv_blocks", "in_flight"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.rate <= 0:
        parser.error("--warmup must be >= 0 and --rate > 0")
    if args.prompt_tokens < 4 * BLOCK_SIZE:
        parser.error(f"--prompt-tokens must be >= {4 * BLOCK_SIZE}")
    if args.min_index_blocks > args.workers * args.kv_blocks:
        parser.error("--min-index-blocks exceeds what the workers can hold (--workers × --kv-blocks)")
    return args


@dataclass(frozen=True)
class Family:
    tokens: np.ndarray  # the shared prefix
    hashes: list[int]  # chain hashes of its full blocks


@dataclass(frozen=True)
class Prompt:
    tokens: np.ndarray  # uint32
    hashes: list[int]  # chain hashes of every full block, as the worker's KV events name them


class Workload:
    """The request stream: request i is the same prompt whichever policy places it."""

    def __init__(self, args: argparse.Namespace):
        self.seed = args.seed
        self.prompt_tokens = args.prompt_tokens
        self.root = root_hash("bench-model", "bench-tokenizer", "", "bfloat16", BLOCK_SIZE)
        rng = np.random.default_rng([args.seed, 0])
        low, high = (int(share * args.prompt_tokens) for share in PREFIX_SHARE)
        self.families = [self._family(rng, int(rng.integers(low, high + 1))) for _ in range(args.families)]
        weights = 1.0 / np.arange(1, args.families + 1) ** ZIPF_S
        self.popularity = np.cumsum(weights / weights.sum())
        self.suffix_hashes: dict[int, list[int]] = {}  # hashing is slow; policies share it

    def _family(self, rng: np.random.Generator, length: int) -> Family:
        tokens = rng.integers(NUM_SPECIAL_IDS, VOCAB_SIZE, length, dtype=np.uint32)
        full = length - length % BLOCK_SIZE
        return Family(tokens, chain_hashes(self.root, tokens[:full], BLOCK_SIZE))

    def prompt(self, i: int) -> Prompt:
        rng = np.random.default_rng([self.seed, 1, i])
        family = self.families[min(int(np.searchsorted(self.popularity, rng.random())), len(self.families) - 1)]
        suffix = rng.integers(NUM_SPECIAL_IDS, VOCAB_SIZE, self.prompt_tokens - len(family.tokens),
                              dtype=np.uint32)
        tokens = np.concatenate([family.tokens, suffix])
        if i not in self.suffix_hashes:
            start = len(family.hashes) * BLOCK_SIZE
            parent = family.hashes[-1] if family.hashes else self.root
            self.suffix_hashes[i] = chain_hashes(parent, tokens[start:], BLOCK_SIZE)
        return Prompt(tokens, family.hashes + self.suffix_hashes[i])


class Workers:
    """The workers as the router hears them in events mode: a stored event for the blocks
    each placement computes, removed events for a worker's least recently used blocks once
    it holds more than `kv_blocks`, and every HEARTBEAT_S a load report per worker, with its
    oldest requests beyond `in_flight` finished.

    Each worker's LRU is its own, as in the engine's block manager: a prompt's blocks are
    touched tail first, so a prefix outlives the suffixes that extend it."""

    def __init__(self, cluster: ClusterState, policy: PlacementPolicy, args: argparse.Namespace):
        self.cluster = cluster
        self.policy = policy
        self.kv_blocks = args.kv_blocks
        self.in_flight = args.in_flight
        self.prompt_blocks = -(-args.prompt_tokens // BLOCK_SIZE)
        self.ids = list(cluster.workers)
        self.lru: dict[str, OrderedDict[int, None]] = {worker_id: OrderedDict() for worker_id in self.ids}
        self.beats = 0
        self.removed = 0
        self.finished = 0
        self.event_ns = 0  # spent applying the workers' KV events to the cluster state
        self.random = random.Random(args.seed)
        self.store: OrderedDict[int, None] | None = OrderedDict() if args.store else None
        self.store_blocks = args.store_blocks

    def prefilled(self, request: Request, worker_id: str, hashes: list[int], now: float) -> None:
        lru = self.lru[worker_id]
        for block_hash in reversed(hashes):
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        start = time.perf_counter_ns()
        self.cluster.kv_stored(worker_id, hashes[request.matched.get(worker_id, 0):], now)
        self.event_ns += time.perf_counter_ns() - start
        excess = len(lru) - self.kv_blocks
        if excess > 0:
            victims = [lru.popitem(last=False)[0] for _ in range(excess)]
            start = time.perf_counter_ns()
            self.cluster.kv_removed(worker_id, victims)
            self.event_ns += time.perf_counter_ns() - start
            self.removed += excess
            if self.store is not None:
                self._write_back(victims)

    def _write_back(self, victims: list[int]) -> None:
        """The store keeps what the worker evicted, dropping its oldest blocks when full."""
        store = self.store
        assert store is not None
        new = [block_hash for block_hash in victims if block_hash not in store]
        for block_hash in new:
            store[block_hash] = None
        self.cluster.store_stored(new, [0] * len(new))
        excess = len(store) - self.store_blocks
        if excess > 0:
            self.cluster.store_evicted([store.popitem(last=False)[0] for _ in range(excess)])

    def heartbeats(self, now: float) -> None:
        """Every heartbeat due by `now`, the workers taking turns."""
        while self.beats < now * len(self.ids) / HEARTBEAT_S:
            self._beat(self.ids[self.beats % len(self.ids)], now)
            self.beats += 1

    def _beat(self, worker_id: str, now: float) -> None:
        state = self.cluster.workers[worker_id]
        done = list(islice(state.in_flight.values(), max(0, len(state.in_flight) - self.in_flight)))
        running = len(state.in_flight) - len(done)
        used = min(self.kv_blocks, running * self.prompt_blocks)
        cached = max(0, len(self.lru[worker_id]) - used)
        self.cluster.report(worker_id, running, 0, used, cached)
        for placement in done:
            self.cluster.finish(placement.request_id, self.random.randint(32, MAX_TOKENS))
            self.policy.finished(placement, placement.predicted_ttft_s, now)
            self.finished += 1


# ---------------------------------------------------------------------- measuring


@dataclass
class Timings:
    ns: list[int] = field(default_factory=list)
    cpu_ns: list[int] = field(default_factory=list)  # thread CPU time of the same spans
    matched: list[float] = field(default_factory=list)  # share of the prompt the chosen worker held
    best: list[float] = field(default_factory=list)  # share the best holder held
    refused: int = 0


class Bench:
    """One policy over a fresh ClusterState: warm-up, then timed decisions."""

    def __init__(self, name: str, workload: Workload, cost: CostModel, args: argparse.Namespace):
        self.workload = workload
        self.rate = args.rate
        store = StorePricing.for_model(cost, BLOCK_SIZE) if args.store else None
        self.cluster = ClusterState(BLOCK_SIZE, cost, store=store)
        for n in range(args.workers):
            self.cluster.add_worker(f"worker-{n:03d}", args.kv_blocks)
        self.policy = make_policy(name)
        self.admission = AdmissionControl(AdmissionConfig(), {})  # the router's default
        self.workers = Workers(self.cluster, self.policy, args)
        self.next = 0
        self.digest = hashlib.sha256()  # of every decision's worker id ("-": refused)

    def warm_up(self, decisions: int, min_index_blocks: int) -> None:
        """At least `decisions` decisions, then more until the index is big enough."""
        limit = WARMUP_LIMIT_FACTOR * max(decisions, 1000)
        sink = Timings()
        while self.next < decisions or len(self.cluster.index) < min_index_blocks:
            if self.next >= limit:
                raise RuntimeError(f"index stuck at {len(self.cluster.index)} blocks after "
                                   f"{self.next} warm-up decisions (want {min_index_blocks})")
            self.decide(sink)

    def measure(self, decisions: int) -> Timings:
        timings = Timings()
        for _ in range(decisions):
            self.decide(timings)
        return timings

    def decide(self, timings: Timings) -> None:
        """One placement; only the router's own work is inside the timed span."""
        i, self.next = self.next, self.next + 1
        now = i / self.rate
        self.workers.heartbeats(now)
        prompt = self.workload.prompt(i)
        request_id, root, cluster = f"r{i}", self.workload.root, self.cluster
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        request = cluster.prepare(request_id, root, prompt.tokens, MAX_TOKENS, now)
        verdict = self.admission.decide(request, self.policy.choose(request, cluster, now), cluster, now)
        if verdict.worker_id is not None:
            cluster.place(request, verdict.worker_id, now)
        timings.ns.append(time.perf_counter_ns() - start)
        timings.cpu_ns.append(time.thread_time_ns() - cpu_start)
        self.digest.update(f"{verdict.worker_id or '-'}\n".encode())
        if verdict.worker_id is None:
            timings.refused += 1
            return
        timings.matched.append(request.cached_tokens(verdict.worker_id) / request.num_tokens)
        timings.best.append(request.best_cached_tokens / request.num_tokens)
        self.workers.prefilled(request, verdict.worker_id, prompt.hashes, now)


def run_policy(name: str, workload: Workload, cost: CostModel, args: argparse.Namespace) -> dict:
    bench = Bench(name, workload, cost, args)
    bench.warm_up(args.warmup, args.min_index_blocks)
    index_start = len(bench.cluster.index)
    gc.collect()  # start the timed part with no collection owed by the warm-up
    event_ns = bench.workers.event_ns
    timings = bench.measure(args.decisions)
    return summarize(timings, bench, index_start, bench.workers.event_ns - event_ns)


def summarize(timings: Timings, bench: Bench, index_start: int, event_ns: int) -> dict:
    ns = np.array(timings.ns, dtype=np.int64)
    p50, p99 = np.percentile(ns, [50, 99]) / 1e6
    cpu_ns = np.array(timings.cpu_ns, dtype=np.int64)
    return {
        "decisions_per_s": float(len(ns) / (ns.sum() / 1e9)),
        "p50_ms": float(p50),
        "p99_ms": float(p99),
        "max_ms": float(ns.max() / 1e6),
        "mean_ms": float(ns.mean() / 1e6),
        "cpu_ms": float(cpu_ns.mean() / 1e6),
        "cpu_p99_ms": float(np.percentile(cpu_ns, 99) / 1e6),
        "events_ms": event_ns / len(ns) / 1e6,
        "decisions": len(ns),
        "warmup_decisions": bench.next - len(ns),
        "refused": timings.refused,
        "matched_fraction": float(np.mean(timings.matched)) if timings.matched else 0.0,
        "hit_rate": float(np.mean(np.array(timings.matched) > 0)) if timings.matched else 0.0,
        "best_matched_fraction": float(np.mean(timings.best)) if timings.best else 0.0,
        "index_blocks_start": index_start,
        "index_blocks": len(bench.cluster.index),
        "removed_blocks": bench.workers.removed,
        "finished": bench.workers.finished,
        "unconfirmed_blocks": sum(map(len, bench.cluster.index.unconfirmed.values())),
        "decisions_digest": bench.digest.hexdigest()[:16],
        "store_blocks": bench.cluster.index.store_blocks,
        "compiled": compiled(),
    }


# ---------------------------------------------------------------------- output


def print_table(args: argparse.Namespace, result: dict[str, dict], elapsed_s: float) -> None:
    store = f" store_blocks={args.store_blocks}" if args.store else ""
    print(f"workers={args.workers} prompt_tokens={args.prompt_tokens} families={args.families} "
          f"kv_blocks={args.kv_blocks}{store} in_flight={args.in_flight} rate={args.rate:g}/s "
          f"warmup>={args.warmup} decisions={args.decisions} seed={args.seed} ({elapsed_s:.1f} s); "
          f"router modules: {'compiled' if compiled() else 'source (no build of these sources)'}")
    print(f"{'policy':<12}{'decisions/s':>12}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'cpu ms':>8}{'events ms':>11}"
          f"{'matched':>9}{'hit':>7}{'best':>7}{'refused':>9}{'index start':>13}{'index end':>11}"
          f"{'removed':>10}{'finished':>10}{'on credit':>11}")
    for name, row in result.items():
        print(f"{name:<12}{row['decisions_per_s']:>12,.0f}{row['p50_ms']:>9.3f}{row['p99_ms']:>9.3f}"
              f"{row['max_ms']:>9.2f}{row['cpu_ms']:>8.3f}{row['events_ms']:>11.3f}{row['matched_fraction']:>9.1%}"
              f"{row['hit_rate']:>7.1%}{row['best_matched_fraction']:>7.1%}{row['refused']:>9,}"
              f"{row['index_blocks_start']:>13,}{row['index_blocks']:>11,}{row['removed_blocks']:>10,}"
              f"{row['finished']:>10,}{row['unconfirmed_blocks']:>11,}")
    print("cpu: mean thread CPU time per decision (the same span, without other processes' time slices); "
          "events: mean time per decision to apply the workers' KV events (untimed above); matched: "
          "mean share of the prompt the chosen worker held; hit: placements where it held any; "
          "best: share the best holder held; index: blocks in the prefix index when timing started "
          "and ended; removed: blocks evicted (removed events) over the run; finished: requests "
          "ended; on credit: blocks placed that no event confirmed yet, at the end")
    holds = {True: "holds", False: "MISSED"}
    for name in TARGET_POLICIES:
        row = result.get(name)
        if row is not None:
            print(f"{name} target >= {TARGET_DECISIONS_PER_S:,.0f} decisions/s: "
                  f"{holds[row['decisions_per_s'] >= TARGET_DECISIONS_PER_S]} ({row['decisions_per_s']:,.0f})")
            print(f"{name} target p99 <= {TARGET_P99_MS:g} ms: {holds[row['p99_ms'] <= TARGET_P99_MS]} "
                  f"({row['p99_ms']:.3f} ms)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cost = load_cost_model(args.profile)
    started = time.perf_counter()
    workload = Workload(args)
    result = {}
    previous = gc.get_threshold()
    quiet_gc()  # as the router process runs
    try:
        # disable=None: a bar on stderr when it is a terminal, nothing in logs and pipes.
        for name in tqdm(args.policies, desc="bench_router", unit="policy", disable=None):
            result[name] = run_policy(name, workload, cost, args)
            gc.collect()  # free this policy's index before the next one builds its own
    finally:
        gc.set_threshold(*previous)
    print_table(args, result, time.perf_counter() - started)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
