"""`dtype = "auto"`, the default: bfloat16 on GPUs and on CPUs whose oneDNN computes bf16
natively, float32 on other CPUs; an explicit dtype as given. An engine resolves it once
and every consumer sees the resolved dtype (tests/services/kvstore/test_service.py: the
KV store, which loads no torch, resolves it alike)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.config import load_config
from common.engine.config import DTYPES, EngineConfig, EngineSettings, dtype_choice, resolve_dtype
from common.engine.engine import Engine
from common.hashing import root_hash
from common.sampling_params import SamplingParams
from kernels.linear import onednn_bf16_native


@pytest.mark.parametrize("device, cpu_bf16_native, want", [
    ("cpu", True, "bfloat16"),  # AMX / AVX-512 BF16: oneDNN's bf16 kernels
    ("cpu", False, "float32"),  # AVX2 only: bf16 would take torch's scalar GEMM
    ("cuda", False, "bfloat16"),  # GPUs as before, whatever the host CPU does
    ("cuda:1", True, "bfloat16"),
])
def test_auto_picks_per_device(device, cpu_bf16_native, want):
    assert resolve_dtype("auto", device, cpu_bf16_native) == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("cpu_bf16_native", [True, False])
def test_an_explicit_dtype_is_honoured(dtype, device, cpu_bf16_native):
    assert resolve_dtype(dtype, device, cpu_bf16_native) == dtype


@pytest.mark.parametrize("setting", ["int8", "bf16", "", "AUTO"])
def test_an_unknown_dtype_is_refused_naming_the_setting(setting):
    with pytest.raises(ValueError, match=r"^dtype: unsupported .*choose one of \('auto', 'bfloat16'"):
        resolve_dtype(setting, "cpu", True)


def test_the_start_up_line_says_what_auto_chose_and_why():
    assert dtype_choice("auto", "cpu", False) == "dtype: auto -> float32 (oneDNN has no native bf16 on this CPU)"
    assert dtype_choice("auto", "cpu", True) == "dtype: auto -> bfloat16 (oneDNN computes bf16 natively on this CPU)"
    assert dtype_choice("auto", "cuda:0", False) == "dtype: auto -> bfloat16 (GPU)"
    assert dtype_choice("float16", "cpu", False) == "dtype: float16 (as set)"


def test_auto_is_the_default_of_engines_and_clusters():
    assert EngineSettings().dtype == "auto"
    assert load_config(env={}).dtype == "auto"
    assert load_config(env={"BATON_DTYPE": "bfloat16"}).dtype == "bfloat16"  # an explicit one stays


def test_an_auto_engine_computes_in_the_resolved_dtype_everywhere(tiny_model_dir, test_device):
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, kv_cache_gb=0.05, max_model_len=1024,
                                 device=test_device))
    want = resolve_dtype("auto", test_device, onednn_bf16_native())
    assert engine.config.dtype == want  # what Hello, profiles and logs read
    assert engine.kv_cache.layout.dtype == want
    assert engine.model.dtype == getattr(torch, want)
    assert engine._root_hash("") == root_hash(engine.model_fingerprint, engine.tokenizer_fingerprint, "",
                                              want, engine.config.block_size, "")
    explicit = Engine(dataclasses.replace(engine.config, dtype=want))
    prompt = list(range(5, 60))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert engine.generate([prompt], greedy)[0].token_ids == explicit.generate([prompt], greedy)[0].token_ids


def test_this_machine_computes_bf16_natively_so_auto_keeps_bfloat16():
    """The development machine has AMX and AVX-512 BF16: `auto` changes nothing here."""
    if not onednn_bf16_native():
        pytest.skip("this CPU has no native bf16 (auto is float32 here; the test above covers it)")
    assert resolve_dtype("auto", "cpu", onednn_bf16_native()) == "bfloat16"

