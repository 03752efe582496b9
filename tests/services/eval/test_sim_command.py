"""`svc sim` through click: tables, the JSON line, sweeps and their plots, trace replay,
and clear errors for bad input."""
from __future__ import annotations

import gc
import json
import re

import pytest
from click.testing import CliRunner

from common.cost_model import load_cost_model
from services.cli import main
from services.eval import sim_runner
from services.eval.simulator import Simulator

REQUIRED_KEYS = ("ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "e2e_mean_s", "e2e_p99_s", "slo_attainment",
                 "hit_rate", "jain", "rejected")
SMALL = ["--workload", "toolbench", "--num-requests", "60", "--workers", "2", "--scale", "0.2"]


def run_sim(*args: str):
    result = CliRunner().invoke(main, ["sim", *args])
    assert result.exit_code == 0, result.output
    return result


def last_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_policies(results: dict, policies: list[str], workload_class: str, requests: int) -> None:
    assert list(results) == policies
    for policy in policies:
        overall, classes = results[policy]["overall"], results[policy]["classes"]
        assert list(classes) == [workload_class]
        for summary in (overall, classes[workload_class]):
            assert all(isinstance(summary[key], (int, float)) for key in REQUIRED_KEYS)
        assert overall["requests"] == overall["completed"] == requests
        assert overall["ttft_mean_s"] > 0 and overall["e2e_p99_s"] >= overall["e2e_mean_s"] > 0
        speed = results[policy]["simulation"]
        assert speed["requests"] == requests and speed["wall_s"] > 0
        assert speed["requests_per_wall_s"] == pytest.approx(requests / speed["wall_s"])
        assert speed["index_blocks"] > 0  # what the requests left cached, named in the router's index
        assert 0 < speed["engine_runs"] <= speed["engine_named_blocks"]  # the engines' cached blocks, in runs


def test_a_run_prints_the_table_and_ends_with_the_json_line():
    result = run_sim(*SMALL, "--policy", "round_robin,e2", "--ttft-slo", "10", "--json")
    lines = result.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["policy", "reqs", "ttft_ms"]
    assert [line.split()[0] for line in lines[1:-1]] == ["round_robin", "toolbench", "e2", "toolbench", "floor:",
                                                         "simulated"]
    results = last_json(result)
    speeds = re.search(r"^simulated 60 requests on 2 workers in: round_robin ([\d.]+) s \(([\d,]+) req/s\), "
                       r"e2 ([\d.]+) s", result.stdout, re.MULTILINE)
    assert speeds is not None, result.stdout
    assert float(speeds.group(3)) == pytest.approx(results["e2"]["simulation"]["wall_s"], abs=0.006)
    check_policies(results, ["round_robin", "e2"], "toolbench", 60)
    assert results["e2"]["overall"]["slo_attainment"] == 1.0


def test_the_floor_is_below_every_policy_and_tight_at_light_load():
    light = run_sim(*SMALL, "--policy", "round_robin,lpm,e2", "--load", "0.05", "--json")
    floor = re.search(r"^floor: e2e mean ([\d.]+) ms, p99 ([\d.]+) ms", light.stdout, re.MULTILINE)
    floor_mean, floor_p99 = (float(value) / 1000 for value in floor.groups())
    for policy in last_json(light).values():
        overall = policy["overall"]
        assert floor_mean < overall["e2e_mean_s"] < 1.5 * floor_mean  # alone but for a prefill
        assert floor_p99 < overall["e2e_p99_s"]


def test_without_json_the_output_is_only_the_table():
    lines = run_sim(*SMALL, "--policy", "lpm").stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["policy", "lpm", "toolbench", "floor:", "simulated"]


