"""A cluster of hosts in network namespaces: the router, two workers and the tokenizer each
in its own namespace on one bridge, started with `svc start <role>` as the README's
multi-host section says, CURVE on. The test process is the client (and the outsider),
on the bridge from this namespace. The tokenizer reaches the router through a relay in
this process (relay.py), the link the latency, loss and partition cases act on.

Skipped, with the reason, where network namespaces cannot be made (not root, say).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.local_cluster import REPO, child_env
from tests.services.netns import network
from tests.services.netns.relay import Relay

HOSTS = ["router", "worker-0", "worker-1", "tokenizer"]
PORT_BASE = 7100  # every role has its own address, so the default ports serve
HTTP_PORT = 8000
WORKER_TIMEOUT_S = 1.5
# What every role shares (the test flags of tests/services/conftest.py: small pools, fast
# failure detection); each host's own addresses go on its command line.
CLUSTER_SETTINGS = f"""
dtype = "float32"  # exact and fast on any CPU (bf16 needs AVX-512 here)
kv_cache_gb = 0.05
max_model_len = 1024
heartbeat_interval_s = 0.2
worker_timeout_s = {WORKER_TIMEOUT_S}
threads = 1
"""
START_TIMEOUT_S = 120.0
FIGURES: list[dict] = []


# ---- CURVE keys: the one place that knows how the cluster's keys are made ---------------

class ClusterKeys:
    """The cluster's CURVE keys (`svc keys generate`), as config lines for the roles and
    as the SDK's `curve=` argument, plus keys of strangers the cluster never saw."""

    def __init__(self, directory: Path):
        import zmq

        directory.mkdir(parents=True, exist_ok=True)
        printed = subprocess.run([sys.executable, "-m", "services.cli", "keys", "generate"],
                                 capture_output=True, text=True, cwd=REPO, check=True, timeout=60,
                                 env=child_env()).stdout
        self.toml = printed
        values = dict(line.replace('"', "").split(" = ") for line in printed.splitlines() if " = " in line)
        self.server_public = values["curve_server_public"]
        self._client = {"server_public": values["curve_server_public"],
                        "client_public": values["curve_client_public"],
                        "client_secret": values["curve_client_secret"]}
        public, secret = zmq.curve_keypair()
        self.stranger = {"server_public": self.server_public, "client_public": public.decode(),
                         "client_secret": secret.decode()}

    def config_lines(self) -> str:
        return self.toml

    def client(self) -> dict:
        return dict(self._client)

    def outsiders(self) -> dict[str, dict | None]:
        """Who must be kept out: name -> the keys they present (None: plain TCP)."""
        return {"no keys": None, "a stranger's key pair": dict(self.stranger)}


# ---- the cluster ----------------------------------------------------------------------

@dataclass
class Role:
    name: str
    process: subprocess.Popen
    log: Path


@dataclass
class NetnsCluster:
    net: network.Network
    keys: ClusterKeys
    relay: Relay  # the tokenizer's link to the router
    roles: dict[str, Role] = field(default_factory=dict)
    worker_timeout_s: float = WORKER_TIMEOUT_S

    @property
    def sdk(self) -> str:
        return f"tcp://{self.net.address('tokenizer')}:{PORT_BASE + 1}"

    @property
    def router(self) -> str:
        return f"tcp://{self.net.address('router')}:{PORT_BASE}"

    def client(self, **options):
        from services.client import AsyncClient

        return AsyncClient(self.sdk, curve=self.keys.client(), **options)

    def status(self, timeout_s: float = 2.0):
        """The router's view, asked through the tokenizer; ServerUnavailable if no answer."""
        from services.client import Client

        with Client(self.sdk, curve=self.keys.client(), connect_timeout_s=timeout_s) as client:
            return client.status()

    def healthy_workers(self, timeout_s: float = 2.0) -> set[str]:
        return {w.worker_id for w in self.status(timeout_s).workers if w.healthy}

    def worker_health(self, index: int, timeout_s: float = 1.0) -> dict:
        address = f"http://{self.net.address(f'worker-{index}')}:{PORT_BASE + 11 + 2 * index}/health"
        with urllib.request.urlopen(address, timeout=timeout_s) as response:
            return json.loads(response.read())

    def check_alive(self) -> None:
        dead = {name: role.process.returncode for name, role in self.roles.items() if role.process.poll() is not None}
        if dead:
            raise AssertionError(f"roles exited: {dead}\n" + "".join(
                f"--- {name}\n{tail(self.roles[name].log)}" for name in dead))

    def settle(self, timeout_s: float = 30.0) -> None:
        """Undo any fault and wait for both workers to be registered and healthy."""
        self.net.heal_all()
        self.relay.set()
        self.relay.heal()
        self.check_alive()
        wait_for(lambda: self.healthy_workers() == {"worker-0", "worker-1"}, timeout_s,
                 "both workers healthy at the router")


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    from services.client import BatonError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, BatonError):
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return "(no log)\n"


