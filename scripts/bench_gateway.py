#!/usr/bin/env python3
"""The HTTP gateway against the SDK socket of one running cluster, with the same requests.

    scripts/bench_gateway.py [--url http://…:8000 --address tcp://…:7101] [--json]
                             [--concurrency 64] [--requests 1000] [--max-tokens 16]

With neither --url nor --address it starts its own `svc up` cluster (one worker, the
tiny default model) and stops it afterwards. Every request: a random prompt of
--prompt-len token ids, --max-tokens new tokens, greedy, EOS ignored, streamed; at most
--concurrency in flight. The HTTP side is a plain streaming client (aiohttp, SSE read
line by line, the token count from the final usage chunk), so the figures are the
gateway's and not a heavy client's. The two sides alternate for --repeats rounds; each figure is
the median over the rounds: requests/s, TTFT p50/p99 as the clients saw them, and
`http_vs_sdk` (HTTP requests/s over SDK requests/s). On a 2-core machine shared with
other work requests/s swing by tens of percent between rounds, so when it started the
cluster itself it also reports the CPU milliseconds per request that each role's process
(and this client) spent, read from /proc: `tokenizer_cpu_vs_sdk` is the gateway's cost in
CPU, which other load on the machine does not move.
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
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.client import AsyncClient  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarise(wall_s: float, records: list[dict]) -> dict:
    ttfts = [r["ttft_s"] for r in records]
    return {"requests": len(records), "tokens": sum(r["tokens"] for r in records), "wall_s": wall_s,
            "requests_s": len(records) / wall_s, "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
            "ttft_p99_ms": percentile(ttfts, 0.99) * 1000}


async def run_sdk(address: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    async with AsyncClient(address, timeout_s=600) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int]) -> dict:
            async with gate:
                start = time.perf_counter()
                first, tokens = None, 0
                async for chunk in client.stream(token_ids=prompt, max_tokens=max_tokens, temperature=0,
                                                 ignore_eos=True):
                    first = first or time.perf_counter()
                    tokens += len(chunk.token_ids)
                return {"tokens": tokens, "ttft_s": (first or time.perf_counter()) - start}

        start = time.perf_counter()
        records = await asyncio.gather(*[one(p) for p in prompts])
        return summarise(time.perf_counter() - start, records)


async def run_http(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, headers={"Authorization": "Bearer bench"},
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int]) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with gate:
                start = time.perf_counter()
                first, tokens = None, 0
                async with session.post("/v1/completions", json=body) as response:
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
                    async for line in response.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        first = first or time.perf_counter()
                        if b'"usage":{' in line:
                            tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                return {"tokens": tokens, "ttft_s": (first or time.perf_counter()) - start}

        start = time.perf_counter()
        records = await asyncio.gather(*[one(p) for p in prompts])
        return summarise(time.perf_counter() - start, records)


def role_pids(port_base: int) -> dict[str, int]:
    """The pids of a local cluster's role processes (svc start ROLE ... --port-base N)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"start" in argv and str(port_base).encode() in argv:
            role = argv[argv.index(b"start") + 1].decode()
            pids[role if role not in pids else f"{role}-{entry.name}"] = int(entry.name)
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(run, pids: dict[str, int]) -> dict:
    """Run one load and add the CPU ms per request of each role and of this client."""
    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    client_before = time.process_time()
    result = run()
    for role, pid in pids.items():
        result[f"{role}_cpu_ms_per_request"] = (cpu_seconds(pid) - before[role]) * 1000 / result["requests"]
    result["client_cpu_ms_per_request"] = (time.process_time() - client_before) * 1000 / result["requests"]
    return result


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def served_model(url: str) -> str:
    request = urllib.request.Request(url.rstrip("/") + "/v1/models", headers={"Authorization": "Bearer bench"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running cluster's HTTP gateway (with --address)")
    parser.add_argument("--address", help="the same cluster's SDK address (with --url)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="the started cluster's dtype")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of SDK then HTTP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. a commit)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if bool(args.url) != bool(args.address):
        parser.error("--url and --address go together (one cluster's two doors)")
    if args.repeats < 1 or args.requests < 1 or args.concurrency < 1:
        parser.error("--repeats, --requests and --concurrency must be >= 1")

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    cluster = None
    if not args.url:
        from common.engine.default_model import default_model_dir
        from services.local_cluster import start_cluster

        cluster = start_cluster(default_model_dir(), workers=1, extra=["--dtype", args.dtype])
        args.url, args.address = cluster.http, cluster.sdk
    sdk_runs, http_runs = [], []
    pids = role_pids(cluster.port_base) if cluster is not None else {}
    try:
        model = served_model(args.url)
        asyncio.run(run_sdk(args.address, prompts[:8], 4, 8))  # warm-up of both doors
        asyncio.run(run_http(args.url, model, prompts[:8], 4, 8))
        for _ in range(args.repeats):
            sdk_runs.append(measured(lambda: asyncio.run(
                run_sdk(args.address, prompts, args.max_tokens, args.concurrency)), pids))
            http_runs.append(measured(lambda: asyncio.run(
                run_http(args.url, model, prompts, args.max_tokens, args.concurrency)), pids))
    finally:
        if cluster is not None:
            cluster.stop()
    sdk, http = median_of(sdk_runs), median_of(http_runs)
    report = {"label": args.label, "http": http, "sdk": sdk, "http_vs_sdk": http["requests_s"] / sdk["requests_s"],
              "rounds": [{"sdk_requests_s": s["requests_s"], "http_requests_s": h["requests_s"]}
                         for s, h in zip(sdk_runs, http_runs)],
              "concurrency": args.concurrency, "requests": args.requests, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "cpus": os.cpu_count()}
    if "tokenizer" in pids:
        report["tokenizer_cpu_vs_sdk"] = http["tokenizer_cpu_ms_per_request"] / sdk["tokenizer_cpu_ms_per_request"]
    roles = [key for key in sdk if key.endswith("_cpu_ms_per_request")]
    print(f"{'door':<6}{'req/s':>9}{'ttft p50':>11}{'ttft p99':>11}"
          + "".join(f"{key.removesuffix('_cpu_ms_per_request') + ' cpu':>15}" for key in roles))
    for name, row in (("sdk", sdk), ("http", http)):
        print(f"{name:<6}{row['requests_s']:>9.1f}{row['ttft_p50_ms']:>9.1f}ms{row['ttft_p99_ms']:>9.1f}ms"
              + "".join(f"{row[key]:>13.2f}ms" for key in roles))
    print(f"http_vs_sdk {report['http_vs_sdk']:.3f}"
          + (f"   tokenizer_cpu_vs_sdk {report['tokenizer_cpu_vs_sdk']:.2f}" if "tokenizer" in pids else ""))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
