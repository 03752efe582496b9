"""`svc plan`: DistServe's search for the prefill/decode split with the best goodput per GPU."""
import itertools
import json
import math
import random

import pytest
from click.testing import CliRunner

from common.cost_model import CostModel, LatencyFit, ProfileError
from services.cli import main
from services.eval.planner import (
    PhaseGoodputs,
    PlanError,
    best_colocated,
    disaggregated_goodput,
    highest_passing_rate,
    instance_profiles,
    parse_capacities,
    phase_model,
    run_length,
    search,
)
from services.eval.report import RequestRecord, Slo
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


def test_each_phase_counts_only_its_own_target():
    cost = CostModel("hand", LatencyFit(0.01, 1e-4), LatencyFit(0.02, 1e-4, 1e-6))
    requests = make_workload("chat", 5, seed=1)
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    prefill = phase_model("prefill", requests, cost, slo)
    assert all(r.output_tokens == 1 for r in prefill.requests) and prefill.cost == cost
    assert (prefill.ttft_s, prefill.tpot_s, prefill.lifetime_s) == (0.5, math.inf, 0.5)
    decode = phase_model("decode", requests, cost, slo)
    assert decode.cost.decode == cost.decode and decode.cost.prefill_s(2048) < 1e-5
    assert (decode.ttft_s, decode.tpot_s) == (math.inf, 0.05)
    # A decode request's first token came from the prefill pool on arrival: waiting counts.
    late = RequestRecord("r", "chat", arrival_s=0.0, num_prompt_tokens=10, output_tokens=11,
                         first_token_s=5.0, finish_s=5.4)
    assert not decode.meets(late) and phase_model("colocated", requests, cost, slo).meets(
        RequestRecord("r", "chat", 0.0, 10, 11, first_token_s=0.4, finish_s=0.8))
    assert run_length(decode, rate=0.0, min_requests=3) == 3
    assert run_length(decode, rate=1e6, min_requests=3) == len(requests)  # at most the sample


def test_a_small_simulated_plan_finds_positive_goodputs_within_the_budget():
    plan = plan_json("--profile", "a6000/mistral-7b/tp1", "--workload", "toolbench", "--ttft-slo", "2",
                     "--tpot-slo", "0.2", "--gpus", "3", "--num-requests", "20")
    assert plan["prefill"]["goodput_per_gpu"] > 0 and plan["decode"]["goodput_per_gpu"] > 0
    assert plan["goodput_per_gpu"] > 0 and plan["colocated"]["goodput_per_gpu"] > 0
    assert plan["prefill"]["gpus"] + plan["decode"]["gpus"] <= 3
    assert plan["colocated"]["tp"] == 1 and plan["colocated"]["gpus"] == 3


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
