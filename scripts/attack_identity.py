"""Try to speak for a live engine, as a holder of an engine key (CURVE on) or anyone on
loopback (CURVE off) would, on a real cluster, and print what the clients got.

    PYTHONPATH=. .venv/bin/python scripts/attack_identity.py [--requests 20] [--modes curve,plain]

Each mode starts `svc up --workers 2 --prefill 1 --decode 1` on the tiny model
(docs/architecture.md §3) and runs:
- takeover: an impostor on its own connection keeps sending a Hello naming decode-3 (the
  engines' real fingerprints; under CURVE, the decode key) while REQUESTS requests run,
  then leaves and REQUESTS more run at once;
- stopped: worker-1 is SIGSTOPped while the impostor heartbeats in its name; REQUESTS
  requests run; the time until the router drops worker-1 is printed.
Each case prints sent, served, typed errors and lost (no answer within the client's
deadline), the Generates the impostor received and the Hellos the router refused.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from common.engine.checkpoint import fingerprints  # noqa: E402
from common.protocol import PROTOCOL_VERSION, Generate, Heartbeat, Hello, decode, encode  # noqa: E402
from common.sockets import load_curve_keys  # noqa: E402
from services.client import BatonError, Client, RequestTimeout, curve_keys  # noqa: E402
from services.local_cluster import child_env, start_cluster  # noqa: E402

FLAGS = ["--kv-cache-gb", "0.05", "--max-model-len", "1024", "--heartbeat-interval-s", "0.2",
         "--worker-timeout-s", "1.5", "--profile", "tiny-cpu", "--max-local-prefill-tokens", "0"]
CLIENT_DEADLINE_S = 40.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--modes", default="curve,plain")
    args = parser.parse_args()
    from common.engine.default_model import write_default_model

    scratch = Path(tempfile.mkdtemp(prefix="attack_identity-"))
    model = write_default_model(scratch / "tiny", size="tiny", seed=0)
    print(f"{'mode':<6} {'case':<22} {'sent':>5} {'served':>7} {'typed':>6} {'lost':>5}  notes")
    for mode in args.modes.split(","):
        keys = _keys(scratch / mode) if mode == "curve" else None
        extra = ["--config", str(keys.parent / "cluster.toml")] if keys else []
        cluster = start_cluster(model, workers=2, prefill=1, decode=1, extra=FLAGS + extra)
        try:
            _takeover(mode, cluster, keys, model, args.requests)
            _stopped(mode, cluster, keys, args.requests)
        finally:
            cluster.stop()


def _keys(directory: Path) -> Path:
    keys = directory / "keys"
    subprocess.run([sys.executable, "-m", "services.cli", "keys", "generate", str(keys)], check=True,
                   capture_output=True, cwd=REPO, env=child_env())
    (directory / "cluster.toml").write_text(f'curve_enabled = true\ncurve_keys_dir = "{keys}"\n')
    return keys


class Impostor:
    def __init__(self, cluster, keys: Path | None, role: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            own = load_curve_keys(keys, role)
            self.socket.curve_serverkey = own.public_of("router")
            self.socket.curve_publickey, self.socket.curve_secretkey = own.public, own.secret
        self.socket.connect(cluster.router)
        self.generates = 0

    def send(self, message) -> None:
        self.socket.send_multipart(encode(message), flags=zmq.NOBLOCK)

    def drain(self) -> None:
        while self.socket.poll(0):
            message, _ = decode(self.socket.recv_multipart())
            self.generates += isinstance(message, Generate)

    def close(self) -> None:
        self.context.destroy(linger=0)


def _run(cluster, keys: Path | None, count: int, tag: str, while_running=None) -> tuple[int, int, int]:
    """(served, typed errors, lost) of `count` concurrent requests; `while_running()` is
    called every 0.1 s until they end."""
    def one(n: int) -> str:
        try:
            with Client(cluster.sdk, curve=curve_keys(keys) if keys else None, timeout_s=CLIENT_DEADLINE_S) as client:
                client.generate(f"{tag} {n} " * 20, max_tokens=8, temperature=0.0, ignore_eos=True)
            return "served"
        except RequestTimeout:
            return "lost"
        except BatonError:
            return "typed"
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one, n) for n in range(count)]
        while not all(f.done() for f in futures):
            if while_running is not None:
                while_running()
            time.sleep(0.1)
        outcomes = [f.result() for f in futures]
    return outcomes.count("served"), outcomes.count("typed"), outcomes.count("lost")


def _refused(cluster, message: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port_base + 3}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f'baton_router_identity_refused_total{{message="{message}"}}'):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _row(mode: str, case: str, sent: int, outcome: tuple[int, int, int], notes: str) -> None:
    served, typed, lost = outcome
    print(f"{mode:<6} {case:<22} {sent:>5} {served:>7} {typed:>6} {lost:>5}  {notes}", flush=True)


def _takeover(mode: str, cluster, keys: Path | None, model: Path, count: int) -> None:
    fingerprint, tokenizer = fingerprints(model)
    hello = Hello(protocol_version=PROTOCOL_VERSION, worker_id="decode-3", role="decode",
                  model_fingerprint=fingerprint, tokenizer_fingerprint=tokenizer, kv_blocks=1_000_000,
                  block_size=16, max_model_len=1024, kv_dtype="bfloat16", events_address="tcp://127.0.0.1:1",
                  metrics_address="", instance_id=uuid.uuid4().hex)
    impostor = Impostor(cluster, keys, "decode")

    def knock() -> None:
        impostor.send(hello)
        impostor.drain()
    try:
        outcome = _run(cluster, keys, count, "takeover", knock)
        impostor.drain()
        _row(mode, "impostor Hello decode-3", count, outcome,
             f"impostor got {impostor.generates} Generates; router refused {_refused(cluster, 'Hello')} Hellos")
    finally:
        impostor.close()
    started = time.monotonic()
    outcome = _run(cluster, keys, count, "after")
    _row(mode, "after it left", count, outcome, f"all ended in {time.monotonic() - started:.1f} s")


def _stopped(mode: str, cluster, keys: Path | None, count: int) -> None:
    pid = cluster.worker_health(1)["pid"]
    impostor = Impostor(cluster, keys, "worker")
    seq = [0]
    dropped: dict[str, float] = {}

    def beat() -> None:
        seq[0] += 1
        impostor.send(Heartbeat(worker_id="worker-1", running=0, waiting=0, kv_blocks_used=0, kv_blocks_cached=0,
                                kv_blocks_total=100, seq=seq[0], session=uuid.uuid4().hex))
        impostor.drain()
        if "at" not in dropped and cluster.router_health().get("workers") == 3:
            dropped["at"] = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        outcome = _run(cluster, keys, count, "stopped", beat)
        while "at" not in dropped and time.monotonic() - stopped < 30:
            beat()
            time.sleep(0.1)
        detect = f"{dropped['at'] - stopped:.1f} s" if "at" in dropped else "never"
        _row(mode, "SIGSTOP + forged beats", count, outcome,
             f"worker-1 dropped after {detect}; {_refused(cluster, 'Heartbeat')} beats refused")
    finally:
        os.kill(pid, signal.SIGCONT)
        impostor.close()


if __name__ == "__main__":
    main()
