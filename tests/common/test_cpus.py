"""Which cores each process of a node runs on (common/cpus.py), a role pinning itself, and an
engine's I/O threads kept off its cores."""
import os
import subprocess
import sys
import time

import pytest
import zmq

from common.config import ConfigError, load_config
from common.cpus import CpuPlan, format_cpu_list, parse_cpu_list, plan_cpus
from services.local_cluster import REPO, child_env, free_port_base, start_cluster


@pytest.mark.parametrize("text, cpus", [("0", {0}), ("0-3,6", {0, 1, 2, 3, 6}), (" 2 , 4-5", {2, 4, 5})])
def test_cpu_lists_read_and_write_back(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(frozenset(cpus))) == cpus
    assert format_cpu_list([0, 1, 2, 3, 6]) == "0-3,6"


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2", "1,,2"])
def test_a_bad_cpu_list_is_refused_naming_the_setting(text):
    with pytest.raises(ValueError):
        parse_cpu_list(text)
    if text:
        with pytest.raises(ConfigError, match="^cpus"):
            load_config(env={"BATON_CPUS": text})


def test_each_engine_gets_cores_of_its_own_and_the_others_the_rest():
    assert plan_cpus(frozenset(range(8)), 2, 3) == CpuPlan(("1-3", "4-6"), "0,7")
    assert plan_cpus(frozenset({0, 1}), 1, 1) == CpuPlan(("1",), "0")
    assert plan_cpus(frozenset({2, 5, 9}), 1, 2) == CpuPlan(("5,9",), "2")


def test_where_the_cores_do_not_go_round_no_one_is_pinned():
    assert plan_cpus(frozenset({0, 1}), 2, 1) == CpuPlan(("", ""), "")
    assert plan_cpus(frozenset({0, 1, 2, 3}), 1, 4) == CpuPlan(("",), "")


def test_a_role_started_with_cpus_runs_on_them():
    cpu = max(os.sched_getaffinity(0))
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "start", "router", "--cpus", str(cpu),
                                "--port-base", str(free_port_base()), "--profile", "tiny-cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env=child_env())
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "router ready" in line:
                break
        else:
            pytest.fail("the router did not start")
        threads = os.listdir(f"/proc/{process.pid}/task")
        allowed = {thread: _allowed(f"/proc/{process.pid}/task/{thread}/status") for thread in threads}
        assert allowed and all(cpus == str(cpu) for cpus in allowed.values()), allowed
    finally:
        process.terminate()
        process.wait(10)


def _allowed(status_path: str) -> str:
    with open(status_path) as status:
        return next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list:"))


def _io_threads(pid: int | str) -> dict[str, str]:
    """Each ZeroMQ I/O thread of process `pid` (by thread id) and the CPUs it may run on."""
    threads = {}
    for thread in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{thread}/comm") as comm:
            if comm.read().startswith("ZMQbg"):
                threads[thread] = _allowed(f"/proc/{pid}/task/{thread}/status")
    return threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell a thread's CPUs from the process's")
def test_an_engine_context_starts_its_io_threads_on_the_cpus_given():
    from common.sockets import engine_context

    cpu = max(os.sched_getaffinity(0))
    before = _io_threads("self")
    context = engine_context(str(cpu))
    try:
        context.socket(zmq.PUSH).close(0)  # the threads start with the first socket
        deadline = time.monotonic() + 5
        while True:  # each thread names itself once running: the name may come a moment later
            started = {thread: cpus for thread, cpus in _io_threads("self").items() if thread not in before}
            if started or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert started and set(started.values()) == {str(cpu)}, started
    finally:
        context.term()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="svc up pins nothing on one CPU")
def test_svc_up_keeps_an_engines_io_threads_off_its_cores(tiny_model_dir):
    plan = plan_cpus(frozenset(os.sched_getaffinity(0)), 1, 1)
    cluster = start_cluster(tiny_model_dir, extra=["--threads", "1", "--profile", "tiny-cpu", "--kv-cache-gb", "0.05",
                                                   "--max-model-len", "512"])
    try:
        pid = cluster.worker_health(0)["pid"]
        io_threads = _io_threads(pid)
        compute = _allowed(f"/proc/{pid}/status")
    finally:
        cluster.stop()
    assert compute == plan.engines[0]
    assert io_threads and set(io_threads.values()) == {plan.others}, io_threads
