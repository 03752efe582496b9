"""What a cluster on 127.0.0.1 listens on: only loopback, KV data plane included
(docs/kv-transfer.md §5). One `svc up` with the KV store, a prefill and a decode worker,
all with kv_transport = ucx; the listening TCP sockets of every process it started are
read from /proc (socket inodes of /proc/<pid>/fd matched in /proc/net/tcp and tcp6), as
`ss -ltnp` would show them.
"""
from __future__ import annotations

import ipaddress
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from common.kv_transfer import ucx_available
from services.local_cluster import start_cluster
from tests.services.conftest import TEST_FLAGS

UCX_MISSING = ucx_available()
KV_ROLES = {"kvstore", "prefill", "decode"}  # the roles with a KV data plane
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp*


def session_pids(leader: int) -> list[int]:
    """Every live process of the session `leader` started (start_cluster starts one)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        session = stat.rpartition(")")[2].split()[3]  # after the command: state, ppid, pgrp, session
        if int(session) == leader:
            pids.append(int(entry.name))
    return pids


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def proc_address(hex_address: str) -> str:
    """/proc/net/tcp*'s HOST:PORT (the host as the kernel's 32-bit words, each little-endian)."""
    host, port = hex_address.split(":")
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    return f"{ipaddress.ip_address(raw)}:{int(port, 16)}"


def listening_sockets() -> dict[str, str]:
    """Inode -> local address of every listening TCP socket of this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == TCP_LISTEN:
                found[fields[9]] = proc_address(fields[1])
    return found


def role_of(pid: int) -> str:
    """The role a `svc start ROLE` process runs ("svc up" for the supervisor)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("start") + 1] if "start" in argv else "svc up"


def listeners_by_process(leader: int) -> dict[str, list[str]]:
    """'ROLE pid N' -> the addresses its listening TCP sockets are bound to."""
    listening = listening_sockets()
    found: dict[str, list[str]] = defaultdict(list)
    for pid in session_pids(leader):
        try:
            name = f"{role_of(pid)} pid {pid}"
            found[name] += sorted(listening[inode] for inode in socket_inodes(pid) if inode in listening)
        except OSError:  # a process that ended meanwhile
            continue
    return dict(found)


def test_proc_addresses_read_as_ss_shows_them():
    assert proc_address("0100007F:1BBC") == "127.0.0.1:7100"
    assert proc_address("00000000000000000000000001000000:0050") == "::1:80"
    assert proc_address("000000FD000000000000000002000000:8F25") == "fd00::2:36645"


@pytest.mark.skipif(UCX_MISSING is not None, reason=f"ucxx does not import: {UCX_MISSING}")
def test_a_loopback_cluster_with_ucx_listens_on_loopback_only(tiny_model_dir):
    cluster = start_cluster(tiny_model_dir, workers=0, prefill=1, decode=1, kvstore=True,
                            extra=[*TEST_FLAGS, "--kv-transport", "ucx"])
    try:
        listeners = listeners_by_process(cluster.process.pid)
    finally:
        cluster.stop()
    chosen = [json.loads(line) for line in cluster.lines if '"kv_transport_chosen"' in line]
    assert [event["chosen"] for event in chosen] == ["ucx"] * 3, chosen  # the store, prefill, decode
    roles = {name.split()[0] for name in listeners}
    assert KV_ROLES <= roles, listeners
    wild_or_external = {name: [address for address in addresses
                               if not ipaddress.ip_address(address.rpartition(":")[0]).is_loopback]
                        for name, addresses in listeners.items()}
    assert not any(wild_or_external.values()), listeners
