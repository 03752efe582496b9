"""The profiler: the fit recovers known coefficients, `measure` times an engine, and
`svc profile` writes a profile the router can load."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.cost_model import CostModel, LatencyFit, ProfileError, fit_latency, load_cost_model
from services.eval.profiler import (
    Grid,
    Point,
    ProfilerError,
    fit,
    measure,
    measure_wake,
    node_profile_path,
    profile_json,
)
from services.local_cluster import child_env
from tests.terminal import run_with_stderr_on_terminal

REPO = Path(__file__).parents[3]
TRUE = LatencyFit(a=3.5e-3, b=5.5e-5, c=7.3e-6, d=1.75e-8)


def grid_points(latency: LatencyFit, phase: str = "prefill") -> list[Point]:
    return [Point(phase, n, ctx, latency(n, ctx)) for n in (16, 64, 256, 1024) for ctx in (0, 512, 2048)]


def test_fit_recovers_known_coefficients_exactly():
    latency, error = fit(grid_points(TRUE))
    for key in "abcd":
        assert getattr(latency, key) == pytest.approx(getattr(TRUE, key), rel=1e-6)
    assert error["max_abs_rel_error"] < 1e-9 and error["points"] == 12


def test_a_prefill_fit_recovers_its_quadratic_term_and_decode_gets_none():
    quadratic = LatencyFit(a=2e-3, b=4e-5, c=1e-6, d=1e-9, e=5e-8)
    latency, error = fit(grid_points(quadratic))
    for key in "abcde":
        assert getattr(latency, key) == pytest.approx(getattr(quadratic, key), rel=1e-6)
    assert error["max_abs_rel_error"] < 1e-9
    # The same times as decode points: no n² term there, so the linear form absorbs it.
    decode, _ = fit(grid_points(quadratic, "decode"))
    assert decode.e == 0.0 and decode.b > quadratic.b
    # Linear times fitted with the term: it stays at zero.
    fitted = fit_latency([(p.n, p.ctx, p.seconds) for p in grid_points(TRUE)], quadratic=True)
    assert fitted.e == pytest.approx(0.0, abs=1e-15)


def test_fit_keeps_coefficients_non_negative():
    # Times that fall with context would want c < 0; the fit clamps c at 0 instead.
    falling = [(n, ctx, 1e-3 + 1e-5 * n - 1e-7 * ctx) for n in (16, 256, 1024) for ctx in (0, 1024, 4096)]
    latency = fit_latency(falling)
    assert min(latency.a, latency.b, latency.c, latency.d) >= 0 and latency.c == 0
    assert latency.b == pytest.approx(1e-5, rel=0.1)
    # A term no point exercises stays at zero.
    no_context = fit_latency([(n, 0, 2e-3 + 1e-5 * n) for n in (1, 8, 32)])
    assert (no_context.c, no_context.d) == (0, 0)
    assert no_context.a == pytest.approx(2e-3) and no_context.b == pytest.approx(1e-5)


def test_fit_with_noise_reports_its_error():
    noisy = [Point(p.phase, p.n, p.ctx, p.seconds * (1.1 if i % 2 else 0.9))
             for i, p in enumerate(grid_points(TRUE))]
    latency, error = fit(noisy)
    assert 0.05 < error["mean_abs_rel_error"] <= error["max_abs_rel_error"] < 0.2
    assert latency.b == pytest.approx(TRUE.b, rel=0.2)


def test_fit_follows_the_mean_of_skewed_noise():
    # Steps on a busy machine run slow more often than fast: each shape measured at
    # 0.9, 1, 1 and 1.5 times its true time averages 1.1 times it. A fit relative to each
    # measured time would land near 1.03 times (the slow ones weigh less); relative to its
    # own prediction it follows the mean, which is what a simulator's sums need.
    factors = (0.9, 1.0, 1.0, 1.5)
    points = [(n, ctx, TRUE(n, ctx) * factor) for n in (16, 64, 256, 1024) for ctx in (0, 512, 2048)
              for factor in factors]
    latency = fit_latency(points)
    for n in (16, 1024):
        for ctx in (0, 2048):
            assert latency(n, ctx) == pytest.approx(1.1 * TRUE(n, ctx), rel=0.01)


def test_fit_refuses_mixed_phases_and_bad_points():
    with pytest.raises(ProfilerError, match="one phase"):
        fit(grid_points(TRUE) + grid_points(TRUE, "decode"))
    with pytest.raises(ProfileError, match="no points"):
        fit_latency([])
    with pytest.raises(ProfileError, match="time > 0"):
        fit_latency([(16, 0, 0.0)])


def test_profile_json_is_a_valid_profile_with_its_fit_error():
    data = profile_json(grid_points(TRUE) + grid_points(LatencyFit(4e-3, 2e-4), "decode"), "synthetic",
                        {"device": "cpu"})
    model = CostModel.from_json(json.loads(json.dumps(data)))
    assert model.prefill.b == pytest.approx(TRUE.b, rel=1e-6)
    assert set(data["fit"]) == {"prefill", "decode"} and data["fit"]["decode"]["points"] == 12
    assert data["measured_on"] == {"device": "cpu"} and len(data["points"]["prefill"]) == 12


def test_measure_times_each_point_of_a_real_engine(make_engine):
    engine = make_engine(max_num_batched_tokens=256)
    grid = Grid(prefill_tokens=(16, 128), prefill_contexts=(0, 256), decode_batches=(1, 4),
                decode_contexts=(32,), repeats=1)
    before = engine.stats.num_computed_tokens
    points = measure(engine, grid)
    prefill = [(p.n, p.ctx) for p in points if p.phase == "prefill"]
    assert prefill == [(16, 0), (128, 0), (16, 256), (128, 256)]  # the cached context is used
    # Two attempts of each point; the context of 256 computed once (the second point finds it
    # cached and computes only its last block again); each decode point prefills one context
    # of 32 and decodes its batch twice.
    assert engine.stats.num_computed_tokens - before == 2 * 2 * (16 + 128) + 256 + 16 + 2 * 32 + 2 * (1 + 4)
    decode = [p for p in points if p.phase == "decode"]
    assert [p.n for p in decode] == [1, 4] and all(33 <= p.ctx <= 40 for p in decode)
    assert all(p.seconds > 0 for p in points)
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_a_decode_point_prefills_its_context_once_not_once_per_sequence(make_engine):
    engine = make_engine(max_num_batched_tokens=256)
    grid = Grid(prefill_tokens=(16,), prefill_contexts=(0,), decode_batches=(8,), decode_contexts=(96,), repeats=2)
    before = engine.stats.num_computed_tokens
    [_, decode] = measure(engine, grid)
    computed = engine.stats.num_computed_tokens - before
    # the prefill point's 3 x 16 tokens, one context of 96 (and its token), 8 x 3 decode tokens
    assert computed == 3 * 16 + 96 + 8 * 3
    assert decode.n == 8 and 97 <= decode.ctx <= 99 and decode.seconds > 0
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_measure_wake_gives_an_extra_per_idle_gap_and_leaves_the_engine_idle(make_engine):
    engine = make_engine()
    wake = measure_wake(engine, gaps=(0.005, 0.02), repeats=2)
    assert [gap for gap, _ in wake] == [0.005, 0.02] and all(extra >= 0 for _, extra in wake)
    assert not engine.has_unfinished()
    engine.check_integrity()
    data = profile_json(grid_points(TRUE) + grid_points(LatencyFit(4e-3, 2e-4), "decode"), "synthetic",
                        {"device": "cpu"}, wake=[(0.005, 0.0001), (0.02, 0.0003)])
    assert CostModel.from_json(json.loads(json.dumps(data))).wake_s(1.0) == 0.0003


def test_measure_needs_a_step_budget_for_the_largest_point(make_engine):
    grid = Grid((512,), (0,), (1,), (32,))
    with pytest.raises(ProfilerError, match="max_num_batched_tokens must be >= 512"):
        measure(make_engine(max_num_batched_tokens=256), grid)


def test_svc_profile_quick_writes_a_profile_the_router_loads(tiny_model_dir, tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "profile", "--quick", "--model", str(tiny_model_dir),
         "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, env=child_env(), timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    model = load_cost_model(out)
    assert model.name == "tiny-cpu" and model.prefill_s(512, 512) > model.prefill_s(16, 0) > 0
    data = json.loads(out.read_text(encoding="utf-8"))
    for phase in ("prefill", "decode"):
        error = data["fit"][phase]
        assert error["points"] >= 4 and 0 <= error["mean_abs_rel_error"] <= error["max_abs_rel_error"]
        assert f"{phase}: " in done.stdout and "fit error mean" in done.stdout
    assert data["measured_on"]["threads"] == 1 and data["source"]
    assert [idle for idle, _ in data["wake"]] == [0.01, 0.03, 0.1, 0.3] and model.wake_s(1.0) >= 0
    assert "wake: +" in done.stdout
    # not a terminal: no bar, but the points' count at the end (and every 2 s before)
    measured = sum(len(points) for points in data["points"].values())
    assert f"profile: {measured}/{measured} points" in done.stderr


def test_svc_profile_draws_progress_on_a_terminal_and_keeps_stdout_the_profile(tiny_model_dir):
    argv = [sys.executable, "-m", "services.cli", "profile", "--quick", "--model", str(tiny_model_dir),
            "--threads", "1"]
    done, drawn = run_with_stderr_on_terminal(argv, cwd=REPO, env=child_env(), timeout=60)
    assert done.returncode == 0, drawn.decode(errors="replace")
    assert b"profile: 100%" in drawn and b"10/10" in drawn  # QUICK_GRID: 6 prefill + 4 decode points
    assert json.loads(done.stdout)["source"] == "measured by svc profile"  # the bar is not in stdout


def test_svc_profile_compare_preble_prints_the_table():
    done = subprocess.run([sys.executable, "-m", "services.cli", "profile", "--compare-preble"],
                          capture_output=True, text=True, env=child_env(),
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "tp=4" in done.stdout and "tp=8" in done.stdout and "profile/Preble" in done.stdout


def test_a_node_profile_is_named_by_what_the_engines_step_times_depend_on(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.safetensors").write_bytes(b"w" * 8)
    cache = tmp_path / "cache"
    path = node_profile_path(cache, model, "bfloat16", "cpu", 1)
    assert path.parent == cache / "profiles" and path.name.startswith("model-cpu-") and path.suffix == ".json"
    assert node_profile_path(cache, model, "bfloat16", "cpu", 1) == path  # the same node measures once
    others = {node_profile_path(cache, model, "float32", "cpu", 1),
              node_profile_path(cache, model, "bfloat16", "cpu", 2),
              node_profile_path(cache, model, "bfloat16", "cuda:1", 1)}
    assert path not in others and len(others) == 3
    (model / "weights.safetensors").write_bytes(b"w" * 9)  # another checkpoint in the same place
    assert node_profile_path(cache, model, "bfloat16", "cpu", 1) != path
    with pytest.raises(ValueError, match="^dtype: a node profile is keyed by a resolved dtype"):
        node_profile_path(cache, model, "auto", "cpu", 1)  # auto is float32 on one CPU, bfloat16 on another
