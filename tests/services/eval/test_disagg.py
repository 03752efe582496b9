"""Prefill/decode pools in the simulator: the KV pull's time and bytes, link contention,
conditional local prefill, and the decode worker's choice."""
import dataclasses

import numpy as np
import pytest

from common.cost_model import CostModel, LatencyFit, load_cost_model
from services.eval.disagg import (
    LINKS,
    DecodeCandidate,
    Link,
    LinkQueues,
    blocks_to_move,
    layout_for_model,
    link_named,
    rank_decode_workers,
)
from services.eval.report import summarize
from services.eval.simulator import SimConfig, simulate
from services.eval.workloads import make_workload
from services.eval.workloads.arrivals import poisson
from services.eval.workloads.base import WorkloadRequest

COST = CostModel("hand", prefill=LatencyFit(a=0.010, b=0.001, c=0.0001, d=0.0),
                 decode=LatencyFit(a=0.005, b=0.002, c=0.0, d=0.00001))
# 1 MB per block over 1 GB/s with 1 ms latency: a block moves in 1 ms after the first 1 ms.
LINK = Link("test", 1e9, 0.001)
BLOCK_BYTES = 1_000_000


def request(request_id: str, arrival_s: float, prompt_tokens: int, outputs: int, seed: int = 0) -> WorkloadRequest:
    tokens = np.random.default_rng(seed).integers(4, 500, prompt_tokens).astype(np.uint32)
    return WorkloadRequest(request_id, arrival_s, tokens, outputs, "test")


def pools(prefill: int = 1, decode: int = 1, workers: int = 0, **overrides) -> SimConfig:
    settings = {"workers": workers, "prefill_workers": prefill, "decode_workers": decode, "policy": "round_robin",
                "cost": COST, "link": LINK, "kv_bytes_per_block": BLOCK_BYTES, "max_local_prefill_tokens": 0}
    return SimConfig(**(settings | overrides))


def test_links_and_layouts_are_sized_from_their_published_figures():
    assert LINKS["rdma-400g"].bandwidth_bytes_s == 50e9 and LINKS["tcp-25g"].bandwidth_bytes_s == 3.125e9
    assert LINKS["nvlink"].bandwidth_bytes_s > LINKS["rdma-400g"].bandwidth_bytes_s
    assert LINK.seconds(3 * BLOCK_BYTES) == pytest.approx(0.004)
    # Mistral-7B: 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes = 128 KiB per token
    assert layout_for_model("mistral-7b", 16).bytes_per_block == 16 * 128 * 1024
    with pytest.raises(ValueError, match="known: nvlink"):
        link_named("carrier-pigeon")


def test_blocks_to_move_count_the_partial_last_block_and_skip_what_is_held():
    assert blocks_to_move(100, 0, 16) == 7
    assert blocks_to_move(100, 6, 16) == 1
    assert blocks_to_move(96, 6, 16) == 0


def test_a_link_carries_one_transfer_at_a_time_and_each_holds_both_ends():
    queues = LinkQueues(LINK)
    assert queues.reserve(0.0, "p0", "d0", BLOCK_BYTES) == pytest.approx((0.0, 0.002))
    assert queues.reserve(0.0, "p1", "d0", BLOCK_BYTES) == pytest.approx((0.002, 0.004))  # d0's link is busy
    assert queues.reserve(0.0, "p1", "d1", BLOCK_BYTES) == pytest.approx((0.004, 0.006))  # p1's link is busy
    assert queues.reserve(0.0, "p2", "d2", BLOCK_BYTES) == pytest.approx((0.0, 0.002))  # neither is


def test_decode_ranking_prefers_a_holder_by_the_transfer_it_saves_and_needs_room():
    def ranked(*candidates):
        return rank_decode_workers(candidates, prompt_tokens=160, block_size=16, seconds_per_block=0.01)

    idle = DecodeCandidate("idle", 0.0, 1000, 0)
    holder = DecodeCandidate("holder", 0.05, 1000, 8)  # saves 8 blocks = 0.08 s of pull
    busy_holder = DecodeCandidate("busy", 0.2, 1000, 10)
    full = DecodeCandidate("full", 0.0, 5, 0)
    assert ranked(idle, holder, busy_holder, full) == ["holder", "idle", "busy", "full"]
    assert ranked(full, DecodeCandidate("fuller", 0.0, 3, 0)) == ["full", "fuller"]


