"""Baton's C++ CPU kernels (kernels/csrc), built on this machine on first use.

The sources compile with torch's extension builder (a C++ compiler and ninja; the
`engine` extra installs ninja) into a folder under the Baton cache named by a digest of
the sources, the torch version and the CPU's instruction set, so a build is reused only
where it was made for. Once built, loading is a plain `torch.ops.load_library`.

The compiler is CXX's, or the system's `c++` where CXX links its own static copy of the
C++ runtime (kernels/toolchain.py says why that cannot load beside torch). Where no
compiler is found or the build fails, `load_native_ops` says why once and
returns False: callers keep their torch path. BATON_NATIVE_KERNELS=0 turns the kernels off.

They target the CPU they build on (-march=native), unless oneDNN's own instruction-set
cap, ONEDNN_MAX_CPU_ISA, names a smaller set: then they build for that set too (an AVX2
cap: x86-64-v3, no AVX-512 and no AMX), so that with ATEN_CPU_CAPABILITY and
MKL_ENABLE_INSTRUCTIONS set alike an AMX machine runs every kernel the way an AVX2-only
CPU does (`isa_cap_flags`; tests/kernels/test_isa_cap.py).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import structlog
import torch

from common.cache_root import baton_cache_root
from common.progress import heartbeat
from kernels.toolchain import choose_compiler, shares_cxx_runtime

log = structlog.get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
# The sources, compiled as two units of a few sources each (one per core of a small
# machine): a source alone spent ~5 s of its compile on torch's headers, which a unit
# pays once (a first build on 2 cores 33-36 s -> 11-13 s, docs/performance.md §8.11).
# Each source keeps its internals in a namespace of its own, so that they can share a unit.
UNITS = ((CSRC / "paged_attention.cpp", CSRC / "amx_attention.cpp", CSRC / "kv_copy.cpp"),
         (CSRC / "elementwise.cpp", CSRC / "amx_linear.cpp", CSRC / "argmax.cpp", CSRC / "decode_layer.cpp"))
SOURCES = tuple(source for unit in UNITS for source in unit)
HEADERS = (CSRC / "lanes.h", CSRC / "amx.h", CSRC / "paged_inputs.h")
LIBRARY_NAME = "baton_cpu_kernels"
DISABLE_ENV = "BATON_NATIVE_KERNELS"
# -fopenmp: at::parallel_for is inlined here and runs on OpenMP, as torch's CPU build does
# (torch's own libgomp is already loaded when this library is); without it, one thread.
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)
ISA_CAP_ENV = "ONEDNN_MAX_CPU_ISA"
NATIVE_TARGET = ("-march=native",)
# oneDNN's cap names -> the target flags that allow no more than the cap does.
_NO_AMX = NATIVE_TARGET + ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
_CAPPED_TARGETS = {
    "SSE41": ("-march=x86-64-v2",), "AVX": ("-march=x86-64-v2", "-mavx"),
    **dict.fromkeys(("AVX2", "AVX2_VNNI", "AVX2_VNNI_2"), ("-march=x86-64-v3",)),
    **dict.fromkeys(("AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512"),
                    _NO_AMX),
    **dict.fromkeys(("AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
                     "ALL", "DEFAULT", ""), NATIVE_TARGET),
}


def isa_cap_flags(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The target flags the kernels build with: -march=native, or no more than the set
    ONEDNN_MAX_CPU_ISA caps oneDNN to. An unknown cap is refused by name (a native build
    would run instructions the operator asked not to)."""
    cap = environ.get(ISA_CAP_ENV, "").strip().upper()
    if cap not in _CAPPED_TARGETS:
        raise ValueError(f"{ISA_CAP_ENV}={environ[ISA_CAP_ENV]!r} is not an instruction set Baton's kernels "
                         f"know ({', '.join(name for name in _CAPPED_TARGETS if name)})")
    return _CAPPED_TARGETS[cap]


def build_flags() -> tuple[str, ...]:
    return CFLAGS + isa_cap_flags()


def build_folder(cache_root: Path) -> Path:
    """Where this machine's build of the current sources lives."""
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(build_flags() + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    return cache_root / "kernels" / f"{LIBRARY_NAME}-{digest.hexdigest()[:16]}"


def _cpu_flags() -> str:
    """The instruction sets -march=native compiles for (a build is not moved between CPUs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_supports_head_dim(head_dim: int) -> bool:
    """The kernel's head dims: multiples of 16 up to 256 (the C++ side checks it too)."""
    return head_dim % 16 == 0 and 0 < head_dim <= 256


def amx_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Baton's AMX kernels (bf16 only) run for this device and dtype: a CPU with
    AMX tiles the build targets, and the OS lets this process use them."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return load_native_ops() and bool(torch.ops.baton.amx_supported())


@functools.cache
def load_native_ops() -> bool:
    """Make torch.ops.baton.* available; False (and one warning) if they cannot be."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    folder = build_folder(baton_cache_root())
    built = folder / f"{LIBRARY_NAME}.so"
    try:
        # A lock file means another process is building (torch's builder holds it).
        if built.is_file() and not (folder / "lock").exists():
            try:
                if not shares_cxx_runtime(built):
                    raise OSError("it carries its own copy of the C++ runtime")
                torch.ops.load_library(str(built))
                return True
            except (OSError, ValueError) as error:  # e.g. a file cut short by a crash: build it again
                log.warning("native_kernels_rebuilding", library=str(built), reason=str(error)[:300])
                shutil.rmtree(folder, ignore_errors=True)
        _build(folder)
    except Exception as error:  # a missing compiler, a failed build: keep the torch path
        log.warning("native_kernels_unavailable", reason=str(error).strip().splitlines()[-1][:300],
                    hint=f"the engine runs its torch paths instead; {DISABLE_ENV}=0 silences this")
        return False
    return True


def write_units(folder: Path) -> list[str]:
    """Write UNITS into `folder` as sources that include theirs; returns their paths."""
    paths = []
    for index, unit in enumerate(UNITS):
        path = folder / f"unit{index}.cpp"
        path.write_text("".join(f'#include "{source}"\n' for source in unit))
        paths.append(str(path))
    return paths


def _build(folder: Path) -> None:
    from torch.utils import cpp_extension  # imports setuptools: only when building

    folder.mkdir(parents=True, exist_ok=True)
    # The ninja that the engine extra installs sits next to this interpreter.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    compiler, wanted = choose_compiler(os.environ), os.environ.get("CXX")
    if wanted and compiler != wanted:
        log.warning("native_kernels_compiler_replaced", wanted=wanted, using=compiler,
                    reason="CXX links libstdc++ statically; its copy of the C++ runtime breaks torch's")
    log.info("native_kernels_building", folder=str(folder), compiler=compiler, note="first use on this machine, ~12 s")
    os.environ["CXX"] = compiler  # torch's extension builder reads the compiler from CXX
    try:
        with heartbeat("building Baton's CPU kernels"):
            cpp_extension.load(name=LIBRARY_NAME, sources=write_units(folder), extra_cflags=list(build_flags()),
                               extra_ldflags=list(LDFLAGS),
                               build_directory=str(folder), is_python_module=False, verbose=False)
    finally:
        if wanted is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = wanted
