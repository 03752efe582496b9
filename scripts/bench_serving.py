#!/usr/bin/env python3
"""Drive a Baton cluster with concurrent requests and compare it with the in-process engine.

    scripts/bench_serving.py [--address tcp://…:7101 | --url http://…:8000 | --pd] [--json]
                             [--concurrency 32] [--requests 64] [--repeats 5]
                             [--vllm-url http://…:8001]

With neither --address nor --url it starts its own `svc up` cluster (one worker, the tiny
default model) and stops it afterwards. Every request: a random prompt of --prompt-len
tokens, --max-tokens new tokens, greedy, EOS ignored. In this process the engine alone
runs the same requests, --concurrency at a time, on as many torch threads (--threads) as
the served worker has, so the ratio isolates what the services themselves cost. The two alternate, --repeats rounds of
each (the machine's noise then falls on both alike), and the medians are reported:
generated tokens per second, TTFT and TPOT percentiles (as the clients saw them),
`ratio_vs_inprocess` (of the medians), `decode_ratio_vs_inprocess` (the decode rate a
stream saw: in-process TPOT p50 over the served one; a served stream's TPOT also holds
the prefills of the requests that arrived after it, where in-process a round's prompts
prefill together first), `decode_rate_ratio_vs_inprocess` (the worker's decode rate,
its baton_worker_decode_{tokens,seconds}_total read around each served round, over the
in-process engine's EngineStats.decode_*) and `ttft_overhead_ms` (median TTFT through
the services minus in-process). During served rounds this process runs on the cores the
worker does not have; its in-process engine runs on the worker's. With --vllm-url the
same requests go to a vLLM OpenAI server too (once, after the rounds).

With --pd it compares two clusters of two engines each instead, both started here: a
disaggregated one (`svc up --workers 0 --prefill 1 --decode 1 --max-local-prefill-tokens
0`: every request's KV moves) and a co-located one (`svc up --workers 2`). Each round
sends the same fresh prompts (none cached from an earlier round) to one, then the other;
TTFT and TPOT (p50, p90) are medians over the rounds, and the disaggregated requests'
TTFT split (services.eval.report.ttft_split, over every round's requests) says how long
the workers queued, prefilled, waited and moved the KV, and the transfer's share of the
time to the second token: the prefill worker streams the first token before the KV
moves, so the transfer delays the second token, not the first. With --pd-parts N a third
cluster, disaggregated with `--kv-part-blocks N`, runs the same rounds: a prompt longer
than a chunk (--chunk-tokens) moves in parts while it is prefilled
(docs/disaggregation.md §2.1), where the first one's prompts move whole after their
prefill. Its transfer counts from the whole lease's arrival, so the two splits show what
parts take off the transfer.
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
    seconds = [r["second_token_s"] for r in records if r.get("second_token_s") is not None]
    return {"name": name, "requests": len(records), "tokens": tokens, "wall_s": wall_s,
            "tok_s": tokens / wall_s, "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
            "second_token_p50_ms": percentile(seconds, 0.5) * 1000 if seconds else float("nan"),
            "ttft_p90_ms": percentile(ttfts, 0.9) * 1000, "ttft_p99_ms": percentile(ttfts, 0.99) * 1000,
            "tpot_p50_ms": percentile(tpots, 0.5) * 1000, "tpot_p90_ms": percentile(tpots, 0.9) * 1000,
            "tpot_p99_ms": percentile(tpots, 0.99) * 1000}


async def run_sdk(address: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, list]:
    async with AsyncClient(address, timeout_s=600) as client:
        await client.status()
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt):
            async with gate:
                result = await client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0,
                                               ignore_eos=True)
                return {"tokens": len(result.token_ids), "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
                        "e2e_s": result.e2e_s, "second_token_s": result.second_token_s,
                        "timings": result.timings}

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


def run_inprocess(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list, tuple[int, float]]:
    """Wall seconds, per-request records, and the (tokens, seconds) of decode steps the
    timed run added to the engine's stats."""
    from common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], params)  # warm-up
    engine.block_manager.reset_prefix_cache()
    decode_before = (engine.stats.decode_tokens, engine.stats.decode_seconds)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    decode = (engine.stats.decode_tokens - decode_before[0], engine.stats.decode_seconds - decode_before[1])
    return wall, [{"tokens": len(r.token_ids), "ttft_s": r.ttft_s,
                   "tpot_s": (r.e2e_s - r.ttft_s) / max(len(r.token_ids) - 1, 1)} for r in results], decode


