#!/usr/bin/env python3
"""A burst of copies of one long prompt, with and without the scheduler waiting for a
shared prefill (EngineConfig.wait_for_shared_prefill), in one process.

    scripts/bench_shared_burst.py [--copies 8] [--prompt-len 1024] [--max-tokens 8]
                                  [--rounds 7] [--model DIR] [--dtype bfloat16] [--json]

Each round draws a new random prompt, clears both engines' prefix caches and sends the
copies to each engine at once. Reported per setting: the median wall time of a burst,
the median TTFT within it and the tokens that went through the model; then
`speedup` (median wall time off / on) and `speedup_paired` (the median of each round's
own ratio), and `same_tokens`: whether both settings generated the same ids. In float32
they must (a prefix hit computes what a cold prefill does); in bfloat16 they may not,
as a prompt served from the cache can already differ from its cold prefill there (1 of
10 1,024-token prompts on the tiny model, with this option off). With --json the
last line is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.default_model import default_model_dir  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {"off": False, "on": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", type=Path, help="checkpoint (default: the tiny default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("copies", "prompt_len", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def burst(engine: Engine, prompt: list[int], copies: int, params: SamplingParams) -> dict:
    engine.block_manager.reset_prefix_cache()
    computed_before = engine.stats.num_computed_tokens
    start = time.perf_counter()
    results = engine.generate([prompt] * copies, params)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_s": statistics.median(r.ttft_s for r in results),
            "computed_tokens": engine.stats.num_computed_tokens - computed_before,
            "token_ids": [r.token_ids for r in results]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = EngineConfig(model_dir=args.model or default_model_dir(), dtype=args.dtype,
                          max_model_len=args.prompt_len + args.max_tokens)
    engines = {name: Engine(dataclasses.replace(config, wait_for_shared_prefill=flag))
               for name, flag in SETTINGS.items()}
    vocab = engines["on"].model_config.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rng = random.Random(args.seed)
    rounds: list[dict[str, dict]] = []
    # disable=None: a bar on stderr when it is a terminal, nothing in logs and pipes.
    for _ in tqdm(range(args.rounds), desc="bench_shared_burst", unit="round", disable=None):
        prompt = [rng.randrange(4, vocab) for _ in range(args.prompt_len)]
        rounds.append({name: burst(engine, prompt, args.copies, params) for name, engine in engines.items()})
    same_tokens = all(r["off"]["token_ids"] == r["on"]["token_ids"] for r in rounds)
    report = {name: {"wall_ms": statistics.median(r[name]["wall_s"] for r in rounds) * 1e3,
                     "ttft_ms": statistics.median(r[name]["ttft_s"] for r in rounds) * 1e3,
                     "computed_tokens": statistics.median(r[name]["computed_tokens"] for r in rounds)}
              for name in SETTINGS}
    report.update({
        "speedup": report["off"]["wall_ms"] / report["on"]["wall_ms"],
        "speedup_paired": statistics.median(r["off"]["wall_s"] / r["on"]["wall_s"] for r in rounds),
        "same_tokens": same_tokens, "copies": args.copies, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "max_num_batched_tokens": config.max_num_batched_tokens})
    print(f"{'setting':<8}{'burst ms':>10}{'ttft ms':>10}{'computed':>10}")
    for name in SETTINGS:
        row = report[name]
        print(f"{name:<8}{row['wall_ms']:>10.1f}{row['ttft_ms']:>10.1f}{row['computed_tokens']:>10.0f}")
    print(f"speedup {report['speedup']:.2f} (paired {report['speedup_paired']:.2f}), same tokens: {same_tokens}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
