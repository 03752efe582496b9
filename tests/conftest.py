"""Shared fixtures: real checkpoints on disk, engines built from them."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.default_model import write_default_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def make_engine(tiny_model_dir):
    """Build an fp32 engine on the tiny model (exact comparisons), with overrides."""
    from common.engine.engine import Engine

    def build(model_dir: Path | None = None, **overrides):
        config = EngineConfig(model_dir=model_dir or tiny_model_dir, dtype="float32",
                              kv_cache_gb=0.05, max_model_len=1024)
        return Engine(dataclasses.replace(config, **overrides))

    return build


@pytest.fixture(scope="session")
def random_prompts():
    """Seeded random prompts of given lengths (ids above the 4 special tokens)."""

    def draw(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(4, vocab, (length,), generator=generator).tolist() for length in lengths]

    return draw
