#!/usr/bin/env python3
"""How fast can a block-by-block simulation of the Mooncake trace be? A lower bound.

The simulator drives the live engine's BlockManager and the live router's PrefixIndex. The
index keeps its nodes per KV block (16 tokens); the block manager kept all its state per
block until it moved to runs (docs/engine.md §3), and the floor below is still that of a
per-block design of both. This script

1. simulates the trace (16 workers, h100/llama-3-70b, e2, --load) and counts the blocks
   each per-block operation handled: blocks the index named (hashed and linked, from a
   placement's credit), blocks it was told a worker holds (credit and KV event), blocks
   it was told a worker dropped; blocks the engines committed, evicted and released;
2. times, on this machine, the least Python work one block of each operation needs
   (the dictionary, list and object operations only: no scheduling, no matching, no
   policy), each over a million blocks with the cycle collector off, best of three;
3. prints their product: the seconds no per-block implementation of these two objects
   can go below on this trace, the requests per second that allows, and the run's own;
4. prints, per operation, the chains its calls' blocks formed (blocks each the parent or
   the child of the one before): about what state per run of blocks would handle
   instead, were runs split nowhere else. (The index links a block that only an event
   named to nothing, so such a block is a chain of its own: its counts are high.)

    PYTHONPATH=. .venv/bin/python scripts/sim_block_floor.py [--load 0.8] [--json]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import itertools
import json
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash

from common.cost_model import load_cost_model
from common.engine.block_manager import BlockManager
from services.eval import sim_runner as runner
from services.eval.simulator import simulate
from services.router.index import BlockNode, PrefixIndex
from services.router.native import DISABLE_ENV, compiled

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
SAMPLE_BLOCKS = 1_000_000

# (class, method, blocks it handled in one call: f(args) -> int)
COUNTED: dict[str, tuple[type, str, Callable[..., int]]] = {
    "index_named": (PrefixIndex, "_name_rest", lambda index, root, keys, path: keys.count - len(path)),
    "index_held": (PrefixIndex, "_hold", lambda index, worker, held, now: len(held)),
    "index_removed": (PrefixIndex, "removed", lambda index, worker, hashes: len(hashes)),
    "engine_committed": (BlockManager, "commit", lambda manager, ids, hashes, tokens, first, last, *rest:
                         max(0, last - first)),
    "engine_evicted": (BlockManager, "_evict", lambda manager, count: count),
    "engine_released": (BlockManager, "release", lambda manager, ids: len(ids)),
}


def _chains(linked: Callable[[int], bool], count: int) -> int:
    """Chains in `count` blocks where linked(i) says block i continues block i - 1's."""
    return sum(1 for i in range(count) if i == 0 or not linked(i))


def _node_chains(nodes: list[BlockNode | None]) -> int:
    """Chains of index nodes, parent first (a credit, an event) or child first (evictions)."""
    def linked(i: int) -> bool:
        before, node = nodes[i - 1], nodes[i]
        return (node is not None and before is not None
                and (node.parent is before or before.parent is node))
    return _chains(linked, len(nodes))


def _evicted_chains(manager: BlockManager, count: int) -> int:
    """Chains of the `count` cached blocks `_evict` is about to take, least recent first."""
    taken = [manager.record(block_id) for block_id in itertools.islice(manager.cached_blocks, count)]

    def linked(i: int) -> bool:
        before, block = taken[i - 1], taken[i]
        assert before is not None and block is not None  # a cached block is named
        return before.parent == block.name or block.parent == before.name
    return _chains(linked, len(taken))


# Per operation in COUNTED, the chains one call's blocks form (read before the call runs).
CHAINS: dict[str, Callable[..., int]] = {
    "index_named": lambda index, root, keys, path: int(keys.count > len(path)),
    "index_held": lambda index, worker, held, now: _node_chains(held),
    "index_removed": lambda index, worker, hashes: _node_chains([index.nodes.get(h) for h in hashes]),
    "engine_committed": lambda manager, ids, hashes, tokens, first, last, *rest: int(last > first),
    "engine_evicted": _evicted_chains,
    "engine_released": lambda manager, ids: int(len(ids) > 0),  # a sequence's table, in order
}


@contextlib.contextmanager
def counting_blocks(counts: collections.Counter[str],
                    chains: collections.Counter[str] | None = None) -> Iterator[None]:
    """Count, per operation in COUNTED, the blocks its calls handle (restored after), and
    in `chains` the chains they form (CHAINS). Only on the source modules: compiled code
    calls the index's methods directly."""
    if compiled():
        raise RuntimeError(f"counting blocks needs the router's source modules: run with {DISABLE_ENV}=0")
    originals = {name: getattr(owner, method) for name, (owner, method, _) in COUNTED.items()}

    def counted(name: str, original: Callable, blocks: Callable[..., int]) -> Callable:
        @functools.wraps(original)
        def wrapper(*args):
            counts[name] += blocks(*args)
            if chains is not None:
                chains[name] += CHAINS[name](*args)
            return original(*args)
        return wrapper

    for name, (owner, method, blocks) in COUNTED.items():
        setattr(owner, method, counted(name, originals[name], blocks))
    try:
        yield
    finally:
        for name, (owner, method, _) in COUNTED.items():
            setattr(owner, method, originals[name])