def worker_decode_counters(metrics_url: str) -> tuple[float, float]:
    """The worker's baton_worker_decode_{tokens,seconds}_total, once two reads a report
    interval apart agree (the worker refreshes its metrics with each heartbeat)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    def read() -> tuple[float, float]:
        with urlopen(metrics_url, timeout=10) as response:
            samples = {sample.name: sample.value
                       for family in text_string_to_metric_families(response.read().decode())
                       for sample in family.samples}
        return samples["baton_worker_decode_tokens_total"], samples["baton_worker_decode_seconds_total"]

    deadline = time.monotonic() + 10
    last = read()
    while time.monotonic() < deadline:
        time.sleep(0.6)
        now = read()
        if now == last:
            return now
        last = now
    raise RuntimeError(f"{metrics_url}: the decode counters did not settle within 10 s")


def decode_rate(decode: tuple[float, float]) -> float:
    tokens, seconds = decode
    return tokens / seconds if seconds > 0 else float("nan")


def run_served(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    if args.url:
        wall, records = asyncio.run(run_http(args.url, None, prompts, args.max_tokens, args.concurrency))
        return summarise("baton-http", wall, records)
    before = worker_decode_counters(args.worker_metrics) if args.worker_metrics else None
    wall, records = asyncio.run(run_sdk(args.address, prompts, args.max_tokens, args.concurrency))
    summary = summarise("baton-sdk", wall, records)
    if before is not None:
        after = worker_decode_counters(args.worker_metrics)
        summary["decode_tok_s"] = decode_rate((after[0] - before[0], after[1] - before[1]))
    return summary


def run_inprocess_batches(engine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The same requests, `concurrency` at a time, as the served run had them."""
    batches = [prompts[i:i + args.concurrency] for i in range(0, len(prompts), args.concurrency)]
    walls, records, decode_tokens, decode_seconds = 0.0, [], 0, 0.0
    for batch in batches:
        wall, batch_records, (tokens, seconds) = run_inprocess(engine, batch, args.max_tokens)
        walls += wall
        records += batch_records
        decode_tokens += tokens
        decode_seconds += seconds
    return {**summarise("inprocess", walls, records), "decode_tok_s": decode_rate((decode_tokens, decode_seconds))}


def split_cpus(cluster) -> tuple[set[int], set[int]]:
    """(where this process's client runs, where its in-process engine runs): with a
    cluster started here whose worker `svc up` pinned, the cores the worker does not
    have and the worker's own, so that the client never takes the served engine's core
    and the in-process engine computes on the same cores; else this process's cores."""
    mine = os.sched_getaffinity(0)
    if cluster is None:
        return mine, mine
    worker_cpus = os.sched_getaffinity(cluster.worker_health(0)["pid"])
    others = mine - worker_cpus
    return (others or mine), worker_cpus


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the rounds (the name and counts of the first)."""
    merged = dict(runs[0])
    for key in ("wall_s", "tok_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
                "tpot_p99_ms", "decode_tok_s", "second_token_p50_ms"):
        if key in merged:
            merged[key] = statistics.median(run[key] for run in runs)
    return merged


def split_of(records: list[dict]) -> dict | None:
    """services.eval.report.ttft_split of SDK records (each as sent at 0): the same
    definitions as `svc bench`'s TTFT split section."""
    from services.eval.report import RequestRecord, ttft_split

    return ttft_split([RequestRecord(str(i), "", 0.0, 0, output_tokens=r["tokens"], first_token_s=r["ttft_s"],
                                     finish_s=r["e2e_s"],
                                     second_token_s=r["second_token_s"] if r["tokens"] > 1 else None,
                                     timings=r["timings"]) for i, r in enumerate(records)])


