"""Workload generators, Mooncake replay, arrival processes and workload statistics."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.cost_model import TINY_CPU
from services.eval.workloads import WORKLOADS, make_workload, workload_stats
from services.eval.workloads.arrivals import bursty, poisson, rate_for_load, trace
from services.eval.workloads.base import Synth, WorkloadRequest

GENERATED = ["toolbench", "agent", "programming", "videoqa", "loogle", "chat"]
SHARED_TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"

# The seed's ranges for Preble's workloads, and a sample size per shape big enough for
# the statistics to settle (documented in services/eval/workloads/__init__.py).
RATIO_RANGE, SHARED_RANGE, REUSE_RANGE = (37, 2494), (0.85, 0.97), (8.6, 126)
PREBLE_SAMPLES = {"toolbench": 400, "agent": 400, "programming": 300, "videoqa": 300, "loogle": 200}


def same(first: list[WorkloadRequest], second: list[WorkloadRequest]) -> bool:
    return len(first) == len(second) and all(
        a.request_id == b.request_id and a.output_tokens == b.output_tokens and a.arrival_s == b.arrival_s
        and np.array_equal(a.token_ids, b.token_ids) for a, b in zip(first, second))


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def request(tokens, output_tokens=1, arrival_s=0.0, tenant="", request_id="r") -> WorkloadRequest:
    return WorkloadRequest(request_id, arrival_s, np.asarray(tokens, dtype=np.uint32), output_tokens, "test", tenant)


def test_every_shape_is_selectable_by_name():
    assert set(WORKLOADS) == set(GENERATED) | {"mooncake"}
    with pytest.raises(ValueError, match="unknown workload 'nope'.*toolbench"):
        make_workload("nope", 1)


@pytest.mark.parametrize("name", GENERATED)
def test_generated_shapes_are_reproducible_labelled_and_in_vocab(name):
    requests = make_workload(name, 60, seed=3, vocab_size=512)
    assert same(requests, make_workload(name, 60, seed=3, vocab_size=512))
    assert not same(requests, make_workload(name, 60, seed=4, vocab_size=512))
    assert len(requests) == 60 and len({r.request_id for r in requests}) == 60
    for r in requests:
        assert r.slo_class == name and r.arrival_s == 0.0 and r.output_tokens >= 1
        assert r.token_ids.dtype == np.uint32 and len(r.token_ids) >= 1
        assert 1 <= r.token_ids.min() and r.token_ids.max() < 512


@pytest.mark.parametrize("name", GENERATED)
def test_scale_shrinks_every_length(name):
    full = make_workload(name, 40, seed=1)
    small = make_workload(name, 40, seed=1, scale=0.05)
    for big, little in zip(full, small):  # the same requests, only shorter
        assert 0.03 * len(big.token_ids) < len(little.token_ids) <= max(0.08 * len(big.token_ids), 8)
        assert little.output_tokens == max(round(0.05 * big.output_tokens), 1)


@pytest.mark.parametrize("name", sorted(PREBLE_SAMPLES))
def test_preble_shapes_fall_in_the_seed_ranges(name):
    stats = workload_stats(make_workload(name, PREBLE_SAMPLES[name], seed=0))
    assert RATIO_RANGE[0] <= stats["prompt_output_ratio"] <= RATIO_RANGE[1], stats
    assert SHARED_RANGE[0] <= stats["shared_fraction"] <= SHARED_RANGE[1], stats
    assert REUSE_RANGE[0] <= stats["reuse_count"] <= REUSE_RANGE[1], stats


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.3])
def test_synth_draws_in_one_call_what_it_draws_one_by_one(scale):
    """Synth.lengths and token_runs give the values that length() and tokens() give one
    call at a time, and leave both streams where those calls would (scale 0.5 rounds
    halves: to even, as round() does)."""
    draws = [(100, 50, 10, 400), (38, 15, 4, 160), (7, 9, 1, 12)]
    batched, single = Synth(3, 512, scale), Synth(3, 512, scale)
    lengths = batched.lengths(draws, 300)
    assert lengths.tolist() == [[single.length(*draw) for draw in draws] for _ in range(300)]
    runs = batched.token_runs(lengths[:, 2])
    assert all(np.array_equal(run, single.tokens(int(length))) for run, length in zip(runs, lengths[:, 2]))
    assert batched.length(50, 20, 1, 99) == single.length(50, 20, 1, 99)
    assert np.array_equal(batched.tokens(33), single.tokens(33))


@pytest.mark.parametrize("name", GENERATED)
def test_a_shared_part_is_kept_once_for_every_prompt_that_holds_it(name):
    """A generated prompt keeps its parts (a tool's prompt, a document, the few-shot prefix,
    a conversation's earlier turns) as the arrays they were drawn as, so a part that many
    prompts hold is stored once; its token ids are the parts joined."""
    requests = make_workload(name, 200, seed=2, vocab_size=512, scale=0.2)
    parts = [part for request in requests for part in request.prompt]
    distinct = {id(part): part for part in parts}
    assert len(distinct) < len(parts)
    assert sum(len(part) for part in distinct.values()) < sum(request.num_tokens for request in requests)
    for request in requests:
        assert isinstance(request.prompt, tuple)
        assert np.array_equal(request.token_ids, np.concatenate(request.prompt))
        assert request.num_tokens == len(request.token_ids) and request.token_ids.dtype == np.uint32


def test_toolbench_zipf_exponent_concentrates_popularity():
    def top_tool_share(zipf_a: float) -> float:
        requests = make_workload("toolbench", 300, seed=0, zipf_a=zipf_a, num_tools=20)
        heads = [r.token_ids[:8].tobytes() for r in requests]
        return max(heads.count(head) for head in set(heads)) / len(heads)

    assert top_tool_share(0.0) < 0.15 < top_tool_share(1.1) < top_tool_share(2.5)


def test_agent_turns_extend_the_previous_prompt():
    requests = make_workload("agent", 200, seed=0)
    extending = 0
    for index, current in enumerate(requests):
        extending += any(len(earlier.token_ids) < len(current.token_ids)
                         and np.array_equal(current.token_ids[:len(earlier.token_ids)], earlier.token_ids)
                         for earlier in requests[:index])
    assert extending >= 0.85 * len(requests)


def test_chat_shares_one_system_prompt():
    requests = make_workload("chat", 50, seed=0)
    assert len({r.token_ids[:400].tobytes() for r in requests}) == 1


# Two prompts that share their first two 512-token blocks, and one that shares nothing.
SHARED_PREFIX_TRACE = [
    {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [5, 6]},
]


def test_mooncake_replay_gives_equal_blocks_for_equal_hash_ids(tmp_path):
    path = write_trace(tmp_path / "trace.jsonl", SHARED_PREFIX_TRACE)
    requests = make_workload("mooncake", 10, seed=0, vocab_size=512, trace=str(path))
    assert [r.request_id for r in requests] == ["mooncake-1", "mooncake-0", "mooncake-2"]  # by arrival
    assert [r.arrival_s for r in requests] == [0.25, 1.5, 3.0]
    assert [len(r.token_ids) for r in requests] == [1024, 1100, 600]
    assert [r.output_tokens for r in requests] == [3, 7, 5]
    assert all(r.slo_class == "mooncake" and 4 <= r.token_ids.min() and r.token_ids.max() < 512 for r in requests)
    shorter, longer, other = (r.token_ids for r in requests)
    assert np.array_equal(longer[:1024], shorter)
    assert not np.array_equal(other[:512], shorter[:512])
    assert not np.array_equal(shorter[:512], shorter[512:])
    # Each prompt holds its blocks as views of one table of the trace's blocks, not a copy.
    assert [r.num_tokens for r in requests] == [1024, 1100, 600]
    first_blocks = [r.prompt[0] for r in requests if isinstance(r.prompt, tuple)]
    assert len(first_blocks) == 3 and np.shares_memory(first_blocks[0], first_blocks[1])
    assert same(requests, make_workload("mooncake", 10, seed=0, vocab_size=512, trace=str(path)))
    assert not same(requests, make_workload("mooncake", 10, seed=1, vocab_size=512, trace=str(path)))
    assert len(make_workload("mooncake", 2, trace=str(path))) == 2


def test_mooncake_copies_replay_the_trace_as_sessions_that_share_nothing_across_copies(tmp_path):
    path = write_trace(tmp_path / "trace.jsonl", SHARED_PREFIX_TRACE)
    alone = make_workload("mooncake", 10, seed=0, vocab_size=512, trace=str(path))
    both = make_workload("mooncake", 10, seed=0, vocab_size=512, trace=str(path), copies=2)
    assert [r.request_id for r in both] == ["mooncake-1", "mooncake-4", "mooncake-0", "mooncake-3",
                                            "mooncake-2", "mooncake-5"]  # by arrival, copy 0 first
    assert [r.arrival_s for r in both] == [0.25, 0.25, 1.5, 1.5, 3.0, 3.0]
    first, second = both[0::2], both[1::2]
    assert same(first, alone)  # copy 0 is the trace as it is
    assert [r.span_ids for r in second] == [(7, 8), (7, 8, 9), (12, 13)]  # ids + (largest + 1)
    assert [len(r.token_ids) for r in second] == [len(r.token_ids) for r in alone]
    shorter, longer, _ = (r.token_ids for r in second)
    assert np.array_equal(longer[:1024], shorter)  # a copy shares what the trace shares...
    assert all(not np.array_equal(a.token_ids[:512], b.token_ids[:512]) for a in first for b in second)  # ...only
    with pytest.raises(ValueError, match="copies must be an integer >= 1"):
        make_workload("mooncake", 10, trace=str(path), copies=0)


def test_mooncake_scale_keeps_shared_blocks_whole(tmp_path):
    path = write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 1030, "output_length": 1, "hash_ids": [0, 1, 3]},
    ])
    first, second = make_workload("mooncake", 2, scale=0.25, trace=str(path))
    assert len(first.token_ids) == 2 * 128 + round(76 * 128 / 512)
    assert len(second.token_ids) == 2 * 128 + 2
    assert np.array_equal(first.token_ids[:256], second.token_ids[:256])
    assert (first.output_tokens, second.output_tokens) == (10, 1)


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}


@pytest.mark.parametrize("line, reason", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 4}', "missing field 'hash_ids'"),
    (json.dumps({**GOOD, "input_length": "600"}), "input_length must be an integer"),
    (json.dumps({**GOOD, "output_length": -1}), "output_length must be >= 0"),
    (json.dumps({**GOOD, "timestamp": -5}), "timestamp must be a number"),
    (json.dumps({**GOOD, "input_length": 1100}), "hash_ids has 2 ids but input_length 1100 needs 3"),
    (json.dumps({**GOOD, "hash_ids": [0, "x"]}), "hash_ids must be a list of integers"),
    ("[1, 2]", "expected a JSON object"),
    ("{oops", "not valid JSON"),
])
def test_a_malformed_trace_line_is_named(tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {reason}"):
        make_workload("mooncake", 10, trace=str(path))


def test_mooncake_needs_a_readable_trace(tmp_path):
    with pytest.raises(ValueError, match="pass trace="):
        make_workload("mooncake", 10)
    with pytest.raises(ValueError, match="cannot read trace"):
        make_workload("mooncake", 10, trace=str(tmp_path / "missing.jsonl"))


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake trace is not checked out")
def test_the_whole_shared_trace_replays():
    requests = make_workload("mooncake", 10_000, trace=str(SHARED_TRACE))
    assert len(requests) == 3993
    assert sum(len(r.token_ids) for r in requests) == 61_194_628


def test_poisson_arrivals_have_the_mean_rate_and_keep_order():
    requests = make_workload("chat", 4000, seed=0, scale=0.01)
    timed = poisson(requests, rate=50.0, seed=1)
    assert [r.request_id for r in timed] == [r.request_id for r in requests]
    assert all(r.arrival_s == 0.0 for r in requests)
    assert len(timed) / timed[-1].arrival_s == pytest.approx(50.0, rel=0.05)
    assert same(timed, poisson(requests, rate=50.0, seed=1))


def test_bursty_arrivals_idle_between_bursts_at_the_mean_rate():
    requests = make_workload("chat", 4000, seed=0, scale=0.01)
    timed = bursty(requests, rate=20.0, seed=1, on_s=1.0, off_s=3.0)
    arrivals = np.array([r.arrival_s for r in timed])
    assert np.all(np.mod(arrivals, 4.0) < 1.0)  # nothing arrives in an off period
    assert np.diff(arrivals).max() >= 3.0
    periods = math.ceil(arrivals[-1] / 4.0)
    assert len(arrivals) / (periods * 4.0) == pytest.approx(20.0, rel=0.05)


def test_trace_arrivals_scale_the_requests_own_times():
    requests = [request([5] * 4, arrival_s=t, request_id=f"r{t}") for t in (3.0, 1.0, 2.0)]
    timed = trace(requests, time_scale=0.5)
    assert [(r.request_id, r.arrival_s) for r in timed] == [("r1.0", 0.5), ("r2.0", 1.0), ("r3.0", 1.5)]
    with pytest.raises(ValueError):
        trace(requests, time_scale=-1.0)


def test_rate_for_load_is_linear_in_load_and_workers():
    requests = [request([5] * 100, output_tokens=20), request([5] * 300, output_tokens=40)]
    service_s = [TINY_CPU.prefill_s(n) + out * TINY_CPU.decode_step_s(32, n) / 32 for n, out in ((100, 20), (300, 40))]
    base = rate_for_load(requests, 1.0, 1, TINY_CPU)
    assert base == pytest.approx(2 / sum(service_s))
    assert rate_for_load(requests, 0.5, 1, TINY_CPU) == pytest.approx(base / 2)
    assert rate_for_load(requests, 0.8, 4, TINY_CPU) == pytest.approx(base * 0.8 * 4)


def test_workload_stats_counts_blocks_an_earlier_request_had():
    shared = list(range(4, 36))  # two 16-token blocks
    requests = [request(shared + [40] * 8, output_tokens=4), request(shared + [41] * 16, output_tokens=4),
                request(shared[:16] + [42] * 16, output_tokens=4), request(shared, tenant="other")]
    stats = workload_stats(requests)
    assert stats["num_requests"] == 4
    assert stats["mean_prompt_tokens"] == (40 + 48 + 32 + 32) / 4
    assert stats["prompt_output_ratio"] == pytest.approx((152 / 4) / (13 / 4))
    assert stats["shared_fraction"] == pytest.approx((32 + 16) / 152)  # the other tenant shares nothing
    assert stats["reuse_count"] == pytest.approx((3 + 2) / 2)


def test_workloads_do_not_import_torch():
    code = "import sys, services.eval.workloads.arrivals; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3]).returncode == 0
