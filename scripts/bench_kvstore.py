"""Benchmark the tiered KV store: tier throughput beside raw references, fetch against
recompute on a long prompt, and a multi-turn chat whose working set overflows the engine.

Part 1, throughput (one real kvstore process, this process its client): --blocks blocks of
the --model's KV layout (bf16, 16 tokens per block) are put and then fetched back through
the same-host path (the store's DRAM pool mapped from /dev/shm), as inline frames (the
bytes travel in the control messages) and, for gets, over the KV transport (the engine's
KvTransport pulls the leased DRAM slots; puts then travel as frames), and written to and
read from the SSD tier (SsdTier in a temporary directory, CRC32C on every record). Beside
them, the raw references on the same bytes: a numpy memcpy, timed right after each fetch
(dram get / memcpy is the median of those back-to-back pairs), and a sequential file
write with fsync and its read back, the read timed right after each SSD tier read (ssd get
/ file read the median of those pairs). Every figure is the median of --repeats runs (GB/s = bytes
/ median seconds).

Part 2, fetch against recompute (a real cluster: router, tokenizer, one worker, kvstore):
a --prompt-tokens prompt is computed once, pushed out of the worker's own KV pool by
other prompts (so the store holds it, and the worker does not), then asked again: its
TTFT with the store (DRAM; SSD with a store whose DRAM tier is too small to keep it)
against a worker without a store, which recomputes. The prompt length below which
fetching loses follows from the measured fetch time and prefill time per token. Then the
long prompt once more on the store's clusters, now from the worker's own cache (the same
last tokens computed, nothing fetched): the difference is what the fetch itself cost.

Part 3, multi-turn chat (tiny model, small engine pool): --sessions conversations take
turns, each turn's prompt extending the last; the engine's pool holds about two, so
history comes back from the store or is recomputed. Hit rate per tier (the worker's
counters) and mean TTFT with the store and without; and a run where no prompt is ever
reused, whose TTFT with the store over without is `no_reuse_overhead` (target <= 1.03).

    PYTHONPATH=. .venv/bin/python scripts/bench_kvstore.py
    PYTHONPATH=. .venv/bin/python scripts/bench_kvstore.py --json --parts throughput

With --json the last line is one object with dram_get_gbps, dram_put_gbps,
frames_get_gbps, frames_put_gbps, transport_get_gbps, ssd_get_gbps, ssd_put_gbps, memcpy_gbps,
file_read_gbps, file_write_gbps, fetch_vs_recompute_speedup (per tier), fetch_loses_below_tokens,
fetch_cost_s and fetch_cost_gbps (per tier),
multi_turn (per run: hit rates, mean TTFT) and no_reuse_overhead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PARTS = ("throughput", "fetch", "multiturn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--model", default="small", help="embedded model size (its KV layout, and part 2's model)")
    parser.add_argument("--blocks", type=int, default=128, help="part 1: blocks moved per run")
    parser.add_argument("--repeats", type=int, default=5, help="part 1: timed runs per path")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="part 2: the long prompt's length")
    parser.add_argument("--sessions", type=int, default=6, help="part 3: conversations")
    parser.add_argument("--turns", type=int, default=4, help="part 3: turns per conversation")
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    return args


def median_seconds(run: Callable[[], None], repeats: int) -> float:
    """Median wall time of `repeats` calls, after one untimed warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


# ---- raw references ------------------------------------------------------------------------


class RawFile:
    """One sequential file of num_bytes, the SSD tier's reference: written with an fsync,
    read back whole."""

    def __init__(self, directory: Path, num_bytes: int):
        self.data = np.random.default_rng(1).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
        self.path = directory / "raw.bin"

    def write(self) -> None:
        with open(self.path, "wb", buffering=0) as handle:
            handle.write(self.data)
            os.fsync(handle.fileno())

    def read(self) -> None:
        with open(self.path, "rb", buffering=0) as handle:
            handle.readinto(bytearray(len(self.data)))