def run_pd(args: argparse.Namespace, model_dir: Path) -> dict:
    """The disaggregated cluster against the co-located one, same requests, alternating
    rounds, both up for the whole run (see the module's docstring)."""
    from services.local_cluster import start_cluster

    flags = ["--dtype", args.dtype, "--threads", str(args.threads)]
    if args.chunk_tokens:
        flags += ["--max-num-batched-tokens", str(args.chunk_tokens)]
    clusters = {}
    try:
        clusters["pd"] = start_cluster(model_dir, workers=0, prefill=1, decode=1,
                                       extra=[*flags, "--max-local-prefill-tokens", "0"])
        if args.pd_parts:
            clusters["pd_parts"] = start_cluster(model_dir, workers=0, prefill=1, decode=1,
                                                 extra=[*flags, "--max-local-prefill-tokens", "0",
                                                        "--kv-part-blocks", str(args.pd_parts)])
        clusters["colocated"] = start_cluster(model_dir, workers=2, extra=flags)
        rng = random.Random(args.seed)
        for cluster in clusters.values():  # warm-up, on prompts of its own
            asyncio.run(run_sdk(cluster.sdk, draw_prompts(rng, 4, args.prompt_len), 4, 4))
        rounds: dict[str, list[dict]] = {name: [] for name in clusters}
        pd_records: dict[str, list[dict]] = {name: [] for name in clusters if name.startswith("pd")}
        for _ in tqdm(range(args.repeats), desc="bench_serving --pd", unit="round", disable=None):
            prompts = draw_prompts(rng, args.requests, args.prompt_len)
            for name, cluster in clusters.items():
                wall, records = asyncio.run(run_sdk(cluster.sdk, prompts, args.max_tokens, args.concurrency))
                rounds[name].append(summarise(name, wall, records))
                if name in pd_records:
                    pd_records[name] += records
    finally:
        for cluster in clusters.values():
            cluster.stop()
    pd, colocated = median_run(rounds["pd"]), median_run(rounds["colocated"])
    parts = {"pd_parts": median_run(rounds["pd_parts"]), "ttft_split_parts": split_of(pd_records["pd_parts"])} \
        if "pd_parts" in rounds else {}
    return {"pd": pd, "colocated": colocated, "ttft_split": split_of(pd_records["pd"]), **parts,
            "ttft_p50_delta_ms": pd["ttft_p50_ms"] - colocated["ttft_p50_ms"],
            "tpot_p50_delta_ms": pd["tpot_p50_ms"] - colocated["tpot_p50_ms"],
            "requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "concurrency": args.concurrency, "threads": args.threads, "repeats": args.repeats,
            "chunk_tokens": args.chunk_tokens}


def print_pd(report: dict) -> None:
    print(f"{'run':<11}{'tok/s':>8}{'ttft p50':>11}{'ttft p90':>11}{'2nd p50':>11}{'tpot p50':>11}{'tpot p90':>11}")
    rows = [report["pd"], *([report["pd_parts"]] if "pd_parts" in report else []), report["colocated"]]
    for row in rows:
        print(f"{row['name']:<11}{row['tok_s']:>8.0f}{row['ttft_p50_ms']:>9.1f}ms{row['ttft_p90_ms']:>9.1f}ms"
              f"{row['second_token_p50_ms']:>9.1f}ms{row['tpot_p50_ms']:>9.2f}ms{row['tpot_p90_ms']:>9.2f}ms")
    for name, key in (("pd", "ttft_split"), ("pd_parts", "ttft_split_parts")):
        if key in report:
            print_split(name, report[key])


def print_split(name: str, split: dict | None) -> None:
    if split is None:
        print(f"{name}: no request carried timings (none was disaggregated)")
        return
    print(f"{name} split over {split['requests']} requests, ms p50/p90: "
          + "  ".join(f"{part} {split[part + '_p50_s'] * 1000:.1f}/{split[part + '_p90_s'] * 1000:.1f}"
                      for part in ("queue", "prefill", "decode_wait", "transfer")))
    print(f"{name} transfer_share_of_first_decode p50 {split['transfer_share_of_first_decode_p50']:.3f} "
          f"p90 {split['transfer_share_of_first_decode_p90']:.3f} (transfer_s / time to the 2nd token, which "
          "the transfer delays; the 1st token is streamed before it)")


