"""The simulator: the live scheduler, block manager and router objects on virtual time."""
import dataclasses
import json

import numpy as np
import pytest

from common.cost_model import CostModel, LatencyFit, load_cost_model
from common.hashing import chain_hashes
from services.eval.report import Slo, summarize
from services.eval.simulator import SimConfig, _PromptHashes, simulate
from services.eval.workloads import make_workload
from services.eval.workloads.arrivals import poisson
from services.eval.workloads.base import WorkloadRequest

# Round numbers, so the expected times are plain arithmetic.
COST = CostModel("hand", prefill=LatencyFit(a=0.010, b=0.001, c=0.0001, d=0.0),
                 decode=LatencyFit(a=0.005, b=0.002, c=0.0, d=0.00001))


def request(request_id: str, arrival_s: float, prompt_tokens: int, outputs: int, seed: int = 0) -> WorkloadRequest:
    tokens = np.random.default_rng(seed).integers(4, 500, prompt_tokens).astype(np.uint32)
    return WorkloadRequest(request_id, arrival_s, tokens, outputs, "test")


def test_one_request_on_one_worker_takes_the_profiles_own_time():
    result = simulate([request("r", 0.0, 100, 4)], SimConfig(workers=1, policy="round_robin", cost=COST))
    [record] = result.records
    prefill = 0.010 + 0.001 * 100
    decodes = [0.005 + 0.002 * 1 + 0.00001 * 1 * context for context in (100, 101, 102)]
    assert record.first_token_s == pytest.approx(prefill)
    assert record.finish_s == pytest.approx(prefill + sum(decodes))
    assert record.output_tokens == 4 and result.steps == 4


def test_the_network_delays_arrival_and_delivery_and_the_first_token_its_extra():
    config = SimConfig(workers=1, policy="round_robin", cost=COST, network_s=0.002, first_token_extra_s=0.003)
    result = simulate([request("r", 1.0, 100, 4), request("one", 5.0, 100, 1, seed=1)], config)
    records = {r.request_id: r for r in result.records}
    prefill = 0.010 + 0.001 * 100
    decodes = sum(0.005 + 0.002 * 1 + 0.00001 * 1 * context for context in (100, 101, 102))
    assert records["r"].first_token_s == pytest.approx(1.0 + 0.002 + prefill + 0.002 + 0.003)
    assert records["r"].finish_s == pytest.approx(1.0 + 0.002 + prefill + decodes + 0.002)
    # one output token: it is the first token and the last, so it finishes when it arrives
    assert records["one"].finish_s == records["one"].first_token_s == pytest.approx(5.0 + 0.004 + prefill + 0.003)
    with pytest.raises(ValueError, match="must not be negative"):
        SimConfig(workers=1, policy="round_robin", cost=COST, network_s=0.001, first_token_extra_s=-0.002)


def test_a_chunked_prompt_pays_for_its_context_and_a_mixed_step_for_both_phases():
    config = SimConfig(workers=1, policy="round_robin", cost=COST, max_num_batched_tokens=64)
    result = simulate([request("long", 0.0, 100, 2), request("late", 0.0, 10, 1, seed=1)], config)
    records = {r.request_id: r for r in result.records}
    first_chunk = 0.010 + 0.001 * 64
    second_chunk = 0.010 + 0.001 * 36 + 0.0001 * 64 + 0.001 * 10  # long's rest and all of late
    assert records["late"].first_token_s == pytest.approx(first_chunk + second_chunk)
    assert records["long"].first_token_s == pytest.approx(first_chunk + second_chunk)
    decode = 0.005 + 0.002 + 0.00001 * 100  # long's one decode token, at context 100
    assert records["long"].finish_s == pytest.approx(first_chunk + second_chunk + decode)


def test_a_repeated_prefix_is_served_from_the_workers_cache():
    shared = request("a", 0.0, 320, 1)
    repeat = WorkloadRequest("b", 1.0, np.concatenate([shared.token_ids, [7] * 8]).astype(np.uint32), 1, "test")
    result = simulate([shared, repeat], SimConfig(workers=2, policy="e2", cost=COST))
    records = {r.request_id: r for r in result.records}
    assert records["b"].num_cached_tokens == 320 and records["b"].worker_id == records["a"].worker_id
    assert records["b"].first_token_s - 1.0 == pytest.approx(0.010 + 0.001 * 8 + 0.0001 * 320)