def test_a_handed_off_request_streams_its_first_token_then_pulls_its_kv_before_decoding():
    result = simulate([request("r", 0.0, 100, 3)], pools())
    [record] = result.records
    prefill = 0.010 + 0.001 * 100
    assert record.first_token_s == pytest.approx(prefill)  # the transfer is not in TTFT
    transfer = 0.001 + 7 * BLOCK_BYTES / 1e9  # 7 blocks (the last partial)
    assert record.transfer_s == pytest.approx(transfer)
    assert result.totals.transfer_bytes == 7 * BLOCK_BYTES
    decodes = [0.005 + 0.002 + 0.00001 * context for context in (100, 101)]  # two more tokens
    assert record.finish_s == pytest.approx(prefill + transfer + sum(decodes))
    assert record.worker_id == "prefill-0>decode-0" and record.output_tokens == 3
    assert record.decode_wait_s == 0.0
    summary = summarize(result.records, {}, result.totals)["overall"]
    assert summary["transfer_mean_s"] == pytest.approx(transfer) and summary["gpus"] == 2


def test_a_short_missing_prefill_stays_on_the_decode_worker_and_nothing_moves():
    result = simulate([request("r", 0.0, 100, 3)], pools(max_local_prefill_tokens=100))
    [record] = result.records
    assert record.worker_id == "decode-0" and record.transfer_s == 0.0
    assert result.totals.transfer_bytes == 0


def test_a_decode_worker_that_holds_the_prompt_pulls_only_what_it_lacks():
    first = request("a", 0.0, 320, 2)
    again = WorkloadRequest("b", 1.0, np.concatenate([first.token_ids, [7] * 40]).astype(np.uint32), 2, "test")
    result = simulate([first, again], pools(decode=2))
    records = {r.request_id: r for r in result.records}
    assert records["a"].worker_id == records["b"].worker_id  # the holder, though both are idle
    # b's 360 tokens fill 23 blocks; the decode worker holds a's 20 full ones
    assert result.totals.transfer_bytes == (20 + 3) * BLOCK_BYTES
    assert records["b"].transfer_s == pytest.approx(0.001 + 3 * BLOCK_BYTES / 1e9)


def test_transfers_into_one_decode_worker_queue_on_its_link():
    burst = [request(f"r{i}", 0.0, 160, 2, seed=i) for i in range(2)]
    result = simulate(burst, pools(prefill=2))
    first, second = sorted(result.records, key=lambda r: r.first_token_s)
    one = 0.001 + 10 * BLOCK_BYTES / 1e9
    assert first.first_token_s == pytest.approx(second.first_token_s)  # two prefill workers, in parallel
    assert first.transfer_s == pytest.approx(one) and second.transfer_s == pytest.approx(2 * one)


def test_colocated_and_pooled_workers_serve_together_and_every_request_finishes():
    burst = [request(f"r{i}", 0.01 * i, 200 + 10 * i, 5, seed=i) for i in range(12)]
    result = simulate(burst, pools(prefill=1, decode=2, workers=1, policy="least_load",
                                   max_local_prefill_tokens=50))
    assert all(r.finish_s is not None and r.output_tokens == 5 for r in result.records)
    assert {r.worker_id.split(">")[0].split("-")[0] for r in result.records} >= {"worker", "prefill"}
    assert result.totals.gpus == 4


def test_pools_come_in_pairs_and_need_the_models_layout():
    with pytest.raises(ValueError, match="needs a decode pool"):
        SimConfig(workers=1, prefill_workers=1, policy="round_robin", cost=COST)
    with pytest.raises(ValueError, match="kv_bytes_per_block"):
        SimConfig(workers=0, prefill_workers=1, decode_workers=1, policy="round_robin", cost=COST)


def test_quiet_runs_stop_for_landing_transfers_so_fused_and_stepped_runs_agree():
    requests = poisson(make_workload("programming", 80, seed=3), rate=3.0, seed=3)
    config = SimConfig(workers=1, prefill_workers=1, decode_workers=2, policy="e2",
                       cost=load_cost_model("a6000/mistral-7b"), link=LINKS["tcp-25g"],
                       kv_bytes_per_block=layout_for_model("mistral-7b", 16).bytes_per_block)
    stepped = simulate(requests, dataclasses.replace(config, fuse_quiet_steps=False))
    fused = simulate(requests, config)
    assert fused.records == stepped.records and fused.totals == stepped.totals and fused.steps == stepped.steps
    assert fused.totals.transfer_bytes > 0 and all(r.finish_s is not None for r in fused.records)
    assert any(r.decode_wait_s > 0 for r in fused.records)