def draw_prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(4, 500) for _ in range(length)] for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--address", help="a running cluster's SDK address")
    target.add_argument("--url", help="a running cluster's HTTP gateway")
    target.add_argument("--pd", action="store_true", help="a disaggregated 1 prefill + 1 decode cluster against a "
                        "co-located 2-worker one, both started here (see above)")
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
    parser.add_argument("--worker-metrics", help="with --address: the worker's /metrics URL, for the served "
                        "decode rate (a cluster started here: its worker's)")
    parser.add_argument("--pd-parts", type=int, default=0, metavar="BLOCKS", help="with --pd: also a "
                        "disaggregated cluster with --kv-part-blocks BLOCKS (prompts longer than a chunk move in "
                        "parts while they are prefilled), in the same rounds")
    parser.add_argument("--chunk-tokens", type=int, default=0, help="with --pd: the clusters' prefill chunk "
                        "(--max-num-batched-tokens; default the engine's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.pd and args.vllm_url:
        parser.error("--pd takes no --vllm-url")

    from common.engine.default_model import default_model_dir

    model_dir = args.model or default_model_dir()
    if args.pd:
        pd_report = run_pd(args, model_dir)
        print_pd(pd_report)
        if args.json:
            print(json.dumps(pd_report))
        return
    rng = random.Random(args.seed)
    prompts = draw_prompts(rng, args.requests, args.prompt_len)
    cluster = None
    if not args.address and not args.url:
        from services.local_cluster import start_cluster

        cluster = start_cluster(model_dir, workers=1, extra=["--dtype", args.dtype, "--threads", str(args.threads)])
        args.address = cluster.sdk
        args.worker_metrics = args.worker_metrics or cluster.worker_metrics_url(0)
    import torch

    torch.set_num_threads(args.threads)  # like for like: the served worker has as many
    engine = make_engine(model_dir, args.dtype)
    client_cpus, engine_cpus = split_cpus(cluster)
    rounds: list[tuple[dict, dict]] = []
    try:
        if not args.url:
            asyncio.run(run_sdk(args.address, prompts[:2], 4, 2))  # warm-up
        # disable=None: a bar on stderr when it is a terminal, nothing in logs and pipes.
        for _ in tqdm(range(args.repeats), desc="bench_serving", unit="round", disable=None):
            os.sched_setaffinity(0, client_cpus)
            served_round = run_served(args, prompts)
            os.sched_setaffinity(0, engine_cpus)
            rounds.append((served_round, run_inprocess_batches(engine, prompts, args)))
    finally:
        os.sched_setaffinity(0, client_cpus | engine_cpus)
        if cluster is not None:
            cluster.stop()
    served, inprocess = median_run([r[0] for r in rounds]), median_run([r[1] for r in rounds])
    report = {"tok_s": served["tok_s"], "inprocess_tok_s": inprocess["tok_s"],
              "ratio_vs_inprocess": served["tok_s"] / inprocess["tok_s"],
              "decode_ratio_vs_inprocess": inprocess["tpot_p50_ms"] / served["tpot_p50_ms"],
              "decode_rate_ratio_vs_inprocess": (served["decode_tok_s"] / inprocess["decode_tok_s"]
                                                 if "decode_tok_s" in served else None),
              "served_decode_tok_s": served.get("decode_tok_s"), "inprocess_decode_tok_s": inprocess["decode_tok_s"],
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
    print(f"ratio_vs_inprocess {report['ratio_vs_inprocess']:.3f}   decode_ratio_vs_inprocess "
          f"{report['decode_ratio_vs_inprocess']:.3f}   ttft_overhead_ms {report['ttft_overhead_ms']:.1f}")
    if report["decode_rate_ratio_vs_inprocess"] is not None:
        print(f"decode rate: served {report['served_decode_tok_s']:.0f} tok/s, in-process "
              f"{report['inprocess_decode_tok_s']:.0f} tok/s, decode_rate_ratio_vs_inprocess "
              f"{report['decode_rate_ratio_vs_inprocess']:.3f}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
