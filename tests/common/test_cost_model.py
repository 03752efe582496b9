"""Cost profiles: the JSON format, loading by file or by name, the analytic roofline
profiles and their check against Preble's published fit."""
import json

import pytest

from common.config import ConfigError, load_config
from common.cost_model import TINY_CPU, CostModel, ProfileError, load_cost_model
from common.profiles import (
    ANALYTIC_NAMES,
    GPUS,
    KNOWN_NAMES,
    MODELS,
    PREBLE_NAME,
    PREBLE_POINTS,
    PREBLE_PREFILL,
    PREBLE_TOLERANCE,
    analytic_profile,
    min_tp,
    preble_comparison,
    roofline_profile,
)

PROFILE = {"name": "p", "prefill": {"a": 1e-3, "b": 1e-5, "c": 1e-6, "d": 1e-9},
           "decode": {"a": 2e-3, "b": 1e-4}}


def test_from_json_ignores_metadata_but_refuses_unknown_coefficients():
    with_metadata = {**PROFILE, "source": "measured", "measured_on": {"device": "cpu"},
                     "fit": {"prefill": {"mean_abs_rel_error": 0.05, "max_abs_rel_error": 0.1, "points": 9}},
                     "points": {"prefill": [[16, 0, 0.01]]}}
    model = CostModel.from_json(with_metadata)
    assert model == CostModel.from_json(PROFILE)
    assert model.prefill_s(100, 1000) == pytest.approx(1e-3 + 1e-3 + 1e-3 + 1e-4)
    assert model.decode.c == 0.0 and model.prefill.e == 0.0  # e, the n² term, is optional
    with pytest.raises(ProfileError, match=r"prefill has unknown keys \['f'\]"):
        CostModel.from_json({**PROFILE, "prefill": {**PROFILE["prefill"], "f": 1.0}})
    quadratic = CostModel.from_json({**PROFILE, "prefill": {**PROFILE["prefill"], "e": 2e-8}})
    assert quadratic.prefill_s(100, 1000) == pytest.approx(model.prefill_s(100, 1000) + 2e-8 * 100 ** 2)
    assert quadratic.recompute_s(100) == pytest.approx(1e-5 * 100 + 2e-8 * 100 ** 2)
    assert CostModel.from_json(json.loads(json.dumps(quadratic.to_json()))) == quadratic


def test_wake_is_linear_from_zero_through_the_points_and_flat_beyond_them():
    model = CostModel.from_json({**PROFILE, "wake": [[0.01, 0.0002], [0.1, 0.0011]]})
    assert model.wake == ((0.01, 0.0002), (0.1, 0.0011))
    assert model.wake_s(0.0) == 0.0 and model.wake_s(-1.0) == 0.0
    assert model.wake_s(0.005) == pytest.approx(0.0001)
    assert model.wake_s(0.01) == pytest.approx(0.0002)
    assert model.wake_s(0.055) == pytest.approx(0.00065)
    assert model.wake_s(0.1) == model.wake_s(30.0) == model.wake_s(float("inf")) == pytest.approx(0.0011)
    assert CostModel.from_json(json.loads(json.dumps(model.to_json()))) == model
    assert CostModel.from_json(PROFILE).wake_s(5.0) == 0.0 and "wake" not in CostModel.from_json(PROFILE).to_json()


@pytest.mark.parametrize("bad, message", [
    ([], "expected a JSON object"),
    ({**PROFILE, "decode": None}, "decode must be an object"),
    ({**PROFILE, "decode": {"a": -1.0, "b": 1.0}}, r"decode.a must be a finite number >= 0"),
    ({**PROFILE, "decode": {"a": 0.0, "b": 0.0, "c": 1.0}}, "predicts zero time"),
    ({**PROFILE, "prefill": {"a": True, "b": 1.0}}, r"prefill.a must be"),
    ({**PROFILE, "wake": {"0.1": 0.001}}, "wake must be a list"),
    ({**PROFILE, "wake": [[0.1, -0.001]]}, r"wake\[0\] must be \[idle seconds, extra seconds\]"),
    ({**PROFILE, "wake": [[0.1, 0.001, 2]]}, r"wake\[0\] must be"),
    ({**PROFILE, "wake": [[0.1, 0.001], [0.1, 0.002]]}, r"wake\[1\]'s idle seconds must exceed"),
    ({**PROFILE, "wake": [[0.0, 0.001]]}, r"wake\[0\]'s idle seconds must exceed"),
])
def test_from_json_rejects_invalid_profiles(bad, message):
    with pytest.raises(ProfileError, match=message):
        CostModel.from_json(bad)


def test_load_by_file_by_name_and_default(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**PROFILE, "source": "test"}), encoding="utf-8")
    assert load_cost_model(path) == CostModel.from_json(PROFILE)
    assert load_cost_model(str(path)).name == "p"
    assert load_cost_model("") is TINY_CPU and load_cost_model(None) is TINY_CPU
    assert load_cost_model("tiny-cpu") is TINY_CPU  # by name: what `svc up --profile` skips measuring with
    assert load_cost_model("a6000/mistral-7b") == analytic_profile("a6000/mistral-7b")
    assert load_cost_model("H100/Llama-3-70B").name == "h100/llama-3-70b/tp4"
    assert load_cost_model("h100/llama-3-70b/tp8").name == "h100/llama-3-70b/tp8"
    assert load_cost_model(PREBLE_NAME).prefill == PREBLE_PREFILL


