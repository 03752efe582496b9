"""Benchmark KV transfer between two processes over each available transport, beside memcpy.

The pools are KVCaches of the engine's layout (the embedded model's --model size, bf16,
--block-size tokens per block), on --device: the CPU by default, or a GPU (`cuda`: UCX
moves GPU memory in place, ZeroMQ stages it through host memory). A server process
exposes consecutive blocks 0..n-1 of its pool (random bytes); this process pulls them
into its blocks 0..n-1 through the real KvTransport (handshake done first, untimed), and
times each pull from `pull()` to its result. Sizes run from 64 KiB to 64 MiB (whole
blocks). Every repetition runs each transport and a memcpy (numpy copyto of the same
byte count, flat, in this process; on a GPU a synchronised device-to-device copy) in
turn, so that load from elsewhere on the machine falls on all of them alike; the first
repetition of each size is a warm-up and not counted. Figures are medians: GB/s = bytes
/ median seconds, latency = median seconds, ratio_vs_memcpy = GB/s over memcpy's GB/s at
the same size. Every pull's bytes are checked against the server's after the run.

    PYTHONPATH=. .venv/bin/python scripts/bench_transfer.py
    PYTHONPATH=. .venv/bin/python scripts/bench_transfer.py --json --repeats 9
    PYTHONPATH=. python scripts/bench_transfer.py --device cuda     (scripts/check_cuda.sh)

With --json the last line is one object: memcpy_gbps and, per transport (ucx, zmq),
gbps and ratio_vs_memcpy at the largest size and a by_size table.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time

import numpy as np

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
SERVER_SEED = 3
ANSWER_TIMEOUT_S = 120.0
PULL_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--transports", default="ucx,zmq", help="comma-separated; unavailable ones are skipped")
    parser.add_argument("--repeats", type=int, default=7, help="timed pulls per size and transport (+1 warm-up)")
    parser.add_argument("--model", default="tiny", help="embedded model size whose KV layout is used")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="where both pools live: cpu, cuda or cuda:N")
    parser.add_argument("--piece-kib", type=int, default=0,
                        help="largest message (UCX) or frame (ZeroMQ); 0: each transport's default (4096, 1024)")
    return parser.parse_args(argv)


def make_pool(model: str, block_size: int, num_bytes: int, seed: int | None, device: str = "cpu"):
    """(flat uint8 view, geometry, cache) of a KVCache with at least num_bytes of blocks:
    the view is a numpy array on the CPU, a tensor on a GPU (pool_bytes)."""
    import torch

    from common.engine.default_model import model_config
    from common.engine.kv_cache import KVCache, KVLayout
    from common.kv_transfer import PoolGeometry, pool_bytes

    layout = KVLayout.for_model(model_config(model), block_size, "bfloat16")
    num_blocks = -(-num_bytes // layout.bytes_per_block)
    cache = KVCache(layout, num_blocks, torch.device(device))
    flat = pool_bytes(cache)
    if seed is not None:
        data = np.random.default_rng(seed).integers(0, 256, flat.nbytes, dtype=np.uint8)
        if isinstance(flat, np.ndarray):
            flat[:] = data
        else:
            flat.copy_(torch.from_numpy(data))
    return flat, PoolGeometry(layout, num_blocks), cache


def host(flat) -> np.ndarray:
    """A pool's bytes as numpy (a copy of a GPU pool's)."""
    return flat if isinstance(flat, np.ndarray) else flat.cpu().numpy()


def _security():
    import zmq

    from common.config import ClusterConfig
    from common.sockets import Security

    return Security(zmq.Context.instance(), ClusterConfig(), "decode")


def options(piece_kib: int):
    from common.kv_transfer import TransferOptions

    return TransferOptions(max_piece_bytes=piece_kib << 10, message_bytes=1 << 20)


def serve(conn, transport: str, model: str, block_size: int, pool_bytes_needed: int, piece_kib: int,
          device: str) -> None:
    """The server process: expose what the parent asks for until told to stop."""
    from common.kv_transfer import make_transport
    from common.logs import configure_logging

    configure_logging("warning")
    flat, geometry, _keep_alive = make_pool(model, block_size, pool_bytes_needed, SERVER_SEED, device)
    server = make_transport(transport, flat, geometry, "bench", _security(), f"bench-{transport}-server",
                            options(piece_kib))
    conn.send(server.listen("tcp://127.0.0.1:0"))
    while True:
        command, *args = conn.recv()
        if command == "stop":
            server.close()
            conn.send("stopped")
            return
        server.expose(*args)
        while server.next_event(0) is not None:  # ended exposures: nothing to free in a benchmark
            pass
        conn.send("ok")


class Pair:
    """A server process and this process's puller, for one transport."""

    def __init__(self, transport: str, args: argparse.Namespace):
        from common.kv_transfer import make_transport

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, transport, args.model, args.block_size,
                                                           max(SIZES), args.piece_kib, args.device), daemon=True)
        self.process.start()
        self.flat, self.geometry, self.cache = make_pool(args.model, args.block_size, max(SIZES), None, args.device)
        self.transport = make_transport(transport, self.flat, self.geometry, "bench", _security(),
                                        f"bench-{transport}-puller", options(args.piece_kib))
        self.name = self.transport.name
        self.model, self.block_size = args.model, args.block_size
        self.peer = self.transport.connect(self._answer())
        self.pulls = 0

    def _answer(self):
        if not self.conn.poll(ANSWER_TIMEOUT_S):
            raise TimeoutError("the server process did not answer")
        return self.conn.recv()

    def pull_seconds(self, num_blocks: int) -> float:
        blocks = list(range(num_blocks))
        transfer_id = f"bench-{self.pulls}"
        self.pulls += 1
        self.conn.send(("expose", transfer_id, blocks, PULL_TIMEOUT_S))
        self._answer()
        started = time.perf_counter()
        result = self.transport.pull(self.peer, transfer_id, blocks, blocks,
                                     time.monotonic() + PULL_TIMEOUT_S).wait(PULL_TIMEOUT_S)
        seconds = time.perf_counter() - started
        if result.status != "done":
            raise RuntimeError(f"{self.name} pull of {num_blocks} blocks ended {result.status}: {result.reason}")
        return seconds

    def check_bytes(self, num_blocks: int) -> None:
        """The pulled blocks equal the server's (its pool is reproducible from the seed)."""
        source, geometry, _ = make_pool(self.model, self.block_size, max(SIZES), SERVER_SEED)
        pulled = host(self.flat)
        for plane in range(geometry.num_planes):
            start, end = geometry.offset(plane, 0), geometry.offset(plane, num_blocks)
            if not np.array_equal(pulled[start:end], source[start:end]):
                raise RuntimeError(f"{self.name}: pulled bytes differ from the source in plane {plane}")

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
            self._answer()
        finally:
            self.transport.close()
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()