def simulate_trace(load: float) -> tuple[collections.Counter[str], collections.Counter[str], int, float]:
    """Block counts, chain counts, requests and wall seconds of the trace simulated under e2,
    set up as `svc sim --trace TRACE --workers 16 --profile h100/llama-3-70b --policy e2 --load LOAD`."""
    spec = runner.SimSpec(workload="mooncake", policies=("e2",), workers=16,
                          cost=load_cost_model("h100/llama-3-70b"), trace=str(TRACE), load=load)
    point = runner.prepare(spec)[0]
    counts: collections.Counter[str] = collections.Counter()
    chains: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    with counting_blocks(counts, chains):
        simulate(point.requests, runner.sim_config(point.spec, "e2", point.slos, False))
    return counts, chains, len(point.requests), time.perf_counter() - started


def _best_ns(run: Callable[[], float]) -> float:
    """Nanoseconds per block of the fastest of three runs (each returns its seconds)."""
    return min(run() for _ in range(3)) / SAMPLE_BLOCKS * 1e9


def _timed(body: Callable[[], None]) -> float:
    started = time.perf_counter()
    body()
    return time.perf_counter() - started


def primitive_ns() -> dict[str, float]:
    """The least each counted operation costs per block: only its container work."""
    digest, key, n = xxhash.xxh3_64_intdigest, bytes(64), SAMPLE_BLOCKS

    def name() -> float:  # hash the block after its parent, make its node, file it twice
        nodes: dict[int, BlockNode] = {}
        children: dict[int, BlockNode] = {}

        def body() -> None:
            for i in range(n):
                block_hash = digest(i.to_bytes(8, "little") + key)
                node = nodes[block_hash] = BlockNode(block_hash)
                children[i] = node
        return _timed(body)

    # A per-block index keeps a holder map per block (the live index keeps one per run).
    def hold() -> float:  # record the holder, put the block at the LRU's recent end
        held = [(BlockNode(i), dict[str, float]()) for i in range(n)]
        lru: OrderedDict[int, BlockNode] = OrderedDict()

        def body() -> None:
            for node, holders in held:
                holders["w"] = 1.0
                lru[node.block_hash] = node
        return _timed(body)

    def remove() -> float:  # drop the holder and the LRU entry
        held = [(BlockNode(i), {"w": 1.0}) for i in range(n)]
        lru = OrderedDict((node.block_hash, node) for node, _ in held)

        def body() -> None:
            for node, holders in held:
                del holders["w"]
                del lru[node.block_hash]
        return _timed(body)

    def commit() -> float:  # name the engine's block: its hash, its tokens, the hash map
        names: list[int | None] = [None] * n
        tokens: list[bytes | None] = [None] * n
        by_name: dict[int, int] = {}

        def body() -> None:
            for i in range(n):
                names[i] = i
                tokens[i] = key
                by_name[i] = i
        return _timed(body)

    def evict() -> float:  # take the LRU's oldest cached block and unname it
        cached = OrderedDict.fromkeys(range(n))
        by_name = dict.fromkeys(range(n))

        def body() -> None:
            for _ in range(n):
                del by_name[cached.popitem(last=False)[0]]
        return _timed(body)

    def release() -> float:  # drop a reference; an unreferenced block joins the cache
        references = [1] * n
        cached: OrderedDict[int, None] = OrderedDict()

        def body() -> None:
            for i in reversed(range(n)):
                count = references[i] - 1
                references[i] = count
                if count == 0:
                    cached[i] = None
        return _timed(body)

    timers = {"index_named": name, "index_held": hold, "index_removed": remove,
              "engine_committed": commit, "engine_evicted": evict, "engine_released": release}
    gc.disable()
    try:
        return {operation: _best_ns(timer) for operation, timer in timers.items()}
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if compiled():  # the counting wraps methods that compiled code calls directly: run the sources
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, DISABLE_ENV: "0"})
    counts, chains, requests, wall_s = simulate_trace(args.load)
    costs = primitive_ns()
    floor_s = sum(counts[operation] * costs[operation] for operation in costs) / 1e9
    for operation in costs:
        print(f"{operation:17} {counts[operation]:>10,} blocks × {costs[operation]:6.0f} ns = "
              f"{counts[operation] * costs[operation] / 1e9:5.2f} s; in {chains[operation]:>9,} chains "
              f"({counts[operation] / max(chains[operation], 1):5.1f} blocks each)")
    print(f"floor {floor_s:.2f} s for {requests:,} requests: at most {requests / floor_s:,.0f} requests/s; "
          f"the run itself took {wall_s:.1f} s ({requests / wall_s:,.0f} requests/s, counting included)")
    if args.json:
        print(json.dumps({"counts": counts, "chains": chains, "ns_per_block": costs, "floor_s": floor_s,
                          "requests": requests, "max_requests_per_s": requests / floor_s, "run_wall_s": wall_s}))


if __name__ == "__main__":
    main()
