"""Run metrics against hand-computed values, and the report's outputs."""
from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from services.eval.report import (
    RequestRecord,
    RunTotals,
    Slo,
    jain_index,
    json_line,
    percentile,
    plot_sweep,
    print_table,
    print_ttft_split,
    summarize,
    tpot_of,
)
from services.local_cluster import REPO, child_env

REQUIRED_KEYS = {
    "requests", "completed", "rejected", "failed",
    "ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s",
    "e2e_mean_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s",
    "queue_mean_s", "prefill_mean_s", "transfer_mean_s", "decode_mean_s",
    "slo_attainment", "goodput_rps", "goodput_per_gpu", "hit_rate", "jain", "max_slowdown",
}
OVERALL_KEYS = REQUIRED_KEYS | {"evictions", "eviction_recompute_s", "transfer_bytes"}

SLOS = {"chat": Slo(ttft_s=0.5, tpot_s=0.15)}  # "batch" has no SLO
TOTALS = RunTotals(duration_s=10.0, gpus=2, evictions=3, eviction_recompute_s=0.25,
                   transfer_bytes=4096)


def _records() -> list[RequestRecord]:
    return [
        # meets: TTFT 0.2, TPOT 1.0 / 10 = 0.1, e2e 1.2, slowdown 2
        RequestRecord("a", "chat", 0.0, 100, output_tokens=11, num_cached_tokens=50,
                      first_token_s=0.2, finish_s=1.2, queue_s=0.1, prefill_s=0.1,
                      decode_s=1.0, ideal_s=0.6),
        # misses on TTFT 1.0; TPOT 0 (one token), e2e 1.0, slowdown 2
        RequestRecord("b", "chat", 1.0, 100, output_tokens=1, first_token_s=2.0,
                      finish_s=2.0, queue_s=0.7, prefill_s=0.3, ideal_s=0.5),
        RequestRecord("c", "chat", 2.0, 100, rejected=True),
        # no SLO: completion meets it; TTFT 1.0, TPOT 2.0 / 4 = 0.5, e2e 3.0, slowdown 3
        RequestRecord("d", "batch", 0.0, 200, output_tokens=5, num_cached_tokens=150,
                      first_token_s=1.0, finish_s=3.0, transfer_s=0.2, ideal_s=1.0),
        RequestRecord("e", "batch", 0.5, 200, failed=True),
    ]


def test_percentile_is_numpy_linear_and_empty_is_zero():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([], 99) == 0.0


def test_jain_index_on_known_vectors():
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([2, 2, 3]) == pytest.approx(49 / 51)
    assert jain_index([0, 0]) == 1.0
    assert jain_index([]) == 0.0


def test_tpot_excludes_the_first_token():
    r = RequestRecord("x", "c", 0.0, 10, output_tokens=5, first_token_s=1.0, finish_s=3.0)
    assert tpot_of(r) == pytest.approx(0.5)
    r.output_tokens = 1
    assert tpot_of(r) == 0.0
    r.output_tokens = 0
    assert tpot_of(r) == 0.0


def test_overall_matches_hand_computed_values():
    o = summarize(_records(), SLOS, TOTALS)["overall"]
    assert OVERALL_KEYS <= o.keys()
    assert (o["requests"], o["completed"], o["rejected"], o["failed"]) == (5, 3, 1, 1)
    assert o["ttft_mean_s"] == pytest.approx((0.2 + 1.0 + 1.0) / 3)
    assert o["tpot_mean_s"] == pytest.approx((0.1 + 0.0 + 0.5) / 3)
    assert o["e2e_mean_s"] == pytest.approx((1.2 + 1.0 + 3.0) / 3)
    assert o["e2e_p50_s"] == pytest.approx(1.2)
    assert o["e2e_p95_s"] == pytest.approx(1.2 + 0.9 * 1.8)  # rank 1.9 of [1.0, 1.2, 3.0]
    assert o["queue_mean_s"] == pytest.approx(0.8 / 3)
    assert o["prefill_mean_s"] == pytest.approx(0.4 / 3)
    assert o["transfer_mean_s"] == pytest.approx(0.2 / 3)
    assert o["decode_mean_s"] == pytest.approx(1.0 / 3)
    # a and d meet; b misses its TTFT; the rejected c and the failed e count as misses
    assert o["slo_attainment"] == pytest.approx(2 / 5)
    assert o["meets_slo_target"] is False
    assert o["goodput_rps"] == pytest.approx(0.2)
    assert o["goodput_per_gpu"] == pytest.approx(0.1)
    assert o["hit_rate"] == pytest.approx(200 / 400)
    assert o["jain"] == pytest.approx(49 / 51)
    assert o["max_slowdown"] == pytest.approx(3.0)
    assert o["slowdown_basis"] == "ideal"
    assert (o["evictions"], o["eviction_recompute_s"], o["transfer_bytes"]) == (3, 0.25, 4096)


