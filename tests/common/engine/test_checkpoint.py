"""Loading and validating Hugging Face checkpoint directories."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from common.engine.checkpoint import (
    CheckpointError,
    expected_tensors,
    fingerprints,
    load_model_config,
    load_state_dict,
    load_tokenizer,
)
from common.engine.config import ModelConfig, RopeScaling
from common.engine.default_model import write_default_model

REPO_ROOT = Path(__file__).resolve().parents[3]

# A micro Llama: fast to write in every test that needs its own weights.
MICRO_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


def write_config(model_dir: Path, config: dict[str, Any], **overrides: Any) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    merged = {**config, **overrides}
    (model_dir / "config.json").write_text(json.dumps(merged))
    return model_dir


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16)
            for name, shape in expected_tensors(cfg).items()}


def micro_checkpoint(model_dir: Path, **overrides: Any) -> tuple[ModelConfig,
                                                                 dict[str, torch.Tensor]]:
    """A micro checkpoint with config.json and model.safetensors; returns its config and
    the tensors written."""
    write_config(model_dir, MICRO_CONFIG, **overrides)
    cfg = load_model_config(model_dir)
    state = random_state(cfg)
    save_file(state, str(model_dir / "model.safetensors"))
    return cfg, state


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name], want[name]), name


def error_of(fn: Any, *args: Any) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(*args)
    return str(info.value)


# --------------------------------------------------------------------------- config


def test_micro_config_parses_with_defaults(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG)
    assert load_model_config(tmp_path) == ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
        attention_bias=False, qk_norm=False, rope_scaling=RopeScaling(),
        bos_token_id=1, eos_token_ids=(2,), torch_dtype="bfloat16")


def test_kv_heads_default_to_heads_and_head_dim_may_be_explicit(tmp_path: Path) -> None:
    config = {k: v for k, v in MICRO_CONFIG.items() if k != "num_key_value_heads"}
    write_config(tmp_path, config, head_dim=8, rope_theta=None)
    cfg = load_model_config(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 4, 8)
    assert cfg.rope_theta == 10000.0  # HF's default when absent


def test_qwen2_config_has_qkv_bias_and_bias_tensors(tmp_path: Path) -> None:
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                rope_theta=1e6, eos_token_id=[7, 8], tie_word_embeddings=True,
                ).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [8, 9, 7], "bos_token_id": 5}))
    cfg = load_model_config(tmp_path)
    assert cfg.model_type == "qwen2"
    assert cfg.attention_bias is True and cfg.qk_norm is False
    assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6
    assert cfg.eos_token_ids == (7, 8, 9)
    assert cfg.tie_word_embeddings is True
    shapes = expected_tensors(cfg)
    assert shapes["model.layers.1.self_attn.q_proj.bias"] == (16,)
    assert shapes["model.layers.1.self_attn.k_proj.bias"] == (8,)
    assert shapes["model.layers.1.self_attn.v_proj.bias"] == (8,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    assert "lm_head.weight" not in shapes

    state = random_state(cfg)
    # A tied checkpoint may still carry lm_head; it is ignored, not loaded.
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
              str(tmp_path / "model.safetensors"))
    assert_same_tensors(load_state_dict(tmp_path, cfg), state)


def test_qwen3_config_has_qk_norm_and_explicit_head_dim(tmp_path: Path) -> None:
    from transformers import Qwen3Config

    Qwen3Config(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=32,
                ).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert (cfg.model_type, cfg.qk_norm, cfg.attention_bias, cfg.head_dim) \
        == ("qwen3", True, False, 8)
    shapes = expected_tensors(cfg)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (8,)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (8,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 16)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 32)


def test_expected_tensors_of_a_llama(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG)
    shapes = expected_tensors(load_model_config(tmp_path))
    assert len(shapes) == 1 + 2 * 9 + 2
    assert list(shapes)[:2] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"]
    assert list(shapes)[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert shapes["model.embed_tokens.weight"] == (32, 16)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (16, 16)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (8, 16)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (24, 16)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (16, 24)
    assert shapes["lm_head.weight"] == (32, 16)


LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("overrides, theta, scaling", [
    ({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}},
     500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 10000.0, RopeScaling("linear", 2.0)),
    ({"rope_scaling": {"type": "default"}}, 10000.0, RopeScaling()),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                              **LLAMA3_SCALING}},
     500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     1e6, RopeScaling()),
    ({"rope_parameters": {"rope_type": "linear", "factor": 4}}, 10000.0,
     RopeScaling("linear", 4.0)),
], ids=["llama3-rope_scaling", "linear-type-key", "default", "llama3-rope_parameters",
        "default-rope_parameters", "rope_parameters-theta-at-top"])
def test_rope_forms_parse(tmp_path: Path, overrides: dict[str, Any], theta: float,
                          scaling: RopeScaling) -> None:
    write_config(tmp_path, MICRO_CONFIG, **overrides)
    cfg = load_model_config(tmp_path)
    assert cfg.rope_theta == theta
    assert cfg.rope_scaling == scaling


def test_config_written_by_transformers_5_parses(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                max_position_embeddings=131072,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                 **LLAMA3_SCALING}).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.max_position_embeddings == 131072


@pytest.mark.parametrize("overrides, want", [
    ({"torch_dtype": "float16"}, "float16"),
    ({"dtype": "float32"}, "float32"),
    ({}, "bfloat16"),
])
def test_torch_dtype_keys(tmp_path: Path, overrides: dict[str, Any], want: str) -> None:
    write_config(tmp_path, MICRO_CONFIG, **overrides)
    assert load_model_config(tmp_path).torch_dtype == want


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG, eos_token_id=[2, 5])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9, 2]}))
    assert load_model_config(tmp_path).eos_token_ids == (2, 5, 9)
    write_config(tmp_path, MICRO_CONFIG, eos_token_id=None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert load_model_config(tmp_path).eos_token_ids == (4,)


def test_missing_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    message = error_of(load_model_config, missing)
    assert str(missing) in message and "does not exist" in message


def test_missing_config_json(tmp_path: Path) -> None:
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "config.json") in message and "missing file" in message


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]"])
def test_invalid_json(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "config.json") in message
    assert "invalid JSON" in message or "expected a JSON object" in message


def test_invalid_generation_config(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG)
    (tmp_path / "generation_config.json").write_text("{")
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "generation_config.json") in message and "invalid JSON" in message


@pytest.mark.parametrize("key", ["model_type", "vocab_size", "hidden_size",
                                 "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "rms_norm_eps",
                                 "max_position_embeddings"])
def test_missing_key(tmp_path: Path, key: str) -> None:
    write_config(tmp_path, {k: v for k, v in MICRO_CONFIG.items() if k != key})
    message = error_of(load_model_config, tmp_path)
    assert message == f"{tmp_path / 'config.json'}: missing key '{key}'"


@pytest.mark.parametrize("key, value, expected", [
    ("hidden_size", "16", "a positive integer"),
    ("hidden_size", 16.0, "a positive integer"),
    ("num_hidden_layers", True, "a positive integer"),
    ("vocab_size", 0, "a positive integer"),
    ("rms_norm_eps", "1e-6", "a positive number"),
    ("rope_theta", -1, "a positive number"),
    ("model_type", 7, "a string"),
    ("tie_word_embeddings", "yes", "a boolean"),
    ("attention_bias", 1, "a boolean"),
    ("eos_token_id", "2", "token id"),
    ("bos_token_id", -1, "token id"),
    ("rope_scaling", "llama3", "must be an object"),
])
def test_bad_type(tmp_path: Path, key: str, value: Any, expected: str) -> None:
    write_config(tmp_path, MICRO_CONFIG, **{key: value})
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "config.json") in message
    assert f"'{key}'" in message and expected in message


def test_unsupported_model_type(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG, model_type="gpt2")
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "config.json") in message
    assert "unsupported model_type 'gpt2'" in message


@pytest.mark.parametrize("overrides", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
])
def test_unsupported_rope_type(tmp_path: Path, overrides: dict[str, Any]) -> None:
    write_config(tmp_path, MICRO_CONFIG, **overrides)
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "config.json") in message and "unsupported rope type" in message


def test_llama3_rope_needs_its_fields(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    message = error_of(load_model_config, tmp_path)
    assert "missing key 'rope_scaling.low_freq_factor'" in message


def test_heads_must_divide_hidden(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG, num_attention_heads=3, num_key_value_heads=1)
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "config.json") in message
    assert "hidden_size 16 is not divisible by num_attention_heads 3" in message


def test_heads_must_be_a_multiple_of_kv_heads(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG, num_key_value_heads=3)
    message = error_of(load_model_config, tmp_path)
    assert str(tmp_path / "config.json") in message
    assert "num_attention_heads 4 is not a multiple of num_key_value_heads 3" in message


def test_unsupported_activation(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG, hidden_act="gelu")
    assert "unsupported hidden_act 'gelu'" in error_of(load_model_config, tmp_path)


# ------------------------------------------------------------------------- weights


def test_default_tiny_loads_every_expected_tensor(tiny_dir: Path) -> None:
    cfg = load_model_config(tiny_dir)
    state = load_state_dict(tiny_dir, cfg)
    assert {n: tuple(t.shape) for n, t in state.items()} == expected_tensors(cfg)


def test_sharded_checkpoint_loads_the_same_tensors(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_model_config(tiny_dir)
    state = load_state_dict(tiny_dir, cfg)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(tiny_dir / name, sharded / name)
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, str(sharded / shard))
        weight_map.update({n: shard for n in shard_names})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    assert_same_tensors(load_state_dict(sharded, cfg), state)

    # Without the index, every *.safetensors file in the directory is read.
    (sharded / "model.safetensors.index.json").unlink()
    assert_same_tensors(load_state_dict(sharded, cfg), state)


def test_rotary_buffers_are_ignored(tmp_path: Path) -> None:
    cfg, state = micro_checkpoint(tmp_path)
    extra = {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    save_file(extra, str(tmp_path / "model.safetensors"))
    assert_same_tensors(load_state_dict(tmp_path, cfg), state)


def test_no_safetensors(tmp_path: Path) -> None:
    write_config(tmp_path, MICRO_CONFIG)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    message = error_of(load_state_dict, tmp_path, load_model_config(tmp_path))
    assert str(tmp_path) in message and "no safetensors weights" in message


@pytest.mark.parametrize("cut", [4, 100, -10])
def test_truncated_safetensors(tmp_path: Path, cut: int) -> None:
    cfg, _ = micro_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    message = error_of(load_state_dict, tmp_path, cfg)
    assert str(path) in message
    assert "truncated" in message or "corrupt" in message


@pytest.mark.parametrize("garbage", [
    b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}",
    b"\x02\x00\x00\x00\x00\x00\x00\x00[]",
    b"\x40\x00\x00\x00\x00\x00\x00\x00" + json.dumps({"x": {"dtype": "F32"}}).ljust(64).encode(),
    b"\xff" * 64,
])
def test_corrupt_safetensors_header(tmp_path: Path, garbage: bytes) -> None:
    cfg, _ = micro_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(garbage)
    message = error_of(load_state_dict, tmp_path, cfg)
    assert str(path) in message and "corrupt safetensors" in message


def test_missing_tensor(tmp_path: Path) -> None:
    cfg, state = micro_checkpoint(tmp_path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    message = error_of(load_state_dict, tmp_path, cfg)
    assert message == (f"{tmp_path / 'model.safetensors'}: missing tensor "
                       f"'model.layers.1.mlp.up_proj.weight'")


def test_wrong_shape(tmp_path: Path) -> None:
    cfg, state = micro_checkpoint(tmp_path)
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 4, dtype=torch.bfloat16)
    save_file(state, str(tmp_path / "model.safetensors"))
    message = error_of(load_state_dict, tmp_path, cfg)
    assert message == (f"{tmp_path / 'model.safetensors'}: tensor "
                       f"'model.layers.0.self_attn.q_proj.weight' has shape (3, 4), "
                       f"expected (16, 16)")


def test_unexpected_tensor(tmp_path: Path) -> None:
    cfg, state = micro_checkpoint(tmp_path)
    state["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(24)
    save_file(state, str(tmp_path / "model.safetensors"))
    message = error_of(load_state_dict, tmp_path, cfg)
    assert str(tmp_path / "model.safetensors") in message
    assert "unexpected tensor 'model.layers.0.mlp.gate_proj.bias'" in message


def test_non_float_tensor(tmp_path: Path) -> None:
    cfg, state = micro_checkpoint(tmp_path)
    state["model.norm.weight"] = torch.ones(16, dtype=torch.int8)
    save_file(state, str(tmp_path / "model.safetensors"))
    message = error_of(load_state_dict, tmp_path, cfg)
    assert "'model.norm.weight' has dtype I8" in message


def test_tensor_in_two_files(tmp_path: Path) -> None:
    cfg, state = micro_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "a.safetensors")
    save_file({"model.norm.weight": state["model.norm.weight"]}, str(tmp_path / "b.safetensors"))
    message = error_of(load_state_dict, tmp_path, cfg)
    assert str(tmp_path / "b.safetensors") in message and "also in" in message


def test_index_names_a_missing_shard(tmp_path: Path) -> None:
    cfg, state = micro_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in state}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    message = error_of(load_state_dict, tmp_path, cfg)
    assert str(index) in message
    assert "shard 'model-00002-of-00002.safetensors'" in message and "does not exist" in message


def test_index_without_weight_map(tmp_path: Path) -> None:
    cfg, _ = micro_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    message = error_of(load_state_dict, tmp_path, cfg)
    assert str(index) in message and "weight_map" in message


# ----------------------------------------------------------------------- tokenizer


def test_load_tokenizer(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert tok.decode(tok.encode("naïve 世界").ids) == "naïve 世界"


def test_missing_tokenizer(tmp_path: Path) -> None:
    message = error_of(load_tokenizer, tmp_path)
    assert message == f"{tmp_path / 'tokenizer.json'}: missing file"


@pytest.mark.parametrize("text", ["{broken", '{"model": {"type": "Nonsense"}}', "[]"])
def test_malformed_tokenizer(tmp_path: Path, text: str) -> None:
    (tmp_path / "tokenizer.json").write_text(text)
    message = error_of(load_tokenizer, tmp_path)
    assert str(tmp_path / "tokenizer.json") in message and "malformed tokenizer" in message


# --------------------------------------------------------------------- fingerprints


def test_fingerprints_are_stable(tiny_dir: Path, tmp_path: Path) -> None:
    model_fp, tokenizer_fp = fingerprints(tiny_dir)
    assert len(model_fp) == 16 and int(model_fp, 16) >= 0
    assert len(tokenizer_fp) == 16 and int(tokenizer_fp, 16) >= 0
    assert fingerprints(tiny_dir) == (model_fp, tokenizer_fp)
    copy = shutil.copytree(tiny_dir, tmp_path / "copy")
    assert fingerprints(copy) == (model_fp, tokenizer_fp)
    script = ("import sys; from pathlib import Path; "
              "from common.engine.checkpoint import fingerprints; "
              "print(*fingerprints(Path(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", script, str(tiny_dir)], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""})
    assert out.stdout.split() == [model_fp, tokenizer_fp]


def test_fingerprints_change_with_headers_and_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    model_fp, tokenizer_fp = fingerprints(tiny_dir)
    changed = shutil.copytree(tiny_dir, tmp_path / "changed")
    weights = changed / "model.safetensors"
    cfg = load_model_config(changed)

    # Same weights, header changed (a tensor stored in another dtype).
    state = load_state_dict(changed, cfg)
    save_file({**state, "model.norm.weight": state["model.norm.weight"].float()}, str(weights))
    new_model_fp, same_tokenizer_fp = fingerprints(changed)
    assert new_model_fp != model_fp and same_tokenizer_fp == tokenizer_fp

    # Same weights and file size, only header bytes differ (metadata of equal length).
    save_file(state, str(weights), metadata={"format": "pt"})
    same_size = weights.stat().st_size
    before = fingerprints(changed)[0]
    save_file(state, str(weights), metadata={"format": "np"})
    assert weights.stat().st_size == same_size
    assert fingerprints(changed)[0] != before

    # The tokenizer alone changes only the tokenizer fingerprint.
    shutil.copy(tiny_dir / "model.safetensors", weights)
    assert fingerprints(changed) == (model_fp, tokenizer_fp)
    write_default_model(tmp_path / "seed1", "tiny", seed=1)
    shutil.copy(tmp_path / "seed1" / "tokenizer.json", changed / "tokenizer.json")
    assert fingerprints(changed) == (model_fp, fingerprints(tmp_path / "seed1")[1])
    assert fingerprints(changed)[1] != tokenizer_fp

    # config.json is covered too.
    write_config(changed, json.loads((tiny_dir / "config.json").read_text()), rope_theta=5e5)
    assert fingerprints(changed)[0] != model_fp


def test_fingerprints_read_headers_not_weights(tiny_dir: Path, tmp_path: Path) -> None:
    """Hashing whole weights would cost seconds per GB; headers name the layout and
    config.json the rest. Flipping a weight byte in place keeps the fingerprint."""
    copy = shutil.copytree(tiny_dir, tmp_path / "copy")
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert fingerprints(copy) == fingerprints(tiny_dir)


def test_fingerprints_of_a_broken_dir(tmp_path: Path) -> None:
    assert "config.json: missing file" in error_of(fingerprints, tmp_path)
    write_config(tmp_path, MICRO_CONFIG)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 3)
    message = error_of(fingerprints, tmp_path)
    assert str(tmp_path / "model.safetensors") in message and "corrupt" in message


def test_sliding_window_caps_the_context_limit(tmp_path: Path) -> None:
    mistral = load_model_config(write_config(tmp_path / "m", MICRO_CONFIG, model_type="mistral",
                                             sliding_window=64))
    assert mistral.sliding_window == 64 and mistral.context_limit == 64
    # Qwen configs carry a window that is off unless use_sliding_window is true.
    qwen_off = load_model_config(write_config(tmp_path / "q", MICRO_CONFIG, model_type="qwen2",
                                              sliding_window=64, use_sliding_window=False))
    assert qwen_off.sliding_window is None and qwen_off.context_limit == 128
    with pytest.raises(CheckpointError, match="sliding_window"):
        load_model_config(write_config(tmp_path / "bad", MICRO_CONFIG, model_type="mistral",
                                       sliding_window=-4))
