"""Start a real `svc up` cluster on loopback as a child process, wait until it serves,
and stop it: what the tests and the serving benchmark use."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).parents[1]
PORTS_PER_CLUSTER = 64  # up to port_base + 55 (KV transfer ports), the HTTP port last
LOWEST_PORT = 10000  # below it sit well-known services' ports


def free_port_base() -> int:
    """A base such that the cluster's ports (base..base+PORTS_PER_CLUSTER) are free, below
    the kernel's ephemeral range: a port in it can be taken between this check and the
    bind by any outgoing connection's source port (another test's client, say), and stay
    taken as long as that connection lives; a tokenizer then died on bind in a loop."""
    low, _ = ephemeral_ports()
    first, last = LOWEST_PORT, max(low, LOWEST_PORT + 10 * PORTS_PER_CLUSTER) - PORTS_PER_CLUSTER
    for _ in range(200):
        base = random.randrange(first, last)
        if all(_port_free(base + offset) for offset in range(PORTS_PER_CLUSTER)):
            return base
    raise RuntimeError("no free port range found")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where
    it cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Cluster:
    process: subprocess.Popen
    port_base: int
    http_port: int
    workers: int
    lines: list[str] = field(default_factory=list)

    @property
    def sdk(self) -> str:
        return f"tcp://127.0.0.1:{self.port_base + 1}"

    @property
    def router(self) -> str:
        return f"tcp://127.0.0.1:{self.port_base}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def worker_health(self, index: int) -> dict:
        return _health(self.port_base + 11 + 2 * index)

    def worker_metrics_url(self, index: int) -> str:
        """Where engine `index` serves /metrics (and /health, above)."""
        return f"http://127.0.0.1:{self.port_base + 11 + 2 * index}/metrics"

    def router_health(self) -> dict:
        return _health(self.port_base + 3)

    def kvstore_health(self) -> dict:
        return _health(self.port_base + 6)

    def wait_for(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = predicate()
                if value:
                    return value
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")

    def stop(self) -> None:
        stop_process(self.process, signal.SIGINT)


def stop_process(process: subprocess.Popen, signum: int = signal.SIGTERM) -> None:
    """Send `signum` to a child still running, then SIGKILL if it has not exited in 15 s."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _health(port: int) -> dict:
    """A role's /health answer, whether ok (200) or not (503)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        if error.code != 503:
            raise
        return json.loads(error.read())


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a child Python that must import this checkout: the repo first on
    PYTHONPATH, the caller's entries kept after it (wheels unpacked beside a system torch,
    say, as scripts/check_cuda.sh runs; replacing them hid those packages), plus `extra`
    (whose PYTHONPATH, if it gives one, comes after the repo's instead of the caller's)."""
    pythonpath = extra.pop("PYTHONPATH", os.environ.get("PYTHONPATH"))
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), pythonpath])))


def start_cluster(model_dir: Path, workers: int = 1, extra: list[str] | None = None,
                  timeout_s: float = 120.0, env: dict[str, str] | None = None, prefill: int = 0,
                  decode: int = 0, kvstore: bool = False) -> Cluster:
    """`svc up` on free loopback ports; `extra` flags go to `svc up` as they are, `env`
    (BATON_* variables, say) into its environment. Engines are numbered workers first,
    then prefill, then decode workers. With `kvstore` the cluster runs its KV store (as
    `svc up` does by default) and the engines use it."""
    base = free_port_base()
    http_port = base + PORTS_PER_CLUSTER - 1
    pools = ["--prefill", str(prefill), "--decode", str(decode)] if prefill or decode else []
    if not kvstore:
        pools.append("--no-kvstore")
    argv = [sys.executable, "-m", "services.cli", "up", "--workers", str(workers), *pools, "--port-base", str(base),
            "--http-port", str(http_port), "--model", str(model_dir), *(extra or [])]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=child_env(PYTHONUNBUFFERED="1", **(env or {})),
                               cwd=REPO, start_new_session=True)
    cluster = Cluster(process, base, http_port, workers + prefill + decode)
    up = threading.Event()

    def read() -> None:
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            cluster.lines.append(line)
            if line.startswith("baton cluster up"):
                up.set()

    threading.Thread(target=read, daemon=True).start()
    if not up.wait(timeout_s) or process.poll() is not None:
        cluster.stop()
        raise RuntimeError("cluster did not come up:\n" + "".join(cluster.lines[-40:]))
    return cluster