def test_classes_are_split():
    classes = summarize(_records(), SLOS, TOTALS)["classes"]
    assert list(classes) == ["batch", "chat"]
    chat, batch = classes["chat"], classes["batch"]
    assert REQUIRED_KEYS <= chat.keys() and REQUIRED_KEYS <= batch.keys()
    assert (chat["requests"], chat["completed"], chat["rejected"], chat["failed"]) == (3, 2, 1, 0)
    assert chat["slo_attainment"] == pytest.approx(1 / 3)
    assert chat["goodput_rps"] == pytest.approx(0.1)
    assert chat["goodput_per_gpu"] == pytest.approx(0.05)
    assert chat["hit_rate"] == pytest.approx(50 / 200)
    assert chat["ttft_p50_s"] == pytest.approx(0.6)
    assert chat["tpot_mean_s"] == pytest.approx(0.05)
    assert chat["jain"] == pytest.approx(1.0)
    # no SLO: its one completed request meets, its failed one misses
    assert (batch["requests"], batch["completed"], batch["failed"]) == (2, 1, 1)
    assert batch["slo_attainment"] == pytest.approx(0.5)
    assert batch["hit_rate"] == pytest.approx(0.75)
    assert batch["max_slowdown"] == pytest.approx(3.0)


def test_tpot_target_is_checked():
    slow = RequestRecord("s", "chat", 0.0, 10, output_tokens=3, first_token_s=0.1,
                         finish_s=0.9)  # TPOT 0.4 > 0.15
    assert summarize([slow], SLOS, TOTALS)["overall"]["slo_attainment"] == 0.0


def test_fairness_falls_back_to_e2e_when_no_ideal_time_is_known():
    records = [
        RequestRecord("a", "c", 0.0, 10, output_tokens=2, first_token_s=0.5, finish_s=1.0),
        RequestRecord("b", "c", 0.0, 10, output_tokens=2, first_token_s=0.5, finish_s=3.0),
    ]
    o = summarize(records, {}, TOTALS)["overall"]
    assert o["jain"] == pytest.approx(16 / 20)  # over e2e [1, 3]
    assert o["slowdown_basis"] == "e2e"
    assert o["max_slowdown"] == 0.0


def test_empty_run_gives_zeros_and_serialises():
    result = summarize([], SLOS, RunTotals(duration_s=0.0, gpus=0))
    o = result["overall"]
    assert result["classes"] == {}
    assert o["requests"] == 0 and o["slo_attainment"] == 0.0 and o["ttft_p99_s"] == 0.0
    assert o["goodput_rps"] == 0.0 and o["goodput_per_gpu"] == 0.0 and o["jain"] == 0.0
    assert json.loads(json_line({"p": result}))["p"]["overall"]["hit_rate"] == 0.0


def test_json_line_round_trips():
    results = {"round_robin": summarize(_records(), SLOS, TOTALS),
               "prefix": summarize(_records()[:2], SLOS, TOTALS)}
    line = json_line(results)
    assert "\n" not in line
    decoded = json.loads(line)
    assert list(decoded) == ["round_robin", "prefix"]
    for value in decoded.values():
        assert set(value) == {"overall", "classes"}
        assert OVERALL_KEYS <= value["overall"].keys()
    assert REQUIRED_KEYS <= decoded["round_robin"]["classes"]["batch"].keys()
    assert decoded["round_robin"]["overall"]["slo_attainment"] == pytest.approx(0.4)


