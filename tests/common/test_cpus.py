"""Which cores each process of a node runs on (common/cpus.py), and a role pinning itself."""
import os
import subprocess
import sys

import pytest

from common.config import ConfigError, load_config
from common.cpus import CpuPlan, format_cpu_list, parse_cpu_list, plan_cpus
from services.local_cluster import REPO, child_env, free_port_base


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
