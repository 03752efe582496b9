"""`svc plan`: DistServe's search for the prefill/decode split with the best goodput per GPU."""
import itertools
import json
import random

import pytest
from click.testing import CliRunner

from common.cost_model import CostModel, LatencyFit, ProfileError
from services.cli import main
from services.eval.disagg import Link
from services.eval.planner import (
    Layout,
    LayoutGoodput,
    PhaseGoodputs,
    PlanError,
    PoolPlan,
    best_colocated,
    disaggregated_goodput,
    highest_passing_rate,
    instance_profiles,
    layouts,
    lifetime_s,
    parse_capacities,
    run_length,
    search,
    search_layouts,
)
from services.eval.report import Slo
from services.eval.simulator import SimConfig
from services.eval.workloads import make_workload

LECTURE = "prefill=5.6,decode=10,colocated=1.6"  # 13B, 512 in / 64 out, A100 (docs/evaluation.md §4)


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def goodputs(prefill: dict, decode: dict, colocated: dict | None = None) -> PhaseGoodputs:
    return PhaseGoodputs(prefill, decode, colocated or {1: 1.0})


# ---- the lecture's example -------------------------------------------------------------


def test_the_lectures_capacities_on_three_gpus_give_2p1d_at_3_3_against_1_6_colocated():
    plan = plan_json("--capacities", LECTURE, "--gpus", "3")
    assert plan["prefill"] == {"instances": 2, "tp": 1, "gpus": 2, "goodput_per_gpu": 5.6}
    assert plan["decode"] == {"instances": 1, "tp": 1, "gpus": 1, "goodput_per_gpu": 10.0}
    assert plan["goodput_per_gpu"] == pytest.approx(min(2 * 5.6, 1 * 10) / 3)
    assert round(plan["goodput_per_gpu"], 1) == 3.3
    assert plan["colocated"] == {"instances": 3, "tp": 1, "gpus": 3, "goodput_per_gpu": 1.6}


def test_the_plan_prints_for_people_without_json():
    result = CliRunner().invoke(main, ["plan", "--capacities", LECTURE, "--gpus", "3"])
    assert result.exit_code == 0, result.output
    assert "2P:1D on 3 of 3 GPUs: 3.33 req/s/GPU" in result.output
    assert "co-located: 3 x tp1 = 3 GPUs: 1.60 req/s/GPU" in result.output


# ---- the formula and the search --------------------------------------------------------


def test_goodput_per_gpu_is_the_slower_pools_rate_over_all_gpus():
    assert disaggregated_goodput(2, 5.6, 1, 10) == pytest.approx(10 / 3)  # decode-bound
    assert disaggregated_goodput(1, 5.6, 1, 10) == pytest.approx(5.6 / 2)  # prefill-bound
    assert disaggregated_goodput(3, 5.6, 2, 10) == pytest.approx(16.8 / 5)
    assert disaggregated_goodput(1, 0.0, 1, 10) == 0.0


def test_five_gpus_pick_3p2d_which_beats_any_smaller_split():
    plan = search(parse_capacities(LECTURE), 5)
    assert (plan.prefill.instances, plan.decode.instances) == (3, 2)
    assert plan.goodput_per_gpu == pytest.approx(16.8 / 5) and plan.gpus == 5 and plan.budget == 5
    assert plan.colocated.goodput_per_gpu == pytest.approx(1.6)


def test_a_tie_goes_to_the_fewest_gpus_then_the_smaller_tp():
    plan = search(goodputs({1: 10.0}, {1: 10.0}), 4)  # 1P:1D and 2P:2D both serve 5 per GPU
    assert (plan.prefill.gpus, plan.decode.gpus) == (1, 1)
    # 2 x tp1 and 1 x tp2 prefill both give min(10, 10) / 3 with one decode GPU.
    plan = search(goodputs({1: 5.0, 2: 5.0}, {1: 10.0}), 3)
    assert (plan.prefill.instances, plan.prefill.tp, plan.decode.gpus) == (2, 1, 1)


