"""Hosts made of Linux network namespaces: one namespace per cluster role, all wired to a
bridge that lives in a namespace of its own, on a private /24.

    bridge namespace  <prefix>-br: bridge br0 with one port per host ("v-<host>")
    host namespaces   <prefix>-<host>: interface eth0 = <subnet>.<n>/24, and lo
    this namespace    interface <prefix>c = <subnet>.100/24: the test process itself, the
                      cluster's client (and outsider)

`<prefix>` is "btn<pid>", so a run never collides with another and a crashed run's
leftovers are recognisable: `clean_stale()` removes those whose process is gone.
Everything stays inside the namespaces made here plus the one veth in this namespace.

A pulled cable is `cut(host)`: the bridge's end of the host's veth goes down, so the
host's eth0 loses carrier. Its address and route stay, its sockets stay open, and what
it sends is dropped (TCP retransmits with backoff); no FIN or RST reaches any peer.
`heal(host)` plugs it back in and TCP's retransmissions carry on where they were.
"""
from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import time
import uuid

PREFIX = "btn"
CLIENT_HOST_NUMBER = 100
_STALE = re.compile(rf"^{PREFIX}(\d+)-")


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no `ip`, no CAP_SYS_ADMIN...)."""


def ip(*args: str, check: bool = True, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can (tried, not guessed)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root (run as root, e.g. in the CI container)"
    probe = f"{PREFIX}{os.getpid()}-probe{uuid.uuid4().hex[:4]}"
    try:
        made = ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        veth = ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if veth.returncode != 0:
            return f"cannot make veth pairs: {veth.stderr.strip()}"
        bridge = ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot make a bridge: {bridge.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    listed = ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip()]


def kill_namespace_processes(namespace: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process in `namespace`, SIGKILL what is left after `grace_s`."""
    def pids() -> list[int]:
        listed = ip("netns", "pids", namespace, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        remaining = pids()
        for pid in remaining:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while remaining and time.monotonic() < deadline:
            time.sleep(0.05)
            remaining = pids()
        if not remaining:
            return


def clean_stale() -> list[str]:
    """Delete the namespaces and client veths of earlier runs whose process is gone."""
    removed = []
    for namespace in namespaces():
        match = _STALE.match(namespace)
        if match and not _pid_alive(int(match.group(1))):
            kill_namespace_processes(namespace, grace_s=1.0)
            ip("netns", "del", namespace, check=False)
            removed.append(namespace)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = re.match(rf"^{PREFIX}(\d+)c$", name)
        if match and not _pid_alive(int(match.group(1))):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.N.0/24 that no address on this machine's own interfaces is in."""
    used = ip("-4", "-o", "addr", "show", check=False).stdout + ip("-4", "route", "show", check=False).stdout
    start = os.getpid() % 254
    for third in [(start + n) % 254 + 1 for n in range(254)]:  # runs side by side pick different ones
        subnet = ipaddress.ip_network(f"10.213.{third}.0/24")
        if f"10.213.{third}." not in used:
            return subnet
    raise RuntimeError("no free 10.213.N.0/24 subnet")


class Network:
    """Namespaces for `hosts` on one bridge; this process reaches them as the client."""

    def __init__(self, hosts: list[str]):
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.hosts = list(hosts)
        self.subnet = _free_subnet()
        self.base = str(self.subnet.network_address).rsplit(".", 1)[0]
        self.bridge_ns = f"{self.prefix}-br"
        self.client_link = f"{self.prefix}c"
        self.made: list[str] = []

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{self.base}.{self.hosts.index(host) + 1}"

    @property
    def client_address(self) -> str:
        return f"{self.base}.{CLIENT_HOST_NUMBER}"

    def port_name(self, host: str) -> str:
        return f"v-{host}"[:15]

    def up(self) -> Network:
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        ip("netns", "add", self.bridge_ns)
        self.made.append(self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for host in self.hosts:
            namespace = self.namespace(host)
            ip("netns", "add", namespace)
            self.made.append(namespace)
            ip("link", "add", "name", "eth0", "netns", namespace, "type", "veth",
               "peer", "name", self.port_name(host), "netns", self.bridge_ns)
            self._attach(self.port_name(host))
            ip("-n", namespace, "addr", "add", f"{self.address(host)}/{self.subnet.prefixlen}", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        ip("link", "add", "name", self.client_link, "type", "veth", "peer", "name", "v-client", "netns", self.bridge_ns)
        self._attach("v-client")
        ip("addr", "add", f"{self.client_address}/{self.subnet.prefixlen}", "dev", self.client_link)
        ip("link", "set", self.client_link, "up")

    def _attach(self, port: str) -> None:
        ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
        ip("-n", self.bridge_ns, "link", "set", port, "up")

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def cut(self, host: str) -> None:
        ip("-n", self.bridge_ns, "link", "set", self.port_name(host), "down")

    def heal(self, host: str) -> None:
        ip("-n", self.bridge_ns, "link", "set", self.port_name(host), "up")

    def heal_all(self) -> None:
        for host in self.hosts:
            self.heal(host)

    def down(self) -> None:
        """Kill what runs in the namespaces, delete them and the client veth; never raises."""
        for namespace in reversed(self.made):
            try:
                kill_namespace_processes(namespace)
            except Exception:
                pass
            ip("netns", "del", namespace, check=False)
        ip("link", "del", self.client_link, check=False)
        self.made.clear()
