#!/usr/bin/env python3
"""The router's prefix index: how many bytes it holds per indexed block (issue 51).

Builds a `PrefixIndex` the way the router does in events mode, from the Mooncake trace's
prompts in arrival order: each prompt is walked, placed on one of `--workers` workers
(round robin) on credit (`expect`), and its blocks are then confirmed by that worker's
stored event, until the index names `--blocks` blocks. No worker evicts: the index keeps
everything, as a router whose fleet's caches hold that many blocks would. tracemalloc
counts the bytes allocated while building and still held at the end (the index's nodes,
keys, hashes, runs, holds and tables, and the credits' bookkeeping), and the script prints
them per indexed block; the process's resident memory before and after a first build,
without tracemalloc, says the same from the OS's side (with the allocator's slack). The
router's compiled index is measured where a build exists (docs/router.md §8.5), as the
live router would run it.

With --shards it also says how evenly splitting the index by each chain's first block
(one router process per shard) would spread these blocks.

It also prints the floor of any index kept in Python objects that finds a block by its
name, as KV events name blocks: a dict from each block's 64-bit name (an int of its own)
to the run that holds it, traced at the same number of names (`name_table_floor`). State
per run does not remove that table; only a table outside Python objects (a native hash
table of fixed-size entries) does.

    PYTHONPATH=. .venv/bin/python scripts/index_memory.py [--blocks 1000000] [--workers 16]
        [--shards 4,8,16] [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import sys
import time
import tracemalloc
from pathlib import Path

from services.eval.workloads import make_workload
from services.router.index import BlockNode, PrefixIndex
from services.router.native import compiled

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_SIZE = 16
ROOT = 1  # one model, one namespace


def resident_bytes() -> int:
    """The process's resident set now (Linux /proc), 0 where it cannot be read."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * resource.getpagesize()


def build(index: PrefixIndex, prompts: list, workers: int, blocks: int) -> int:
    """Place prompts on the index until it names `blocks` blocks; returns the prompts used."""
    for used, prompt in enumerate(prompts, start=1):
        worker = f"worker-{used % workers}"
        keys = index.block_keys(prompt)
        path = index.walk(ROOT, keys)
        held = index.match(path).get(worker, 0)
        credit = index.expect(worker, ROOT, keys, path, held, now=float(used))
        index.stored(worker, index.credited(credit), now=float(used))  # the worker's KV event
        if len(index) >= blocks:
            return used
    return len(prompts)


def _children(node: BlockNode) -> list[BlockNode]:
    children = node.children
    if children is None:
        return []
    return list(children.values()) if isinstance(children, dict) else [children]


def shard_balance(index: PrefixIndex, shards: int) -> float:
    """Were the index split into `shards` processes by the first block of each chain (a
    prompt's every block goes where its first block's name says, name mod shards), the
    largest shard's blocks over the mean: every prefix a prompt shares with another lies
    in one shard, since prompts that share any prefix share their first block."""
    per_shard = [0] * shards
    for root in index.roots.values():
        for first in _children(root):
            count, stack = 0, [first]
            while stack:
                node = stack.pop()
                count += 1
                stack.extend(_children(node))
            per_shard[first.block_hash % shards] += count
    return max(per_shard) / (sum(per_shard) / shards)


def name_table_floor(blocks: int, seed: int = 0) -> float:
    """Bytes per block that tracemalloc counts for a dict from `blocks` random 64-bit
    names (made under the trace, as an index makes them from events) to their runs (one
    object per 64 blocks, made before the trace: what a run holds is counted apart)."""
    rng = random.Random(seed)
    runs = [object() for _ in range(blocks // 64 + 1)]
    gc.collect()
    tracemalloc.start()
    table = {rng.getrandbits(64): runs[number // 64] for number in range(blocks)}
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del table
    return held / blocks


def measure(trace: Path, blocks: int, workers: int, shards: tuple[int, ...] = ()) -> dict:
    """Two builds: one untraced, for the resident growth and the time, then one under
    tracemalloc, for the bytes held."""
    prompts = [request.token_ids for request in make_workload("mooncake", 10**9, trace=str(trace))]
    gc.collect()
    resident_before = resident_bytes()
    started = time.perf_counter()
    index = PrefixIndex(BLOCK_SIZE)
    used = build(index, prompts, workers, blocks)
    build_s = time.perf_counter() - started
    resident_growth = resident_bytes() - resident_before
    indexed = len(index)
    holds = sum(index.num_blocks(f"worker-{w}") for w in range(workers))
    balance = {count: shard_balance(index, count) for count in shards}
    del index
    gc.collect()
    tracemalloc.start()
    index = PrefixIndex(BLOCK_SIZE)
    build(index, prompts, workers, blocks)
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "compiled": compiled(),
        "prompts": used,
        "workers": workers,
        "indexed_blocks": indexed,
        "block_holds": holds,
        "traced_bytes": held,
        "bytes_per_block": held / indexed,
        "resident_growth_bytes": resident_growth,
        "resident_bytes_per_block": resident_growth / indexed,
        "build_s": build_s,
        "shard_max_over_mean": balance,
        "name_table_floor_bytes_per_block": name_table_floor(indexed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake-format trace")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="indexed blocks to reach")
    parser.add_argument("--workers", type=int, default=16, help="workers the prompts are placed on")
    parser.add_argument("--shards", default="", help="comma-separated shard counts: how evenly sharding "
                        "the index by each chain's first block would split its blocks")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.blocks < 1 or args.workers < 1:
        sys.exit("--blocks and --workers must be at least 1")
    if not args.trace.is_file():
        sys.exit(f"no trace at {args.trace} (pass --trace)")
    try:
        shards = tuple(int(count) for count in args.shards.split(",") if count.strip())
    except ValueError:
        sys.exit(f"--shards: expected comma-separated integers, got {args.shards!r}")
    if any(count < 1 for count in shards):
        sys.exit("--shards: each count must be at least 1")
    result = measure(args.trace, args.blocks, args.workers, shards)
    if args.json:
        print(json.dumps(result))
        return
    print(f"index ({'compiled' if result['compiled'] else 'source'}): {result['indexed_blocks']:,} blocks, "
          f"{result['block_holds']:,} worker holds, from {result['prompts']:,} prompts on "
          f"{result['workers']} workers in {result['build_s']:.1f} s")
    print(f"traced: {result['traced_bytes'] / 2**20:,.0f} MiB = {result['bytes_per_block']:.0f} bytes per block; "
          f"resident growth {result['resident_growth_bytes'] / 2**20:,.0f} MiB = "
          f"{result['resident_bytes_per_block']:.0f} bytes per block")
    print(f"floor of a Python index that finds blocks by name: {result['name_table_floor_bytes_per_block']:.0f} "
          f"bytes per block (a dict from each name to its run)")
    for count, ratio in result["shard_max_over_mean"].items():
        print(f"sharded by first block into {count}: the largest shard holds {ratio:.2f}x the mean")


if __name__ == "__main__":
    main()