def seconds(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


class StoreProcess:
    """`svc start kvstore` on free loopback ports, stopped by `stop`."""

    def __init__(self, model_dir: Path, scratch: Path, **settings: object):
        import subprocess

        from common.config import load_config
        from services.local_cluster import REPO, child_env, free_port_base

        settings = {"model": str(model_dir), "port_base": free_port_base(), "kvstore_timeout_s": 30.0, **settings}
        path = scratch / f"store-{settings['port_base']}.toml"
        path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))
        self.config = load_config(path)
        self.log = scratch / f"store-{settings['port_base']}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "services.cli", "start", "kvstore", "--config",
                                             str(path)], stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                            cwd=REPO)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        from services.local_cluster import _health

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("the store exited:\n" + self.log.read_text()[-3000:])
            try:
                if _health(self.config.kvstore_metrics_port).get("ok"):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the store did not come up:\n" + self.log.read_text()[-3000:])

    def client(self, layout, shared_memory: bool, transport=None):
        import zmq

        from common.sockets import Security
        from services.kvstore.client import StoreClient

        security: Security = Security(zmq.Context.instance(), self.config, "worker")
        return StoreClient(self.config, security, "bench", layout, shared_memory=shared_memory, transport=transport)

    def transport(self, layout, pool: np.ndarray):
        """An engine's KvTransport over `pool` (plane-major), the store's kv_transport setting."""
        import zmq

        from common.engine.checkpoint import fingerprints
        from common.kv_transfer import PoolGeometry, TransferOptions, make_transport
        from common.sockets import Security

        security: Security = Security(zmq.Context.instance(), self.config, "worker")
        geometry = PoolGeometry(layout, pool.size // layout.bytes_per_block)
        return make_transport(self.config.kv_transport, pool, geometry, fingerprints(Path(self.config.model))[0],
                              security, "bench", TransferOptions(host=self.config.host))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except Exception:
            self.process.kill()
            self.process.wait(10)


@dataclass
class StoreTimes:
    """Seconds per timed run: a put, a fetch, and a memcpy of the same bytes right after it."""

    put_s: list[float] = field(default_factory=list)
    fetch_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)

    def fetch_vs_memcpy(self) -> float:
        """The median over runs of memcpy time / fetch time (each pair back to back, so
        load from elsewhere falls on both alike)."""
        return statistics.median(m / f for m, f in zip(self.memcpy_s, self.fetch_s))


def store_seconds(client, values: np.ndarray, repeats: int, pool: np.ndarray | None = None) -> StoreTimes:
    """Times of values.shape[0] blocks as one chain, a fresh namespace each run (so every
    put stores every block), each run checked and removed; fetched into `pool` (the
    transport's) or a fresh one; after each fetch a numpy memcpy of the same bytes."""
    count = values.shape[0]
    pool = np.zeros(values.size, dtype=np.uint8) if pool is None else pool
    planes = client.num_planes
    expected = values.reshape(count, planes, -1).transpose(1, 0, 2).reshape(-1)
    copy_target = np.empty_like(values)
    np.copyto(copy_target, values)  # its pages mapped before the first timed copy
    times = StoreTimes()
    for run in range(repeats + 1):
        namespace = 1000 + run
        keys = list(range(namespace << 20, (namespace << 20) + count))
        parents = [namespace, *keys[:-1]]
        started = time.perf_counter()
        stored = client.put(namespace, keys, parents, values)
        put_s = time.perf_counter() - started
        pool[:] = 0
        started = time.perf_counter()
        landed = client.fetch(namespace, keys, pool, list(range(count)))
        fetch_s = time.perf_counter() - started
        started = time.perf_counter()
        np.copyto(copy_target, values)
        memcpy_s = time.perf_counter() - started
        if stored != count or landed != count or not np.array_equal(pool, expected):
            raise RuntimeError(f"store run {run}: stored {stored}, landed {landed} of {count}, or bytes differ")
        client.remove(namespace, keys[:1])
        if run:  # the first run warms up
            times.put_s.append(put_s)
            times.fetch_s.append(fetch_s)
            times.memcpy_s.append(memcpy_s)
    return times


