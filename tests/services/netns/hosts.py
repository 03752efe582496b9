"""A cluster of hosts in network namespaces: the router, two workers and the tokenizer each
in its own namespace on one bridge (network.py), started with `svc start <role>` as the
README's multi-host section says, CURVE on. The test process is the client (and the
outsider), on the bridge from this namespace. The tokenizer reaches the router through a
relay in this process (relay.py): the link the latency, loss and partition cases act on.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

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


# ---- CURVE keys: the one place that knows how the cluster's keys are made ---------------

class ClusterKeys:
    """The cluster's per-role CURVE keys (`svc keys generate DIR`): the config lines every
    role reads, the SDK's `curve=` argument, and the keys that must be kept out."""

    def __init__(self, directory: Path):
        done = subprocess.run([sys.executable, "-m", "services.cli", "keys", "generate", str(directory)],
                              capture_output=True, text=True, cwd=REPO, timeout=60, env=child_env())
        if done.returncode != 0:
            raise RuntimeError(f"svc keys generate failed: {done.stderr.strip()}")
        self.directory = directory

    def config_lines(self) -> str:
        return f'curve_enabled = true\ncurve_keys_dir = "{self.directory}"\n'

    def client(self) -> dict:
        """What the SDK presents to the tokenizer."""
        from services.client import curve_keys

        return curve_keys(self.directory)

    def presenting(self, role: str, to: str) -> dict:
        """`role`'s key pair, pinning the public key of `to` (router or tokenizer)."""
        from common.sockets import load_curve_keys

        keys = load_curve_keys(self.directory, role)
        return {"server_public": keys.public_of(to).decode(), "client_public": keys.public.decode(),
                "client_secret": keys.secret.decode()}

    def member(self) -> dict:
        """What a member of the cluster (a worker) presents to the router."""
        return self.presenting("worker", "router")

    def outsiders(self, to: str) -> dict[str, dict | None]:
        """Who must be kept out of `to` (router or tokenizer): name -> the keys they
        present (None: plain TCP). A client's own key is not a member's at the router."""
        import zmq

        public, secret = zmq.curve_keypair()
        stranger = dict(self.presenting("client", to), client_public=public.decode(), client_secret=secret.decode())
        kept_out = {"no keys": None, "a stranger's key pair": stranger}
        if to == "router":
            kept_out["the client's key pair"] = self.presenting("client", "router")
        return kept_out


# ---- the cluster ----------------------------------------------------------------------

@dataclass
class Role:
    name: str
    argv: list[str]  # after `svc`
    log: Path
    process: subprocess.Popen | None = None
    log_offset: int = 0  # where this run of the process starts in the log


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

    def tokenizer_health(self, timeout_s: float = 1.0) -> dict:
        """The gateway's /health (its port is the default, 8000); answers 503 when not ok."""
        address = f"http://{self.net.address('tokenizer')}:{HTTP_PORT}/health"
        try:
            with urllib.request.urlopen(address, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            return json.loads(error.read())

    def worker_health(self, index: int, timeout_s: float = 1.0) -> dict:
        address = f"http://{self.net.address(f'worker-{index}')}:{PORT_BASE + 11 + 2 * index}/health"
        with urllib.request.urlopen(address, timeout=timeout_s) as response:
            return json.loads(response.read())

    def check_alive(self) -> None:
        dead = {name: role.process.returncode for name, role in self.roles.items() if role.process.poll() is not None}
        if dead:
            raise AssertionError(f"roles exited: {dead}\n" + "".join(
                f"--- {name}\n{tail(self.roles[name].log, offset=self.roles[name].log_offset)}"
                for name in dead))

    def settle(self, timeout_s: float = 30.0) -> list[str]:
        """Undo any fault, start again any role that exited (an earlier case's failure
        must not fail the next one too), and wait for both workers to be registered and
        healthy. Returns the roles started again."""
        self.net.heal_all()
        self.relay.set()
        self.relay.heal()
        exited = [role for role in self.roles.values() if role.process.poll() is not None]
        for role in exited:
            print(f"NETNS {role.name} had exited ({role.process.returncode}); starting it again:\n"
                  f"{tail(role.log, 5, role.log_offset)}", flush=True)
            launch(self, role)
        if exited:
            wait_ready(self, [role.name for role in exited])
        wait_for(lambda: self.healthy_workers() == {"worker-0", "worker-1"}, timeout_s,
                 "both workers healthy at the router")
        return [role.name for role in exited]


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


def tail(path: Path, lines: int = 30, offset: int = 0) -> str:
    try:
        return "".join(log_text(path, offset).splitlines(keepends=True)[-lines:])
    except OSError:
        return "(no log)\n"


def log_text(path: Path, offset: int = 0) -> str:
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def start_role(cluster: NetnsCluster, name: str, argv: list[str], log_dir: Path) -> Role:
    """`svc <argv>` in the host namespace called `name` (the role's name)."""
    role = Role(name, argv, log_dir / f"{name}.log")
    cluster.roles[name] = role
    launch(cluster, role)
    return role


def launch(cluster: NetnsCluster, role: Role) -> None:
    with role.log.open("ab") as out:
        role.log_offset = out.tell()
        role.process = subprocess.Popen(
            cluster.net.exec_argv(role.name, [sys.executable, "-m", "services.cli", *role.argv]),
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=child_env(PYTHONUNBUFFERED="1"))


def wait_ready(cluster: NetnsCluster, names: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
    marks = {"router": "baton router ready", "tokenizer": "baton tokenizer ready"}
    deadline = time.monotonic() + timeout_s
    waiting = set(names)
    while waiting:
        for name in list(waiting):
            role = cluster.roles[name]
            if marks.get(name, f"baton worker {name} ready") in log_text(role.log, role.log_offset):
                waiting.discard(name)
            elif role.process.poll() is not None:
                raise RuntimeError(f"{name} exited ({role.process.returncode}) before it was ready:\n"
                                   f"{tail(role.log, offset=role.log_offset)}")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {timeout_s} s: {sorted(waiting)}\n" +
                               "".join(f"--- {n}\n{tail(cluster.roles[n].log, offset=cluster.roles[n].log_offset)}"
                                       for n in waiting))
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




@contextlib.contextmanager
def running_cluster(model_dir: Path, scratch: Path):
    """Make the network, start the roles in it, wait until both workers serve; always
    stop every process and delete the namespaces afterwards."""
    network.clean_stale()
    net = network.Network(HOSTS)
    relay = None
    cluster = None
    try:
        net.up()
        keys = ClusterKeys(scratch / "keys")
        config = scratch / "cluster.toml"
        config.write_text(f'model = "{model_dir}"\n{CLUSTER_SETTINGS}\n{keys.config_lines()}\n', encoding="utf-8")
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