def start_role(cluster: NetnsCluster, name: str, argv: list[str], log_dir: Path) -> Role:
    log = log_dir / f"{name}.log"
    host = "tokenizer" if name == "tokenizer" else name
    with log.open("wb") as out:
        process = subprocess.Popen(cluster.net.exec_argv(host, [sys.executable, "-m", "services.cli", *argv]),
                                   stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                   env=child_env(PYTHONUNBUFFERED="1"))
    role = Role(name, process, log)
    cluster.roles[name] = role
    return role


def wait_ready(cluster: NetnsCluster, names: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
    marks = {"router": "baton router ready", "tokenizer": "baton tokenizer ready"}
    deadline = time.monotonic() + timeout_s
    waiting = set(names)
    while waiting:
        for name in list(waiting):
            role = cluster.roles[name]
            if marks.get(name, f"baton worker {name} ready") in role.log.read_text(errors="replace"):
                waiting.discard(name)
            elif role.process.poll() is not None:
                raise RuntimeError(f"{name} exited ({role.process.returncode}) before it was ready:\n{tail(role.log)}")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {timeout_s} s: {sorted(waiting)}\n" +
                               "".join(f"--- {n}\n{tail(cluster.roles[n].log)}" for n in waiting))
        time.sleep(0.1)


def stop_roles(cluster: NetnsCluster) -> None:
    for role in cluster.roles.values():
        if role.process.poll() is None:
            role.process.terminate()
    for role in cluster.roles.values():
        try:
            role.process.wait(10)
        except subprocess.TimeoutExpired:
            role.process.kill()
            role.process.wait(5)


@pytest.fixture(scope="module")
def netns_cluster(tiny_model_dir, tmp_path_factory):
    reason = network.unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    network.clean_stale()
    scratch = tmp_path_factory.mktemp("netns")
    net = network.Network(HOSTS)
    relay = None
    cluster = None
    try:
        net.up()
        keys = ClusterKeys(scratch / "keys")
        config = scratch / "cluster.toml"
        config.write_text(f'model = "{tiny_model_dir}"\n{CLUSTER_SETTINGS}\n{keys.config_lines()}\n',
                          encoding="utf-8")
        relay = Relay(net.client_address, net.address("router"), PORT_BASE).start()
        cluster = NetnsCluster(net, keys, relay)
        common = ["--config", str(config)]
        router_ip = net.address("router")
        start_role(cluster, "router", ["start", "router", *common, "--host", router_ip,
                                       "--advertise-host", router_ip], scratch)
        wait_ready(cluster, ["router"])
        for index in (0, 1):
            worker_ip = net.address(f"worker-{index}")
            start_role(cluster, f"worker-{index}",
                       ["start", "worker", *common, "--index", str(index), "--host", worker_ip,
                        "--advertise-host", worker_ip, "--router-address", cluster.router], scratch)
        front_ip = net.address("tokenizer")
        start_role(cluster, "tokenizer",
                   ["start", "tokenizer", *common, "--host", front_ip, "--http-host", front_ip,
                    "--advertise-host", front_ip, "--router-address", relay.address], scratch)
        wait_ready(cluster, ["worker-0", "worker-1", "tokenizer"])
        cluster.settle(timeout_s=30)
        yield cluster
    finally:
        if cluster is not None:
            stop_roles(cluster)
        if relay is not None:
            relay.close()
        net.down()


@pytest.fixture
def figures(request):
    """Record a case's figures: printed at once and again in the run's summary."""

    def record(**values) -> dict:
        entry = {"case": request.node.name, **values}
        FIGURES.append(entry)
        print("NETNS", json.dumps(entry), flush=True)
        return entry

    return record


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("network namespace cases: figures")
        for entry in FIGURES:
            terminalreporter.write_line(json.dumps(entry))
        path = os.environ.get("BATON_NETNS_FIGURES")
        if path:
            Path(path).write_text("\n".join(json.dumps(e) for e in FIGURES) + "\n", encoding="utf-8")