def ssd_seconds(directory: Path, values: np.ndarray, repeats: int, raw: RawFile) -> dict[str, list[float]]:
    """Seconds per run of the SSD tier itself, "write" (one record per block, each with its
    header and CRC32C, then a sync: durable, as the raw write's fsync) and "read" (every
    record's CRC checked), and of a read of the raw file right after each tier read."""
    from services.kvstore.ssd import SsdTier
    from services.kvstore.tiers import ssd_config

    count, block_bytes = values.shape
    config = ssd_config(directory / "ssd", 2 * count * (block_bytes + 4096) / 1e9, block_bytes)
    times: dict[str, list[float]] = {"write": [], "read": [], "raw_read": []}
    with SsdTier(config) as tier:
        for run in range(repeats + 1):
            namespace = (run + 1).to_bytes(8, "little")
            started = time.perf_counter()
            slots = [tier.write(namespace, key, memoryview(values[key])) for key in range(count)]
            tier.sync()
            write_s = time.perf_counter() - started
            started = time.perf_counter()
            payloads = [tier.read(slot)[2] for slot in slots]
            read_s = time.perf_counter() - started
            raw_read_s = seconds(raw.read)
            if any(payload != values[key].tobytes() for key, payload in enumerate(payloads)):
                raise RuntimeError("an SSD record read back differs")
            for slot in slots:
                tier.free(slot)
            if run:
                times["write"].append(write_s)
                times["read"].append(read_s)
                times["raw_read"].append(raw_read_s)
    return times


