"""scripts/bench_shared_burst.py end to end at toy sizes: both settings run, the waiting
one computes the shared prompt once, and float32 ids agree."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_shared_burst.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_shared_burst", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_waiting_for_the_shared_prefill_computes_the_prompt_once(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--dtype", "float32", "--copies", "4", "--prompt-len", "200",
            "--max-tokens", "3", "--rounds", "1", "--json"]
    assert load_script().main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    decode = 4 * (3 - 1)
    # On: one prefill of 200, then each copy's last 8 tokens (12 full blocks reused).
    assert result["on"]["computed_tokens"] == 200 + 3 * 8 + decode
    # Off: all four fit the 2,048-token step, so each computes the whole prompt.
    assert result["off"]["computed_tokens"] == 4 * 200 + decode
    assert result["same_tokens"] is True
    assert result["speedup"] > 0 and result["speedup_paired"] > 0