def test_the_router_learns_a_request_ended_when_its_step_ends_not_at_a_heartbeat():
    """As live (RequestsFinished): with heartbeats 100 s apart, a short request that ended
    has left its worker's count in flight by the time the next one comes, so lpm's
    tie-break (fewest in flight) sends that one to the idle worker, not to the busy one."""
    requests = [request("long", 0.0, 100, 300, seed=1), request("short", 0.0, 100, 1, seed=2),
                request("next", 1.0, 100, 1, seed=3)]
    result = simulate(requests, SimConfig(workers=2, policy="lpm", cost=COST, heartbeat_interval_s=100.0))
    workers = {record.request_id: record.worker_id for record in result.records}
    assert workers["long"] != workers["short"]
    assert workers["next"] == workers["short"]


def test_a_worker_that_sat_idle_pays_the_profiles_wake_on_its_first_step():
    woken = dataclasses.replace(COST, wake=((0.5, 0.004),))
    prefill = 0.010 + 0.001 * 100
    b_done = 2.0 + 0.004 + prefill
    arrivals = [request("a", 0.0, 100, 1), request("b", 2.0, 100, 1, seed=1),
                request("c", b_done + 0.25, 100, 1, seed=2)]
    records = {r.request_id: r for r in simulate(arrivals, SimConfig(workers=1, policy="round_robin",
                                                                    cost=woken)).records}
    assert records["a"].first_token_s == pytest.approx(0.004 + prefill)  # it had never worked
    assert records["b"].first_token_s == pytest.approx(b_done)  # idle ~1.9 s: the whole extra
    assert records["c"].first_token_s - (b_done + 0.25) == pytest.approx(0.002 + prefill)  # halfway

def test_admission_refuses_what_cannot_meet_its_slo_in_simulation_too():
    burst = [request(f"r{i}", 0.0, 300, 2, seed=i) for i in range(50)]
    slo = {"test": Slo(ttft_s=2.0, tpot_s=1.0)}
    result = simulate(burst, SimConfig(workers=2, policy="least_load", cost=COST, admission=True, slos=slo))
    rejected = [r for r in result.records if r.rejected]
    admitted = [r for r in result.records if not r.rejected]
    assert rejected and admitted
    assert all(r.first_token_s - r.arrival_s <= 2.0 for r in admitted)


def test_the_simulator_is_deterministic_for_a_seed_and_runs_every_policy():
    cost = load_cost_model("a6000/mistral-7b")
    requests = poisson(make_workload("toolbench", 120, seed=3), rate=20.0, seed=3)
    for policy in ("round_robin", "least_load", "lpm", "cache_aware", "dynamo", "e2", "cost_aware"):
        config = SimConfig(workers=4, policy=policy, cost=cost, kv_blocks=4096, max_num_batched_tokens=4096)
        first, second = simulate(requests, config), simulate(requests, config)
        assert [(r.request_id, r.first_token_s, r.finish_s, r.worker_id) for r in first.records] == \
            [(r.request_id, r.first_token_s, r.finish_s, r.worker_id) for r in second.records]
        summary = summarize(first.records, {}, first.totals)["overall"]
        assert summary["completed"] == 120 and summary["ttft_mean_s"] > 0


@pytest.mark.parametrize("policy, changes", [
    ("e2", {}),
    ("lpm", {"kv_blocks": 600, "queue_policy": "priority"}),  # evictions and preemptions
    ("round_robin", {"max_num_batched_tokens": 8, "max_num_seqs": 6}),  # budget and seat limits
    ("cache_aware", {"index_ttl_s": 30.0, "admission": True, "slos": {"toolbench": Slo(ttft_s=1.0, tpot_s=0.05)}}),
])
def test_quiet_runs_as_one_event_give_the_same_results_as_stepping_one_by_one(policy, changes):
    requests = poisson(make_workload("toolbench", 150, seed=5), rate=12.0, seed=5)
    # Two arrivals at one instant: a quiet run must stop before it, not at it.
    requests[5] = dataclasses.replace(requests[5], arrival_s=requests[4].arrival_s)
    config = SimConfig(workers=3, policy=policy, cost=load_cost_model("a6000/mistral-7b"), **changes)
    stepped = simulate(requests, dataclasses.replace(config, fuse_quiet_steps=False))
    fused = simulate(requests, config)
    assert fused.records == stepped.records
    assert fused.steps == stepped.steps and fused.totals == stepped.totals
    assert any(record.output_tokens > 16 for record in fused.records)  # runs long enough to fuse