def test_a_bad_name_lists_the_known_names(tmp_path):
    with pytest.raises(ProfileError) as raised:
        load_cost_model("h100/llama-2-7b")
    text = str(raised.value)
    assert "no such profile file" in text and "h100/llama-2-7b" in text
    assert all(name in text for name in KNOWN_NAMES)
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_cost_model(tmp_path / "broken.json")


def test_the_config_accepts_a_profile_name_or_a_file_and_nothing_else(tmp_path):
    assert load_config(env={}, overrides={"profile": "a6000/mistral-7b"}).profile == "a6000/mistral-7b"
    with pytest.raises(ConfigError, match="profile: .*known names: h100/llama-3-8b"):
        load_config(env={}, overrides={"profile": "/no/such/profile.json"})
    with pytest.raises(ConfigError, match="do not fit"):
        load_config(env={}, overrides={"profile": "a6000/llama-3-70b/tp1"})


@pytest.mark.parametrize("name", ANALYTIC_NAMES)
def test_analytic_profiles_grow_with_tokens_and_context(name):
    model = analytic_profile(name)
    for phase in (model.prefill, model.decode):
        assert min(phase.a, phase.b, phase.c, phase.d) >= 0 and phase.a > 0
    prefill = [[model.prefill_s(n, ctx) for n in (16, 256, 2048)] for ctx in (0, 1024, 4096)]
    assert all(row == sorted(row) and row[0] < row[-1] for row in prefill)
    assert all(prefill[i][j] <= prefill[i + 1][j] for i in range(2) for j in range(3))
    decode = [[model.decode_step_s(b, ctx) for b in (1, 8, 64)] for ctx in (128, 1024, 8192)]
    assert all(row == sorted(row) and row[0] < row[-1] for row in decode)
    assert all(decode[i][j] <= decode[i + 1][j] for i in range(2) for j in range(3))


def test_the_fits_stay_close_to_the_roofline():
    for gpu in GPUS:
        for model in MODELS:
            _, errors = roofline_profile(gpu, model, min_tp(GPUS[gpu], MODELS[model]))
            assert errors["prefill"]["mean_abs_rel_error"] < 0.2, (gpu, model, errors)
            assert errors["decode"]["mean_abs_rel_error"] < 0.1, (gpu, model, errors)


def test_decode_is_faster_on_h200_than_on_a6000_and_prefill_faster_on_h100_than_a100():
    for model in ("llama-3-8b", "mistral-7b", "opt-13b"):
        h200, a6000 = analytic_profile(f"h200/{model}"), analytic_profile(f"a6000/{model}")
        assert h200.decode_step_s(32, 1024) < a6000.decode_step_s(32, 1024) / 3
        h100, a100 = analytic_profile(f"h100/{model}"), analytic_profile(f"a100/{model}")
        assert h100.prefill_s(2048) < a100.prefill_s(2048) / 2


def test_70b_needs_tensor_parallelism_on_80gb_gpus():
    model = MODELS["llama-3-70b"]
    assert min_tp(GPUS["h100"], model) == 4 and min_tp(GPUS["a100"], model) == 4
    assert min_tp(GPUS["h200"], model) == 2 and min_tp(GPUS["a6000"], model) == 4
    assert all(min_tp(GPUS[gpu], MODELS["llama-3-8b"]) == 1 for gpu in GPUS)
    with pytest.raises(ProfileError, match="do not fit on 1 x NVIDIA H100.*tp4"):
        analytic_profile("h100/llama-3-70b/tp1")
    with pytest.raises(ProfileError, match="must be one of"):
        analytic_profile("h100/llama-3-8b/tp3")
    # More GPUs per instance: faster steps.
    tp4, tp8 = analytic_profile("h100/llama-3-70b/tp4"), analytic_profile("h100/llama-3-70b/tp8")
    assert tp8.prefill_s(2048) < tp4.prefill_s(2048) and tp8.decode_step_s(32, 1024) < tp4.decode_step_s(32, 1024)


def test_analytic_70b_prefill_is_within_the_stated_tolerance_of_prebles_fit():
    rows = preble_comparison()
    assert [(row["n"], row["ctx"]) for row in rows] == list(PREBLE_POINTS)
    for row in rows:
        assert row["preble_s"] == pytest.approx(PREBLE_PREFILL(row["n"], row["ctx"]))
        assert 1 / PREBLE_TOLERANCE <= row["ratio"] <= PREBLE_TOLERANCE, row
        # Honestly: the roofline at 55% of peak is faster than Preble measured.
        assert row["ratio"] < 1


def test_prebles_profile_takes_its_decode_from_the_analytic_one():
    preble = analytic_profile(PREBLE_NAME)
    assert preble.name == PREBLE_NAME
    assert preble.prefill_s(2048, 0) == pytest.approx(28.93e-3 + 0.1822e-3 * 2048)
    assert preble.decode == analytic_profile("h100/llama-3-70b").decode