def memcpy_seconds(source: np.ndarray, target: np.ndarray, num_bytes: int) -> float:
    started = time.perf_counter()
    np.copyto(target[:num_bytes], source[:num_bytes])
    return time.perf_counter() - started


def available(names: list[str]) -> list[str]:
    from common.kv_transfer import ucx_available

    reason = ucx_available()
    if "ucx" in names and reason is not None:
        print(f"ucx skipped: {reason}", file=sys.stderr)
        names = [name for name in names if name != "ucx"]
    return names


def device_copy(device: str):
    """memcpy's counterpart on a GPU: seconds(num_bytes) of a synchronised device-to-device copy."""
    import torch

    source = torch.randint(0, 256, (max(SIZES),), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)

    def seconds(num_bytes: int) -> float:
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        target[:num_bytes].copy_(source[:num_bytes])
        torch.cuda.synchronize(device)
        return time.perf_counter() - started

    return seconds


def host_copy():
    """seconds(num_bytes) of memcpy between two host buffers like the pools."""
    from common.kv_transfer.memory import advise_huge_pages

    source = np.random.default_rng(0).integers(0, 256, max(SIZES), dtype=np.uint8)
    target = np.zeros_like(source)
    for buffer in (source, target):  # the same kind of memory as the pools' (see memory.py)
        advise_huge_pages(buffer)
    return lambda num_bytes: memcpy_seconds(source, target, num_bytes)