def test_named_spans_hash_a_prompt_as_chain_hashes_does_and_simulate_the_same(tmp_path):
    """A Mooncake trace names its 512-token spans (hash_ids): the simulator hashes each
    span once per parent and reuses it, with the same hashes and so the same results as
    hashing every prompt whole (docs/evaluation.md §3.3)."""
    trace = tmp_path / "trace.jsonl"
    records = [{"timestamp": 100 * index, "input_length": length, "output_length": 20, "hash_ids": ids}
               for index, (length, ids) in enumerate([(1100, [0, 1, 2]), (1024, [0, 1]), (1500, [0, 1, 3]),
                                                      (600, [5, 6]), (1030, [0, 1, 7]), (1100, [0, 1, 2])])]
    trace.write_text("".join(json.dumps(record) + "\n" for record in records))
    for scale in (1.0, 0.25, 0.3):  # 0.3: 154-token spans: only the first span's 9 full blocks are named
        requests = make_workload("mooncake", 10, seed=3, vocab_size=512, scale=scale, trace=str(trace))
        hashes = _PromptHashes(16)
        for request in requests:
            assert hashes(7, request, request.token_ids) == chain_hashes(7, request.token_ids, 16)
        if scale == 0.3:
            assert set(hashes.spans) == {(7, 0), (7, 5)}  # the first spans of the two distinct first hash_ids
            assert {len(named) for named in hashes.spans.values()} == {154 // 16}
        else:
            assert len(hashes.spans) == 3  # the whole spans 0, 0-1 and 5, each after its parent, once
        unnamed = [dataclasses.replace(request, span_ids=()) for request in requests]
        config = SimConfig(workers=2, policy="e2", cost=load_cost_model("a6000/mistral-7b"), kv_blocks=200)
        named_run, unnamed_run = simulate(requests, config), simulate(unnamed, config)
        assert named_run.records == unnamed_run.records and named_run.steps == unnamed_run.steps
        assert named_run.totals == unnamed_run.totals


@pytest.mark.parametrize("shape", ["toolbench", "loogle", "videoqa", "programming"])
def test_generated_shapes_name_their_shared_part_and_simulate_as_if_unnamed(shape):
    """A generated shape names each prompt's shared leading part (a tool's prompt, a
    document, a video, the few-shot prefix): equal names lead equal tokens, the simulator
    hashes that part once per run, and the results are those of hashing every prompt whole."""
    requests = make_workload(shape, 40, seed=1, vocab_size=512, scale=0.05)
    leading: dict[tuple[int, ...], bytes] = {}
    for request in requests:
        assert len(request.span_ids) == 1 and 16 <= request.span_tokens < len(request.token_ids)
        part = request.token_ids[:request.span_tokens].tobytes()
        assert leading.setdefault(request.span_ids, part) == part
    hashes = _PromptHashes(16)
    for request in requests:
        assert hashes(7, request, request.token_ids) == chain_hashes(7, request.token_ids, 16)
    assert len(hashes.spans) == len(leading) < len(requests)
    unnamed = [dataclasses.replace(request, span_ids=()) for request in requests]
    config = SimConfig(workers=2, policy="e2", cost=load_cost_model("a6000/mistral-7b"), kv_blocks=400)
    named_run, unnamed_run = simulate(poisson(requests, 2.0), config), simulate(poisson(unnamed, 2.0), config)
    assert named_run.records == unnamed_run.records and named_run.steps == unnamed_run.steps
    assert named_run.totals == unnamed_run.totals
