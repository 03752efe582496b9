"""Baton's kernels under an instruction-set cap (kernels/native.py `isa_cap_flags`): built
for what ONEDNN_MAX_CPU_ISA allows, so that with oneDNN, ATen and MKL capped alike a CPU
with AVX-512 or AMX runs the code an AVX2-only CPU runs."""
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.native import ISA_CAP_ENV, NATIVE_TARGET, _cpu_flags, isa_cap_flags
from services.local_cluster import child_env
from tests.kernels.conftest import can_build

REPO = Path(__file__).parents[2]
AVX2_ONLY = {ISA_CAP_ENV: "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
NATIVE = NATIVE_TARGET
NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
# What runs on every CPU: the kernels against their references, the linears, an engine's dtype choice.
CAPPED_TESTS = ("tests/kernels/test_native.py", "tests/kernels/test_attention.py", "tests/kernels/test_layer_ops.py",
                "tests/kernels/test_argmax.py", "tests/kernels/test_linear.py", "tests/kernels/test_amx_linear.py",
                "tests/common/engine/test_auto_dtype.py")


@pytest.mark.parametrize("cap, flags", [
    (None, NATIVE), ("", NATIVE), ("ALL", NATIVE), ("default", NATIVE),
    ("AVX2", ("-march=x86-64-v3",)), ("avx2_vnni", ("-march=x86-64-v3",)),
    ("SSE41", ("-march=x86-64-v2",)), ("AVX", ("-march=x86-64-v2", "-mavx")),
    ("AVX512_CORE_BF16", NATIVE + NO_AMX), ("AVX10_1_512", NATIVE + NO_AMX), ("AVX512_CORE_AMX", NATIVE),
])
def test_the_kernels_target_what_onednn_is_capped_to(cap, flags):
    assert isa_cap_flags({} if cap is None else {ISA_CAP_ENV: cap}) == flags


def test_an_unknown_cap_is_refused_by_name():
    with pytest.raises(ValueError, match=r"ONEDNN_MAX_CPU_ISA='AVX3' is not an instruction set"):
        isa_cap_flags({ISA_CAP_ENV: "AVX3"})


def test_capped_to_avx2_the_kernels_build_for_it_and_pass_their_tests():
    """On an AVX-512 machine this is the AVX2-only CPU's build: eight lanes a register, no
    AMX, bf16 linears widened to fp32 (oneDNN has no bf16 under the cap)."""
    if not can_build():
        pytest.skip("no C++ compiler or ninja: the engine runs its torch paths")
    if not {"avx2", "fma", "f16c", "bmi2", "movbe"} <= set(_cpu_flags().split()):
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    probe = subprocess.run(
        [sys.executable, "-c",
         "import torch; from common.cache_root import baton_cache_root; "
         "from kernels.native import build_folder, load_native_ops; from kernels.linear import Linear; "
         "print('loaded', load_native_ops()); print('amx', bool(torch.ops.baton.amx_supported())); "
         "print('linear', Linear(torch.zeros(32, 32, dtype=torch.bfloat16)).kernel); "
         "print('folder', build_folder(baton_cache_root()))"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env(**AVX2_ONLY))
    assert probe.returncode == 0, probe.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in probe.stdout.splitlines() if " " in line)
    assert (lines["loaded"], lines["amx"], lines["linear"]) == ("True", "False", "widened"), probe.stdout
    assert "-march=x86-64-v3" in (Path(lines["folder"]) / "build.ninja").read_text()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CAPPED_TESTS],
                          capture_output=True, text=True, timeout=1200, cwd=REPO, env=child_env(**AVX2_ONLY))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