def throughput(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    from common.engine.checkpoint import load_model_config
    from common.engine.kv_layout import KVLayout

    layout = KVLayout.for_model(load_model_config(model_dir), 16, "bfloat16")
    values = np.random.default_rng(2).integers(0, 256, (args.blocks, layout.bytes_per_block), dtype=np.uint8)
    num_bytes = values.nbytes
    figures: dict[str, object] = {"bytes": num_bytes, "blocks": args.blocks, "block_bytes": layout.bytes_per_block}
    with tempfile.TemporaryDirectory(prefix="bench-kvstore-") as scratch_name:
        scratch = Path(scratch_name)
        raw = RawFile(scratch, num_bytes)
        figures["file_write_gbps"] = gbps(num_bytes, median_seconds(raw.write, args.repeats))
        ssd = ssd_seconds(scratch, values, args.repeats, raw)
        figures.update(ssd_put_gbps=gbps(num_bytes, statistics.median(ssd["write"])),
                       ssd_get_gbps=gbps(num_bytes, statistics.median(ssd["read"])),
                       file_read_gbps=gbps(num_bytes, statistics.median(ssd["raw_read"])),
                       ssd_get_vs_file_read=statistics.median(f / t for f, t in zip(ssd["raw_read"], ssd["read"])))
        store = StoreProcess(model_dir, scratch, kvstore_dram_gb=3 * num_bytes / 1e9)
        memcpy_s: list[float] = []
        try:
            for name, shared_memory in (("dram", True), ("frames", False), ("transport", False)):
                pool = np.zeros(values.size, dtype=np.uint8)
                transport = store.transport(layout, pool) if name == "transport" else None
                client = store.client(layout, shared_memory, transport)
                try:
                    times = store_seconds(client, values, args.repeats, pool)
                    if client.same_host != shared_memory or client.pulls != (transport is not None):
                        raise RuntimeError(f"{name}: the client's same_host is {client.same_host}, "
                                           f"pulls {client.pulls}")
                finally:
                    client.close()
                    if transport is not None:
                        transport.close()
                if name != "transport":  # its puts are the frames' puts
                    figures[f"{name}_put_gbps"] = gbps(num_bytes, statistics.median(times.put_s))
                figures[f"{name}_get_gbps"] = gbps(num_bytes, statistics.median(times.fetch_s))
                memcpy_s += times.memcpy_s
                if name == "dram":
                    figures["dram_get_vs_memcpy"] = times.fetch_vs_memcpy()
        finally:
            store.stop()
    figures["memcpy_gbps"] = gbps(num_bytes, statistics.median(memcpy_s))
    return figures


def print_throughput(figures: dict) -> None:
    print(f"part 1: {figures['blocks']} blocks of {figures['block_bytes']} bytes ({figures['bytes'] / 1e6:.1f} MB)")
    for name in ("memcpy", "file_write", "file_read", "dram_put", "dram_get", "frames_put", "frames_get",
                 "transport_get", "ssd_put", "ssd_get"):
        print(f"  {name:<14}{figures[f'{name}_gbps']:>8.2f} GB/s")
    print(f"  dram get / memcpy {figures['dram_get_vs_memcpy']:.2f} (target >= 0.5); "
          f"ssd get / file read {figures['ssd_get_vs_file_read']:.2f} (target >= 0.5)")


# ---- parts 2 and 3: real clusters ----------------------------------------------------------

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Served:
    """One `svc up` cluster (one worker) and an SDK client to it; `stop` ends both."""

    def __init__(self, name: str, model_dir: Path, flags: list[str], kvstore: bool):
        from services.client import Client
        from services.local_cluster import start_cluster

        self.name = name
        self.cluster = start_cluster(model_dir, workers=1, extra=flags, kvstore=kvstore, timeout_s=300)
        self.client = Client(self.cluster.sdk, timeout_s=900)

    def generate(self, prompt: list[int], max_tokens: int = 1):
        return self.client.generate(token_ids=prompt, max_tokens=max_tokens, **GREEDY)

    def metric(self, name: str, **labels: str) -> float:
        """Worker 0's counter (0 until first counted)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.cluster.port_base + 11}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))

    def wait_written(self, blocks: float) -> None:
        """Until the worker has written back at least `blocks` blocks (write-back is asynchronous)."""
        self.cluster.wait_for(lambda: self.metric("baton_worker_kvstore_written_blocks_total") >= blocks, 300,
                              f"{self.name}: {blocks} blocks written back")

    def stop(self) -> None:
        self.client.close()
        self.cluster.stop()


def random_prompts(model_dir: Path, lengths: list[int], seed: int) -> list[list[int]]:
    from common.engine.checkpoint import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, length).tolist() for length in lengths]


def fetch_vs_recompute(args: argparse.Namespace, model_dir: Path, scratch: Path) -> dict[str, object]:
    """TTFT of a prompt held only by the store (DRAM; SSD) against recomputing it, at
    --prompt-tokens and at a short length, each cluster up at once, requests alternating."""
    from common.engine.checkpoint import load_model_config
    from common.engine.kv_layout import KVLayout

    model = load_model_config(model_dir)
    long = min(args.prompt_tokens, model.context_limit - 1)  # one token of room to answer
    short = 256
    layout = KVLayout.for_model(model, 16, "bfloat16")
    pool_gb = (long // 16 + 24) * layout.bytes_per_block / 1e9  # one long prompt and a little more
    common = ["--max-model-len", str(min(long + 64, model.context_limit)), "--kv-cache-gb", f"{pool_gb:.6f}",
              "--kvstore-fetch", "always", "--kvstore-timeout-s", "60", "--kvstore-writeback-queue-blocks", "1024",
              "--first-token-timeout-s", "1800", "--request-timeout-s", "3600",  # long prefills on a busy machine
              "--worker-stall-timeout-s", "900"]  # one 2,048-token step of `small` can outlast the 30 s default
    prompt_gb = (long // 16) * layout.bytes_per_block / 1e9
    runs = {"recompute": Served("recompute", model_dir, common, kvstore=False),
            "dram": Served("dram", model_dir, [*common, "--kvstore-dram-gb", f"{4 * prompt_gb:.6f}"], kvstore=True),
            "ssd": Served("ssd", model_dir, [*common, "--kvstore-dram-gb", f"{0.5 * prompt_gb:.6f}",
                                               "--kvstore-ssd-dir", str(scratch / "ssd"),
                                               "--kvstore-ssd-gb", f"{6 * prompt_gb:.6f}"], kvstore=True)}
    ttft: dict[str, dict[int, float]] = {name: {} for name in runs}
    cached: dict[str, dict[int, int]] = {name: {} for name in runs}
    try:
        short_prompt, long_prompt, filler_a, filler_b = random_prompts(model_dir, [short, long, long, long], 5)
        prompts = {short: short_prompt, long: long_prompt}
        for served in runs.values():  # both computed once, then pushed out of the worker's pool
            for prompt in (short_prompt, long_prompt, filler_a, filler_b):
                served.generate(prompt)
        for name in ("dram", "ssd"):  # every block but filler_b's is written back
            runs[name].wait_written(short // 16 + 2 * (long // 16))
        for length in (short, long):
            for name, served in runs.items():
                result = served.generate(prompts[length])
                ttft[name][length], cached[name][length] = result.ttft_s, result.num_cached_tokens
            if cached["recompute"][length]:
                raise RuntimeError(f"the {length}-token prompt was still in the worker's own cache "
                                   f"({cached['recompute'][length]} tokens): the comparison would be void")
        # Fetched blocks join the worker's prefix cache: the same prompt again is the floor a
        # fetch is measured against (the same last tokens computed, nothing fetched).
        engine_hit = {name: runs[name].generate(long_prompt).ttft_s for name in ("dram", "ssd")}
        time.sleep(2.0)  # worker metrics follow its load reports
        tiers = {name: {tier: runs[name].metric("baton_worker_kvstore_fetched_blocks_total", tier=tier)
                        for tier in ("dram", "ssd")} for name in ("dram", "ssd")}
    finally:
        for served in runs.values():
            served.stop()
    speedup = {name: ttft["recompute"][long] / ttft[name][long] for name in ("dram", "ssd")}
    fetch_cost = {name: ttft[name][long] - engine_hit[name] for name in ("dram", "ssd")}
    fetched_bytes = (cached["dram"][long] // 16) * layout.bytes_per_block
    return {"ttft_s": ttft, "cached_tokens": cached, "fetched_blocks_by_tier": tiers,
            "engine_hit_ttft_s": engine_hit, "fetch_cost_s": fetch_cost,
            "fetch_cost_gbps": {name: fetched_bytes / cost / 1e9 if cost > 0 else None  # within noise of free
                                for name, cost in fetch_cost.items()},
            "fetch_vs_recompute_speedup": speedup,
            "fetch_loses_below_tokens": {name: break_even(ttft[name], ttft["recompute"]) for name in ("dram", "ssd")}}


def break_even(fetch: dict[int, float], recompute: dict[int, float]) -> float:
    """The prompt length below which fetching loses, from straight lines through the two
    measured lengths of each (TTFT = fixed + per-token); 0 when fetching wins at every length."""
    (short, long) = sorted(fetch)
    fetch_slope = (fetch[long] - fetch[short]) / (long - short)
    compute_slope = (recompute[long] - recompute[short]) / (long - short)
    fetch_fixed = fetch[short] - fetch_slope * short
    compute_fixed = recompute[short] - compute_slope * short
    if fetch_fixed <= compute_fixed or compute_slope <= fetch_slope:
        return 0.0 if compute_slope > fetch_slope else float("inf")
    return (fetch_fixed - compute_fixed) / (compute_slope - fetch_slope)


def print_fetch(figures: dict) -> None:
    print("part 2: TTFT of a prompt only the store holds, against recomputing it")
    for length in sorted(figures["ttft_s"]["recompute"]):
        row = "  ".join(f"{name} {figures['ttft_s'][name][length] * 1000:8.1f} ms "
                        f"({figures['cached_tokens'][name][length]} cached)" for name in ("recompute", "dram", "ssd"))
        print(f"  {length:>5} tokens: {row}")
    print(f"  fetched blocks by tier: {figures['fetched_blocks_by_tier']}")
    def rate(gbps: float | None) -> str:
        return "no measurable cost" if gbps is None else f"{gbps:.2f} GB/s"

    print("  the long prompt again, from the worker's own cache: " + ", ".join(
        f"{name} {figures['engine_hit_ttft_s'][name] * 1000:.1f} ms (the fetch cost "
        f"{figures['fetch_cost_s'][name] * 1000:.1f} ms, {rate(figures['fetch_cost_gbps'][name])})"
        for name in ("dram", "ssd")))
    print(f"  fetch_vs_recompute_speedup {figures['fetch_vs_recompute_speedup']}; "
          f"fetching loses below {figures['fetch_loses_below_tokens']} tokens")


def multi_turn(args: argparse.Namespace, scratch: Path) -> dict[str, object]:
    """Chat sessions taking turns on the tiny model, with a pool of about two sessions;
    then prompts never reused. Both clusters up at once, requests alternating."""
    from common.engine.default_model import default_model_dir

    model_dir = default_model_dir(size="tiny")
    turn_tokens, answer_tokens = 192, 16
    max_len = args.turns * (turn_tokens + answer_tokens) + 64
    flags = ["--max-model-len", str(max_len), "--kv-cache-gb", "0.0025", "--kvstore-dram-gb", "0.008",
             "--kvstore-ssd-dir", str(scratch / "chat-ssd"), "--kvstore-ssd-gb", "0.05"]
    runs = {"store": Served("store", model_dir, flags, kvstore=True),
            "no_store": Served("no_store", model_dir, flags, kvstore=False)}
    rng_seed = 11
    records: dict[str, list] = {name: [] for name in runs}
    unique: dict[str, list[float]] = {name: [] for name in runs}
    try:
        histories = {name: [[] for _ in range(args.sessions)] for name in runs}
        for turn in range(args.turns):
            for session in range(args.sessions):
                user = random_prompts(model_dir, [turn_tokens], rng_seed + 97 * session + turn)[0]
                for name, served in runs.items():
                    prompt = histories[name][session] + user
                    result = served.generate(prompt, max_tokens=answer_tokens)
                    histories[name][session] = prompt + result.token_ids
                    if turn:  # first turns have nothing to reuse
                        records[name].append(result)
        time.sleep(2.0)  # worker metrics follow its load reports
        fetched = {tier: runs["store"].metric("baton_worker_kvstore_fetched_blocks_total", tier=tier) * 16
                   for tier in ("dram", "ssd")}
        for index, prompt in enumerate(random_prompts(model_dir, [turn_tokens * 2] * 24, 1234)):
            order = list(runs.items()) if index % 2 else list(runs.items())[::-1]
            for name, served in order:
                unique[name].append(served.generate(prompt).ttft_s)
    finally:
        for served in runs.values():
            served.stop()
    report: dict[str, object] = {}
    for name, results in records.items():
        prompt_tokens = sum(r.num_prompt_tokens for r in results)
        cached = sum(r.num_cached_tokens for r in results)
        from_store = fetched if name == "store" else {"dram": 0.0, "ssd": 0.0}
        engine = cached - sum(from_store.values())
        report[name] = {"mean_ttft_ms": 1000 * statistics.mean(r.ttft_s for r in results),
                        "hit_rate": {"engine": engine / prompt_tokens,
                                     **{tier: tokens / prompt_tokens for tier, tokens in from_store.items()},
                                     "computed": 1 - cached / prompt_tokens}}
    report["ttft_ratio_store_vs_none"] = report["store"]["mean_ttft_ms"] / report["no_store"]["mean_ttft_ms"]  # type: ignore[index]
    report["no_reuse_overhead"] = statistics.median(unique["store"]) / statistics.median(unique["no_store"])
    return report


def print_multi_turn(figures: dict) -> None:
    print("part 3: multi-turn chat, working set over the engine's pool")
    for name in ("store", "no_store"):
        rates = "  ".join(f"{tier} {rate:.1%}" for tier, rate in figures[name]["hit_rate"].items())
        print(f"  {name:<9} mean TTFT {figures[name]['mean_ttft_ms']:7.1f} ms   {rates}")
    print(f"  TTFT with the store / without {figures['ttft_ratio_store_vs_none']:.3f}; "
          f"no-reuse overhead {figures['no_reuse_overhead']:.3f} (target <= 1.03)")


def main(argv: list[str] | None = None) -> int:
    from common.engine.default_model import default_model_dir
    from common.logs import configure_logging

    args = parse_args(argv)
    configure_logging("warning")
    parts = args.parts.split(",")
    model_dir = default_model_dir(size=args.model)
    result: dict[str, object] = {"model": args.model}
    if "throughput" in parts:
        figures = throughput(args, model_dir)
        print_throughput(figures)
        result.update(figures)
    with tempfile.TemporaryDirectory(prefix="bench-kvstore-") as scratch_name:
        if "fetch" in parts:
            figures = fetch_vs_recompute(args, model_dir, Path(scratch_name))
            print_fetch(figures)
            result.update(figures)
        if "multiturn" in parts:
            figures = multi_turn(args, Path(scratch_name))
            print_multi_turn(figures)
            result["multi_turn"] = figures
            result["no_reuse_overhead"] = figures["no_reuse_overhead"]
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
