"""`svc up` leaves no process behind, however it ends."""
import json
import os
import signal
import time
import urllib.request

import pytest


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie awaiting its reaper is gone too
        return stat.read().split()[2] != "Z"


def role_pids(cluster) -> list[int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port_base + 3}/health", timeout=5) as response:
        router = json.loads(response.read())["pid"]
    return [router, cluster.worker_health(0)["pid"]]


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_stopping_svc_up_stops_every_child(make_cluster, how):
    cluster = make_cluster(workers=1)
    pids = role_pids(cluster)
    assert all(pid_alive(pid) for pid in pids)
    cluster.process.send_signal(how)
    cluster.process.wait(30)
    deadline = time.monotonic() + 15
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in pids)
