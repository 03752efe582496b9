#!/usr/bin/env python3
"""Drive a Baton cluster with concurrent requests and compare it with the in-process engine.

    scripts/bench_serving.py [--address tcp://…:7101 | --url http://…:8000] [--json]
                             [--concurrency 32] [--requests 64] [--repeats 5]
                             [--vllm-url http://…:8001]

With neither --address nor --url it starts its own `svc up` cluster (one worker, the tiny
default model) and stops it afterwards. Every request: a random prompt of --prompt-len
tokens, --max-tokens new tokens, greedy, EOS ignored. In this process the engine alone
runs the same requests, --concurrency at a time, on as many torch threads (--threads) as
the served worker has, so the ratio isolates what the services themselves cost. The two alternate, --repeats rounds of
each (the machine's noise then falls on both alike), and the medians are reported:
generated tokens per second, TTFT and TPOT percentiles (as the clients saw them),
`ratio_vs_inprocess` (of the medians) and `ttft_overhead_ms` (median TTFT through the
services minus in-process). With --vllm-url the same requests go to a vLLM OpenAI server
too (once, after the rounds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.client import AsyncClient  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarise(name: str, wall_s: float, records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    ttfts = [r["ttft_s"] for r in records]
    tpots = [r["tpot_s"] for r in records if r["tokens"] > 1]
    return {"name": name, "requests": len(records), "tokens": tokens, "wall_s": wall_s,
            "tok_s": tokens / wall_s, "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
            "ttft_p99_ms": percentile(ttfts, 0.99) * 1000, "tpot_p50_ms": percentile(tpots, 0.5) * 1000,
            "tpot_p99_ms": percentile(tpots, 0.99) * 1000}


async def run_sdk(address: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, list]:
    async with AsyncClient(address, timeout_s=600) as client:
        await client.status()
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt):
            async with gate:
                result = await client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0,
                                               ignore_eos=True)
                return {"tokens": len(result.token_ids), "ttft_s": result.ttft_s, "tpot_s": result.tpot_s}

        start = time.perf_counter()
        records = await asyncio.gather(*[one(p) for p in prompts])
        return time.perf_counter() - start, records


async def run_http(url: str, model: str | None, prompts: list[list[int]], max_tokens: int,
                   concurrency: int) -> tuple[float, list]:
    import openai

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="bench", timeout=600)
    model = model or (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with gate:
            start = time.perf_counter()
            first, count = None, 0
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True, "min_tokens": max_tokens})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.perf_counter()
                if chunk.usage is not None:  # the server's own count of generated tokens
                    count = chunk.usage.completion_tokens
            end = time.perf_counter()
            first = first or end
            return {"tokens": count, "ttft_s": first - start, "tpot_s": (end - first) / max(count - 1, 1)}

    start = time.perf_counter()
    records = await asyncio.gather(*[one(p) for p in prompts])
    await client.close()
    return time.perf_counter() - start, records


def make_engine(model_dir: Path, dtype: str):
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    return Engine(EngineConfig(model_dir=model_dir, dtype=dtype))


def run_inprocess(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], params)  # warm-up
    engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, [{"tokens": len(r.token_ids), "ttft_s": r.ttft_s,
                   "tpot_s": (r.e2e_s - r.ttft_s) / max(len(r.token_ids) - 1, 1)} for r in results]


def run_served(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    if args.url:
        wall, records = asyncio.run(run_http(args.url, None, prompts, args.max_tokens, args.concurrency))
        return summarise("baton-http", wall, records)
    wall, records = asyncio.run(run_sdk(args.address, prompts, args.max_tokens, args.concurrency))
    return summarise("baton-sdk", wall, records)


def run_inprocess_batches(engine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The same requests, `concurrency` at a time, as the served run had them."""
    batches = [prompts[i:i + args.concurrency] for i in range(0, len(prompts), args.concurrency)]
    walls, records = 0.0, []
    for batch in batches:
        wall, batch_records = run_inprocess(engine, batch, args.max_tokens)
        walls += wall
        records += batch_records
    return summarise("inprocess", walls, records)


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the rounds (the name and counts of the first)."""
    merged = dict(runs[0])
    for key in ("wall_s", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        merged[key] = statistics.median(run[key] for run in runs)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--address", help="a running cluster's SDK address")
    target.add_argument("--url", help="a running cluster's HTTP gateway")
    parser.add_argument("--model", type=Path, help="checkpoint (default: the tiny default model)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                        help="torch threads of the served worker and of the in-process engine alike "
                             "(default: what svc up gives one worker, the cores but one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of served then in-process runs")
    parser.add_argument("--vllm-url", help="a vLLM OpenAI server on the same checkpoint")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    from common.engine.default_model import default_model_dir

    model_dir = args.model or default_model_dir()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    cluster = None
    if not args.address and not args.url:
        from services.local_cluster import start_cluster

        cluster = start_cluster(model_dir, workers=1, extra=["--dtype", args.dtype, "--threads", str(args.threads)])
        args.address = cluster.sdk
    import torch

    torch.set_num_threads(args.threads)  # like for like: the served worker has as many
    engine = make_engine(model_dir, args.dtype)
    rounds: list[tuple[dict, dict]] = []
    try:
        if not args.url:
            asyncio.run(run_sdk(args.address, prompts[:2], 4, 2))  # warm-up
        # disable=None: a bar on stderr when it is a terminal, nothing in logs and pipes.
        for _ in tqdm(range(args.repeats), desc="bench_serving", unit="round", disable=None):
            rounds.append((run_served(args, prompts), run_inprocess_batches(engine, prompts, args)))
    finally:
        if cluster is not None:
            cluster.stop()
    served, inprocess = median_run([r[0] for r in rounds]), median_run([r[1] for r in rounds])
    report = {"tok_s": served["tok_s"], "inprocess_tok_s": inprocess["tok_s"],
              "ratio_vs_inprocess": served["tok_s"] / inprocess["tok_s"],
              "ttft_overhead_ms": served["ttft_p50_ms"] - inprocess["ttft_p50_ms"],
              "served": served, "inprocess": inprocess, "concurrency": args.concurrency,
              "requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "threads": args.threads,
              "repeats": args.repeats, "rounds": [{"served_tok_s": a["tok_s"], "inprocess_tok_s": b["tok_s"]}
                                                  for a, b in rounds]}
    if args.vllm_url:
        wall, records = asyncio.run(run_http(args.vllm_url, None, prompts, args.max_tokens, args.concurrency))
        report["vllm_server"] = summarise("vllm-server", wall, records)
        report["ratio_vs_vllm_server"] = served["tok_s"] / report["vllm_server"]["tok_s"]
    rows = [served, inprocess] + ([report["vllm_server"]] if args.vllm_url else [])
    print(f"{'run':<14}{'tok/s':>10}{'ttft p50':>11}{'ttft p99':>11}{'tpot p50':>11}{'tpot p99':>11}")
    for row in rows:
        print(f"{row['name']:<14}{row['tok_s']:>10.0f}{row['ttft_p50_ms']:>9.1f}ms{row['ttft_p99_ms']:>9.1f}ms"
              f"{row['tpot_p50_ms']:>9.2f}ms{row['tpot_p99_ms']:>9.2f}ms")
    print(f"ratio_vs_inprocess {report['ratio_vs_inprocess']:.3f}   ttft_overhead_ms {report['ttft_overhead_ms']:.1f}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
