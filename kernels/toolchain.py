"""Which C++ compiler may build Baton's CPU kernels, and what a built library links.

A kernel library must use the C++ runtime torch's Linux wheels load (libstdc++.so.6,
shared). A compiler that links its own libstdc++ statically (some toolchains in /opt do,
and CXX may name one) makes a library that loads and runs, but whose error messages lose
the numbers they format or crash the process (both seen: GCC 12 here, the H200 image's
/opt/gcc): its copy of the runtime looks up locale facets that only the shared one
registered. So a compiler is tried on a one-line library first, and a built library's
dynamic section is read before it is loaded.
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

SYSTEM_COMPILER = "c++"  # what torch's extension builder uses where CXX is unset
SHARED_CXX_RUNTIME = "libstdc++.so"
PROBE_SOURCE = '#include <sstream>\nstd::string baton_probe(long n) { std::ostringstream s; s << n; return s.str(); }\n'
PROBE_TIMEOUT_S = 60

_DT_NEEDED = 1
_SHT_DYNAMIC = 6


class ToolchainError(RuntimeError):
    """No compiler here can build a library that shares torch's C++ runtime."""


def needed_libraries(library: Path) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared library, in order.
    Raises ValueError for a file that is not one (or is cut short)."""
    data = library.read_bytes()
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        raise ValueError(f"{library}: not a 64-bit little-endian ELF file")
    try:
        return _needed(data)
    except (struct.error, IndexError, ValueError) as error:
        raise ValueError(f"{library}: damaged ELF file ({error})") from error


def _needed(data: bytes) -> list[str]:
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    needed = []
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != _SHT_DYNAMIC:
            continue
        strings_offset = sections[link][4]
        for entry in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, entry)
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strings_offset + value)
                needed.append(data[strings_offset + value:end].decode())
    return needed


def shares_cxx_runtime(library: Path) -> bool:
    """Whether `library` links the shared libstdc++ (rather than carrying its own copy)."""
    return any(name.startswith(SHARED_CXX_RUNTIME) for name in needed_libraries(library))


def links_shared_cxx_runtime(compiler: str) -> bool:
    """Whether `compiler` builds a shared library that links the C++ runtime dynamically.
    Raises ToolchainError if it cannot build one at all (missing, or failing)."""
    if shutil.which(compiler) is None:
        raise ToolchainError(f"C++ compiler {compiler!r} not found")
    with tempfile.TemporaryDirectory(prefix="baton-cxx-probe-") as folder:
        source, library = Path(folder) / "probe.cpp", Path(folder) / "probe.so"
        source.write_text(PROBE_SOURCE)
        try:
            subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], capture_output=True,
                           text=True, timeout=PROBE_TIMEOUT_S, check=True)
        except subprocess.CalledProcessError as error:
            raise ToolchainError(f"C++ compiler {compiler!r} failed on a one-line library: "
                                 f"{(error.stderr or '').strip()[-300:]}") from error
        except (OSError, subprocess.SubprocessError) as error:
            raise ToolchainError(f"C++ compiler {compiler!r} could not run: {error}") from error
        return shares_cxx_runtime(library)


def choose_compiler(environ: Mapping[str, str]) -> str:
    """The compiler to build with: CXX (else the system's `c++`) if it links the shared C++
    runtime; if it links its own copy statically, the system's `c++` where that one does.
    Raises ToolchainError, naming what was tried, where neither can be used."""
    wanted = environ.get("CXX") or SYSTEM_COMPILER
    if links_shared_cxx_runtime(wanted):
        return wanted
    if wanted != SYSTEM_COMPILER:
        try:
            if links_shared_cxx_runtime(SYSTEM_COMPILER):
                return SYSTEM_COMPILER
        except ToolchainError:
            pass
    raise ToolchainError(f"C++ compiler {wanted!r} links libstdc++ statically (its copy of the runtime breaks "
                         f"torch's), and no system {SYSTEM_COMPILER!r} that links it as a shared library was found")
