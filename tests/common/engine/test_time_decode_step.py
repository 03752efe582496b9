"""scripts/time_decode_step.py on the tiny model: it runs, reports its step times, and
says which kernels multiplied the linears."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_it_times_decode_steps_of_the_engine(tiny_model_dir):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "time_decode_step.py"), "--model",
                             str(tiny_model_dir), "--batch", "3", "--threads", "1", "--steps", "25", "--profile"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "decode step median" in line)
    match = re.search(r"linears (\S+), batch 3, 1 threads: decode step median ([\d.]+) ms, p10 ([\d.]+) ms", line)
    assert match is not None, line
    assert float(match.group(3)) <= float(match.group(2)) and float(match.group(2)) > 0
    assert "Self CPU" in result.stdout  # the profiler's table


def test_it_refuses_too_few_steps(tiny_model_dir):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "time_decode_step.py"), "--model",
                             str(tiny_model_dir), "--steps", "20"], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert result.returncode == 2 and "--steps > 20" in result.stderr