def test_the_search_finds_the_best_split_within_the_budget():
    rng = random.Random(7)
    for gpus in range(2, 9):
        for _ in range(20):
            prefill = {tp: rng.uniform(0.5, 20) for tp in (1, 2, 4) if rng.random() < 0.8 or tp == 1}
            decode = {tp: rng.uniform(0.5, 20) for tp in (1, 2, 4) if rng.random() < 0.8 or tp == 1}
            plan = search(goodputs(prefill, decode), gpus)
            best = max(disaggregated_goodput(n_p * tp_p, prefill[tp_p], n_d * tp_d, decode[tp_d])
                       for tp_p, tp_d in itertools.product(prefill, decode)
                       for n_p in range(1, gpus + 1) for n_d in range(1, gpus + 1)
                       if n_p * tp_p + n_d * tp_d <= gpus)
            assert plan.goodput_per_gpu == pytest.approx(best)
            assert plan.prefill.gpus + plan.decode.gpus <= gpus
            assert plan.goodput_per_gpu == pytest.approx(disaggregated_goodput(
                plan.prefill.gpus, plan.prefill.goodput_per_gpu, plan.decode.gpus, plan.decode.goodput_per_gpu))


def test_no_split_fits_when_a_pool_needs_the_whole_budget():
    with pytest.raises(PlanError, match="no prefill/decode split fits in 4 GPUs"):
        search(goodputs({4: 10.0}, {1: 10.0}), 4)


def test_the_colocated_alternative_uses_the_whole_budget():
    per_gpu = {1: 1.0, 4: 1.2}
    eight = best_colocated(per_gpu, 8)
    assert (eight.instances, eight.tp, eight.gpus) == (2, 4, 8) and eight.goodput_per_gpu == pytest.approx(1.2)
    six = best_colocated(per_gpu, 6)  # one tp4 instance leaves two GPUs idle: 0.8 per GPU
    assert (six.instances, six.tp, six.goodput_per_gpu) == (6, 1, 1.0)
    assert best_colocated({1: 2.0, 2: 2.0}, 4).tp == 1  # a tie goes to the smaller tp


# ---- the rate search -------------------------------------------------------------------


@pytest.mark.parametrize("start", [0.01, 1.0, 7.3, 100.0])
def test_the_rate_search_brackets_then_bisects_to_three_percent(start):
    calls = []

    def passes(rate):
        calls.append(rate)
        return rate <= 7.3

    rate = highest_passing_rate(passes, start)
    assert 7.3 / 1.03 <= rate <= 7.3
    assert len(calls) <= 2 * 10 + 7


def test_the_rate_search_gives_up_at_its_bounds():
    assert highest_passing_rate(lambda rate: False, 1.0) == 0.0
    assert highest_passing_rate(lambda rate: True, 1.0, max_steps=3) == 8.0


# ---- the phase models and simulated plans ----------------------------------------------


def test_profiles_by_name_search_every_tp_that_fits(tmp_path):
    assert sorted(instance_profiles("a100/opt-13b")) == [1, 2, 4, 8]
    assert sorted(instance_profiles("h100/llama-3-70b")) == [4, 8]  # too big for one or two
    assert list(instance_profiles("a100/opt-13b/tp2")) == [2]
    assert list(instance_profiles("preble/llama-3-70b-h100")) == [4]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"name": "m", "prefill": {"a": 0.01, "b": 1e-4}, "decode": {"a": 0.01, "b": 1e-4}}))
    assert list(instance_profiles(str(path))) == [1]
    with pytest.raises(ProfileError, match="unknown profile name"):
        instance_profiles("b100/opt-13b")


def test_the_layouts_are_all_colocated_then_every_split():
    assert [layout.label for layout in layouts(4)] == ["4 co-located", "1P:3D", "2P:2D", "3P:1D"]
    assert all(layout.instances == 4 for layout in layouts(4))
    with pytest.raises(PlanError, match="at least 2 instances"):
        layouts(1)


def test_the_best_split_and_the_winner_compare_goodput_per_gpu():
    def plan(*rates):
        return PoolPlan(tuple(LayoutGoodput(layout, 2, rate) for layout, rate in zip(layouts(3), rates)),
                        "nvlink", 0.9)

    won = plan(6.0, 9.0, 9.0)  # 1P:2D and 2P:1D tie: the first tried wins
    assert won.best_split.layout == Layout(prefill=1, decode=2) and won.winner == "disaggregated"
    assert won.best_split.goodput_per_gpu == pytest.approx(9.0 / 6)
    assert plan(9.0, 9.0, 3.0).winner == "colocated"  # a tie keeps co-located
    summary = won.to_json()
    assert summary["winner"] == "disaggregated" and summary["best_split"]["layout"] == "1P:2D"
    assert summary["colocated"]["gpus"] == 6 and len(summary["candidates"]) == 3


