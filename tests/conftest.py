"""Shared fixtures: real checkpoints on disk, engines built from them."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.default_model import write_default_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


@pytest.fixture
def fresh_cache(tmp_path) -> Path:
    """An empty Baton cache but for this machine's build of the C++ kernels, copied from
    the session's cache (built there first if need be): a test of what a first start
    writes (a default model, a node profile) need not compile them again, ~30 s here.
    tests/kernels/test_native.py builds them in an empty cache."""
    from common.cache_root import baton_cache_root
    from kernels.native import load_native_ops

    cache = tmp_path / "cache"
    built = baton_cache_root() / "kernels"
    if load_native_ops() and built.is_dir():
        shutil.copytree(built, cache / "kernels")
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture(scope="session")
def test_device() -> str:
    """The device engine tests run on: $BATON_TEST_DEVICE, default cpu (scripts/check_cuda.sh
    runs the engine tests again with cuda)."""
    device = os.environ.get("BATON_TEST_DEVICE", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(f"BATON_TEST_DEVICE={device!r} but torch sees no CUDA device")
    return device


@pytest.fixture(scope="session")
def make_engine(tiny_model_dir, test_device):
    """Build an fp32 engine on the tiny model (exact comparisons) on the test device,
    with overrides."""
    from common.engine.engine import Engine

    def build(model_dir: Path | None = None, **overrides):
        config = EngineConfig(model_dir=model_dir or tiny_model_dir, dtype="float32",
                              kv_cache_gb=0.05, max_model_len=1024, device=test_device)
        return Engine(dataclasses.replace(config, **overrides))

    return build


@pytest.fixture(scope="session")
def random_prompts():
    """Seeded random prompts of given lengths (ids above the 4 special tokens)."""

    def draw(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(4, vocab, (length,), generator=generator).tolist() for length in lengths]

    return draw
