"""Baton's kernels under an instruction-set cap (kernels/native.py `isa_cap_flags`): built
for what ONEDNN_MAX_CPU_ISA allows, so that with oneDNN, ATen and MKL capped alike a CPU
with AVX-512 or AMX runs the code an AVX2-only CPU runs."""
import pytest

from kernels.native import ISA_CAP_ENV, isa_cap_flags

NATIVE = ("-march=native",)
NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


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