def test_a_run_spans_enough_request_lifetimes_within_the_sample():
    requests = make_workload("chat", 5, seed=1)
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    lifetime = lifetime_s(requests, slo)
    assert lifetime == pytest.approx(0.5 + 0.05 * sum(r.output_tokens - 1 for r in requests) / 5)
    assert run_length(lifetime, rate=0.0, min_requests=3, available=5) == 3
    assert run_length(lifetime, rate=1e6, min_requests=3, available=5) == 5


def test_a_small_simulated_search_prices_every_layout():
    cost = CostModel("hand", LatencyFit(0.01, 1e-4), LatencyFit(0.005, 1e-4, 0.0, 1e-7))
    base = SimConfig(workers=1, policy="round_robin", cost=cost, link=Link("test", 1e9, 1e-4),
                     kv_bytes_per_block=100_000, max_local_prefill_tokens=0)
    requests = make_workload("toolbench", 40, seed=0, scale=0.2)
    plan = search_layouts(base, 1, 2, requests, Slo(1.0, 0.05), 0.9, min_requests=20, precision=0.2)
    assert [c.layout.label for c in plan.candidates] == ["2 co-located", "1P:1D"]
    assert all(c.goodput_rps > 0 for c in plan.candidates) and plan.link == "test"


def test_the_simulated_plan_command_prints_each_layout_and_the_winner():
    args = ["--profile", "a6000/mistral-7b/tp1", "--workload", "toolbench", "--scale", "0.2", "--ttft-slo", "2",
            "--tpot-slo", "0.2", "--gpus", "2", "--num-requests", "10", "--link", "nvlink"]
    plan = plan_json(*args)["plan"]
    assert plan["link"] == "nvlink" and plan["colocated"]["gpus"] == 2 and plan["best_split"]["layout"] == "1P:1D"
    assert plan["winner"] in ("colocated", "disaggregated")
    text = CliRunner().invoke(main, ["plan", *args]).output
    assert "2 co-located" in text and "best split 1P:1D" in text and "wins" in text


# ---- bad input -------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


@pytest.mark.parametrize("capacities, named", [
    ("prefill=5.6,decode=abc,colocated=1.6", "'decode=abc'"),
    ("prefill=5.6,decode=10", "missing colocated"),
    ("prefill=5.6,decode=10,colocated=1.6,cache=3", "'cache=3': unknown phase"),
    ("prefill5.6,decode=10,colocated=1.6", "'prefill5.6' is not NAME=NUMBER"),
    ("prefill=0,decode=10,colocated=1.6", "'prefill=0'"),
    ("prefill=1,prefill=2,decode=10,colocated=1.6", "prefill is given twice"),
])
def test_malformed_capacities_name_the_bad_part(capacities, named):
    result = invoke("--capacities", capacities)
    assert result.exit_code == 2 and "--capacities" in result.output and named in result.output


def test_an_unknown_profile_name_is_refused_with_the_known_ones():
    result = invoke("--profile", "b100/opt-13b", "--workload", "chat", "--ttft-slo", "1", "--tpot-slo", "1")
    assert result.exit_code == 2 and "unknown profile name 'b100/opt-13b'" in result.output
    assert "a100/opt-13b" in result.output


def test_missing_slos_and_mixed_sources_are_refused():
    result = invoke("--profile", "a100/opt-13b", "--workload", "chat")
    assert result.exit_code == 2 and "missing --ttft-slo, --tpot-slo" in result.output
    result = invoke("--capacities", LECTURE, "--profile", "a100/opt-13b")
    assert result.exit_code == 2 and "without --profile and --workload" in result.output
    result = invoke("--profile", "a100/opt-13b", "--workload", "nope", "--ttft-slo", "1", "--tpot-slo", "1")
    assert result.exit_code == 2 and "unknown workload 'nope'" in result.output
    assert invoke("--capacities", LECTURE, "--gpus", "1").exit_code == 2
    result = invoke("--profile", "a100/opt-13b", "--workload", "chat", "--ttft-slo", "1", "--tpot-slo", "1",
                    "--link", "string-and-cans")
    assert result.exit_code == 2 and "known: nvlink" in result.output