def measure(pairs: list[Pair], geometry, repeats: int, device: str = "cpu") -> dict[str, dict[int, list[float]]]:
    """Seconds per (transport or memcpy, size), interleaved within each repetition."""
    copy_seconds = host_copy() if device == "cpu" else device_copy(device)
    times: dict[str, dict[int, list[float]]] = {name: {} for name in ["memcpy", *(p.name for p in pairs)]}
    for size in SIZES:
        num_blocks = size // geometry.bytes_per_block
        for repeat in range(repeats + 1):
            samples = {"memcpy": copy_seconds(size)}
            for pair in pairs:
                samples[pair.name] = pair.pull_seconds(num_blocks)
            if repeat:  # the first round warms up pages and UCX's protocol selection
                for name, seconds in samples.items():
                    times[name].setdefault(size, []).append(seconds)
    return times


def summarise(times: dict[str, dict[int, list[float]]]) -> dict:
    memcpy = {size: size / statistics.median(samples) / 1e9 for size, samples in times["memcpy"].items()}
    largest = max(SIZES)
    report = {"memcpy_gbps": round(memcpy[largest], 3),
              "memcpy_by_size": {str(size): round(gbps, 3) for size, gbps in memcpy.items()}}
    for name, by_size in times.items():
        if name == "memcpy":
            continue
        table = {}
        for size, samples in by_size.items():
            median = statistics.median(samples)
            gbps = size / median / 1e9
            table[str(size)] = {"gbps": round(gbps, 3), "latency_ms": round(median * 1e3, 3),
                                "ratio_vs_memcpy": round(gbps / memcpy[size], 3)}
        report[name] = {"gbps": table[str(largest)]["gbps"],
                        "ratio_vs_memcpy": table[str(largest)]["ratio_vs_memcpy"], "by_size": table}
    return report


def print_table(report: dict, transports: list[str], geometry, repeats: int) -> None:
    print(f"KV layout: {geometry.layout.num_layers} layers x K,V; {geometry.plane_block_bytes} B per block and plane, "
          f"{geometry.bytes_per_block} B per block; medians of {repeats} pulls")
    print(f"{'size':>9} {'memcpy GB/s':>12} " + " ".join(f"{name + ' GB/s':>10} {'ms':>8} {'ratio':>6}"
                                                        for name in transports))
    for size in SIZES:
        row = f"{_size(size):>9} {report['memcpy_by_size'][str(size)]:>12.2f} "
        for name in transports:
            cell = report[name]["by_size"][str(size)]
            row += f"{cell['gbps']:>10.2f} {cell['latency_ms']:>8.2f} {cell['ratio_vs_memcpy']:>6.2f} "
        print(row)


def _size(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.logs import configure_logging

    configure_logging("warning")
    names = available([name for name in args.transports.split(",") if name])
    pairs = []
    try:
        for name in names:
            pairs.append(Pair(name, args))
        geometry = pairs[0].geometry if pairs else make_pool(args.model, args.block_size, max(SIZES), None)[1]
        times = measure(pairs, geometry, args.repeats, args.device)
        for pair in pairs:
            pair.check_bytes(max(SIZES) // geometry.bytes_per_block)
    finally:
        for pair in pairs:
            pair.close()
    report = summarise(times)
    report["device"] = args.device
    print_table(report, [pair.name for pair in pairs], geometry, args.repeats)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
