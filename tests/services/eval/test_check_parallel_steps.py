"""scripts/check_parallel_steps.py: real engine processes, alone and side by side."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.local_cluster import REPO, child_env
from tests.scripts import SCRIPTS, load_script


def test_it_times_each_engine_alone_and_side_by_side_and_prints_the_ratios(tiny_model_dir):
    command = [sys.executable, str(SCRIPTS / "check_parallel_steps.py"), "--engines", "2", "--seconds", "0.5",
               "--rounds", "1", "--max-tokens", "4", "--prompt-tokens", "64", "--model", str(tiny_model_dir),
               "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    trials = printed["trials"]
    assert [(t["engines"], t["engine"]) for t in trials] == [(1, 0), (2, 0), (2, 1)]
    for found in trials:
        assert found["requests"] >= 1
        assert 0 < found["decode_ms"] < found["prefill_ms"]  # 64 prompt tokens cost more than one
    assert set(printed["ratios"]) == {"prefill_ms", "decode_ms"}
    assert all(0 < ratio < 20 for ratio in printed["ratios"].values())


def test_the_ratio_is_side_by_side_median_over_alone_median():
    check = load_script("check_parallel_steps")
    alone = [check.Trial(1, 0, 4.0, 1.0, 10), check.Trial(1, 0, 6.0, 1.0, 10)]
    together = [check.Trial(2, 0, 10.0, 2.0, 5), check.Trial(2, 1, 10.0, 2.0, 5)]
    assert check.ratios(alone, together) == {"prefill_ms": 2.0, "decode_ms": 2.0}


@pytest.mark.parametrize("bad", [["--engines", "1"], ["--seconds", "0"], ["--max-tokens", "1"]])
def test_bad_arguments_are_refused_with_what_is_needed(bad, capsys):
    check = load_script("check_parallel_steps")
    with pytest.raises(SystemExit):
        check.main(bad)
    assert "need --engines >= 2" in capsys.readouterr().err
