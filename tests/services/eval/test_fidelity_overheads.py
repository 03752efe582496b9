"""scripts/check_sim_fidelity.py's reading of its calibration pairs (the live run itself is
the script's job; this checks the arithmetic that turns pairs into simulator delays)."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "check_sim_fidelity.py"


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("check_sim_fidelity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_pairs_give_back_the_delays_that_made_them(fidelity):
    # 1.5 ms each way, a first token 1 ms slower out than later ones, 0.1 ms of loop per step
    way, first_extra, step = 0.0015, 0.001, 0.0001
    short, long = fidelity.CALIBRATION_SHORT_OUTPUT, fidelity.CALIBRATION_OUTPUT
    ttft = way + way + first_extra
    span = {n: (n - 1) * step - first_extra for n in (short, long)}
    overheads = fidelity.Overheads.from_pairs(ttft, span[short], span[long])
    assert overheads.network_s == pytest.approx(way)
    assert overheads.first_token_extra_s == pytest.approx(first_extra)
    assert overheads.step_s == pytest.approx(step)


def test_noise_cannot_make_a_step_or_a_delay_negative(fidelity):
    overheads = fidelity.Overheads.from_pairs(0.001, 0.0005, 0.0001)  # longer spans shrank: noise
    assert overheads.step_s == 0.0
    assert overheads.network_s >= 0 and overheads.network_s + overheads.first_token_extra_s >= 0
    assert 2 * overheads.network_s + overheads.first_token_extra_s == pytest.approx(0.001)  # TTFT kept