def test_table_prints_each_policy_and_its_classes():
    results = {"round_robin": summarize(_records(), SLOS, TOTALS),
               "prefix_aware": summarize(_records(), SLOS, TOTALS)}
    out = io.StringIO()
    print_table(results, file=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["policy", "reqs"]
    assert len(lines) == 1 + 2 * 3  # header, then each policy and its two classes
    assert lines[1].startswith("round_robin") and lines[4].startswith("prefix_aware")
    assert lines[2].startswith("  batch") and lines[3].startswith("  chat")
    assert "0.400" in lines[1]  # overall attainment


def _disaggregated_records() -> list[RequestRecord]:
    return [
        RequestRecord("a", "chat", 0.0, 100, output_tokens=11, first_token_s=0.2, second_token_s=0.3, finish_s=1.2,
                      timings={"queue_s": 0.01, "prefill_s": 0.1, "decode_wait_s": 0.002, "transfer_s": 0.03}),
        # the decode worker held every block: no transfer
        RequestRecord("b", "chat", 1.0, 100, output_tokens=5, first_token_s=1.5, second_token_s=1.6, finish_s=2.0,
                      timings={"queue_s": 0.03, "prefill_s": 0.3, "decode_wait_s": 0.0}),
        RequestRecord("c", "chat", 0.0, 100, output_tokens=3, first_token_s=0.1, finish_s=0.3),  # co-located
        RequestRecord("d", "chat", 0.0, 100, failed=True, timings={"queue_s": 9.0}),  # not completed
    ]


def test_the_ttft_split_summarises_the_disaggregated_requests_worker_timings():
    split = summarize(_disaggregated_records(), {}, TOTALS)["ttft_split"]
    assert (split["requests"], split["completed"], split["second_token_requests"]) == (2, 3, 1)
    assert split["queue_p50_s"] == pytest.approx(0.02) and split["queue_p90_s"] == pytest.approx(0.028)
    assert split["prefill_p50_s"] == pytest.approx(0.2) and split["prefill_p90_s"] == pytest.approx(0.28)
    assert split["decode_wait_p50_s"] == pytest.approx(0.001)
    assert split["transfer_p50_s"] == split["transfer_p90_s"] == pytest.approx(0.03)  # a alone moved KV
    # a: 0.03 of the 0.3 s to its second token; of its TTFT (which the transfer does not delay) 0.03 / 0.2
    assert split["transfer_share_of_first_decode_p50"] == pytest.approx(0.1)
    assert split["transfer_over_ttft_p50"] == pytest.approx(0.15)
    assert json.loads(json_line({"live": summarize(_disaggregated_records(), {}, TOTALS)}))["live"]["ttft_split"] \
        == pytest.approx(split)


def test_a_run_without_timings_has_no_split_section():
    result = summarize(_records(), SLOS, TOTALS)
    out = io.StringIO()
    print_ttft_split({"live": result}, file=out)
    assert "ttft_split" not in result and out.getvalue() == ""


def test_the_split_section_prints_each_step_and_the_transfer_share():
    out = io.StringIO()
    print_ttft_split({"live": summarize(_disaggregated_records(), {}, TOTALS)}, file=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("TTFT split, live: 2 of 3 completed requests disaggregated")
    assert [line.split() for line in lines[2:6]] == [["queue", "20.0", "28.0"], ["prefill", "200.0", "280.0"],
                                                     ["decode_wait", "1.0", "1.8"], ["transfer", "30.0", "30.0"]]
    assert lines[6].split()[:5] == ["transfer_share_of_first_decode", "p50", "0.100", "p90", "0.100:"]


def test_without_a_second_token_the_transfer_is_compared_with_ttft():
    one_token = RequestRecord("a", "chat", 0.0, 100, output_tokens=1, first_token_s=0.2, finish_s=0.2,
                              timings={"transfer_s": 0.05})
    out = io.StringIO()
    print_ttft_split({"live": summarize([one_token], {}, TOTALS)}, file=out)
    assert out.getvalue().splitlines()[-1].split()[:3] == ["transfer_over_ttft", "p50", "0.250"]


def test_plot_sweep_writes_pngs(tmp_path):
    sweep = {
        policy: {x: summarize(_records()[: int(x)], SLOS, TOTALS) for x in (2.0, 4.0, 5.0)}
        for policy in ("round_robin", "prefix_aware")
    }
    paths = plot_sweep(sweep, "share ratio", tmp_path / "plots")
    assert [p.name for p in paths] == [
        "share_ratio_ttft_mean_s.png", "share_ratio_e2e_p99_s.png",
        "share_ratio_slo_attainment.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _sim_stderr(stderr) -> str:
    argv = [sys.executable, "-m", "services.cli", "sim", "--workload", "toolbench", "--workers", "2",
            "--num-requests", "30", "--profile", "a6000/mistral-7b", "--policy", "round_robin"]
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO, timeout=120, env=child_env())
    assert done.returncode == 0
    return done.stderr.decode() if done.stderr is not None else ""


def test_progress_is_drawn_on_a_terminal_and_silent_otherwise():
    assert "sim:" not in _sim_stderr(subprocess.PIPE)  # a pipe: nothing
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    try:
        _sim_stderr(terminal)
        os.close(terminal)
        drawn = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal's other end is closed: all is read
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(controller)
    assert b"sim: 100%" in drawn and b"30/30" in drawn