def test_a_sweep_prints_a_table_per_value_writes_plots_and_one_json_object(tmp_path):
    result = run_sim(*SMALL, "--policy", "round_robin,lpm", "--sweep", "load=0.5, 2", "--plot",
                     str(tmp_path / "plots"), "--json")
    assert "load=0.5" in result.stdout and "load=2" in result.stdout
    line = last_json(result)
    assert line["sweep"] == "load" and list(line["values"]) == ["0.5", "2"]
    for by_policy in line["values"].values():
        check_policies(by_policy, ["round_robin", "lpm"], "toolbench", 60)
    fast, slow = (line["values"][value]["lpm"]["overall"]["duration_s"] for value in ("0.5", "2"))
    assert fast > slow  # the higher load's arrivals come four times as fast
    pngs = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert pngs == ["load_e2e_p99_s.png", "load_slo_attainment.png", "load_ttft_mean_s.png"]
    assert all((tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG") for name in pngs)


def without_speed(line: dict) -> dict:
    """A sweep's JSON line less each run's own speed (wall seconds differ run to run)."""
    return {value: {key: {part: summary for part, summary in run.items() if part != "simulation"}
                    for key, run in by_key.items()}
            for value, by_key in line["values"].items()}


def test_runs_in_parallel_processes_give_the_results_of_runs_in_one():
    args = [*SMALL, "--policy", "round_robin,lpm,e2", "--sweep", "load=0.5,2", "--json"]
    alone, parallel = (last_json(run_sim(*args, "--jobs", jobs)) for jobs in ("1", "3"))
    assert list(parallel["values"]) == ["0.5", "2"]
    assert [list(by_key) for by_key in parallel["values"].values()] == [["round_robin", "lpm", "e2"]] * 2
    assert json.dumps(without_speed(parallel)) == json.dumps(without_speed(alone))  # the same, in the same order
    for by_policy in parallel["values"].values():
        check_policies(by_policy, ["round_robin", "lpm", "e2"], "toolbench", 60)


def test_sweeping_workers_needs_no_workers_option():
    args = ["--workload", "toolbench", "--num-requests", "30", "--scale", "0.2", "--policy", "e2",
            "--sweep", "workers=1,3", "--json"]
    line = last_json(run_sim(*args))
    assert [line["values"][v]["e2"]["overall"]["gpus"] for v in ("1", "3")] == [1, 3]


def write_trace(path) -> None:
    """A Mooncake-format trace: two prompts each reused, one request alone."""
    records = [(0, 1100, 5, [1, 2, 3]), (100, 1100, 3, [1, 2, 3]), (200, 700, 4, [4, 5]),
               (350, 1030, 2, [1, 2, 6]), (500, 700, 6, [4, 5]), (800, 300, 1, [7])]
    lines = [json.dumps({"timestamp": t, "input_length": n, "output_length": out, "hash_ids": ids})
             for t, n, out, ids in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_trace_replays_in_mooncake_format(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    result = run_sim("--trace", str(trace), "--workers", "2", "--policy", "lpm,round_robin", "--json")
    results = last_json(result)
    check_policies(results, ["lpm", "round_robin"], "mooncake", 6)
    assert results["lpm"]["overall"]["hit_rate"] > 0
    # Its own times by default: the last request arrives at 0.8 s.
    assert results["lpm"]["overall"]["duration_s"] > 0.8


def test_a_rate_rescales_a_trace_and_num_requests_takes_a_prefix(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    args = ["--trace", str(trace), "--workers", "1", "--policy", "lpm", "--num-requests", "4", "--json"]
    own, fast = (last_json(run_sim(*args, *extra))["lpm"]["overall"] for extra in ([], ["--rate", "1000"]))
    assert own["requests"] == fast["requests"] == 4
    assert fast["duration_s"] < own["duration_s"]


@pytest.mark.parametrize("args, message", [
    (["--workload", "nope", "--workers", "1", "--policy", "e2"], "unknown workload 'nope'; known: toolbench"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2,best"], "unknown policy 'best'; known: round_robin"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2,e2"], "named twice"),
    (["--workers", "1", "--policy", "e2"], "give --workload NAME or --trace FILE"),
    (["--workload", "toolbench", "--policy", "e2"], "give --workers N"),
    (["--workload", "mooncake", "--workers", "1", "--policy", "e2"], "give --trace FILE"),
    (["--trace", "/no/such/trace.jsonl", "--workers", "1", "--policy", "e2"], "does not exist"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--rate", "2", "--load", "0.5"],
     "at most one of --rate and --load"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--sweep", "load"], "expected VAR=a,b,c"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--sweep", "color=1,2"], "expected VAR=a,b,c"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--sweep", "load=0.5,high"],
     "load value 'high' is not a number"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--sweep", "workers=2,2.5"],
     "not an integer"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--plot", "out"], "--plot draws a sweep"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--jobs", "0"], "--jobs"),
    (["--workload", "chat", "--workers", "1", "--policy", "e2", "--zipf", "1.2"], "the chat workload takes"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--option", "tools"], "expected KEY=VALUE"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--time-scale", "2"], "trace arrivals only"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--queue-policy", "lifo"],
     "unknown 'lifo'; known: fcfs"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--index-mode", "guess"],
     "unknown 'guess'; known: events"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--profile", "tpu/llama"],
     "unknown profile name"),
    (["--workload", "toolbench", "--workers", "1", "--policy", "e2", "--kv-blocks", "8"], "--kv-blocks: 8 blocks"),
    (["--workload", "toolbench", "--prefill-workers", "1", "--policy", "e2"], "go together"),
    (["--workload", "toolbench", "--prefill-workers", "1", "--decode-workers", "1", "--policy", "e2"],
     "names its model"),
    (["--workload", "toolbench", "--prefill-workers", "1", "--decode-workers", "1", "--policy", "e2",
      "--profile", "a6000/mistral-7b", "--link", "smoke-signal"], "known: nvlink"),
])
def test_bad_input_is_a_usage_error_naming_the_problem(args, message):
    result = CliRunner().invoke(main, ["sim", "--num-requests", "20", "--scale", "0.2", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_bad_trace_record_is_an_error_naming_its_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnot json\n')
    result = CliRunner().invoke(main, ["sim", "--trace", str(trace), "--workers", "1", "--policy", "e2"])
    assert result.exit_code == 1
    assert f"{trace}:2: not valid JSON" in result.output


def test_pools_move_kv_over_the_named_link_and_report_it():
    args = ["--workload", "loogle", "--num-requests", "20", "--scale", "0.1", "--policy", "e2", "--profile",
            "a6000/mistral-7b", "--prefill-workers", "1", "--decode-workers", "1", "--json"]
    fast, slow = run_sim(*args, "--link", "nvlink"), run_sim(*args, "--link", "tcp-10g")
    assert "1 prefill + 1 decode workers over nvlink" in fast.stdout and "KV transfer mean" in fast.stdout
    fast_overall, slow_overall = last_json(fast)["e2"]["overall"], last_json(slow)["e2"]["overall"]
    assert fast_overall["gpus"] == 2 and fast_overall["transfer_bytes"] > 0
    assert slow_overall["transfer_mean_s"] > 10 * fast_overall["transfer_mean_s"]


def test_a_sweep_frees_each_run_before_the_next():
    """The simulator collects cycles rarely while it runs; what a run leaves must not
    outlive it, or a sweep of many runs holds all of them at once."""
    spec = sim_runner.SimSpec(workload="toolbench", policies=("lpm", "e2", "round_robin"), workers=2,
                              cost=load_cost_model("a6000/mistral-7b"), num_requests=40)
    (point,) = sim_runner.prepare(spec)
    gc.collect()
    before = sum(isinstance(thing, Simulator) for thing in gc.get_objects())
    done, alive_at_start = 0, []

    def advance(count: int) -> None:
        nonlocal done
        if done % 40 == 0:  # a run's first requests: the one before it has ended
            alive_at_start.append(sum(isinstance(thing, Simulator) for thing in gc.get_objects()) - before)
        done += count

    results = sim_runner.run_points([point], advance)
    assert [summary["overall"]["completed"] for summary in results[""].values()] == [40, 40, 40]
    assert alive_at_start == [1, 1, 1]  # its own simulator only
