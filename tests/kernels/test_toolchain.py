"""kernels.toolchain: a compiler that links libstdc++ statically is found out and replaced,
and a library's dynamic section is read right (on real compilers and real libraries)."""
import shutil
from pathlib import Path

import pytest

from kernels.toolchain import (
    SYSTEM_COMPILER,
    ToolchainError,
    choose_compiler,
    links_shared_cxx_runtime,
    needed_libraries,
    shares_cxx_runtime,
)

pytestmark = pytest.mark.skipif(shutil.which(SYSTEM_COMPILER) is None, reason="no C++ compiler here")


def static_runtime_compiler(folder: Path) -> Path:
    """A compiler that links its own copy of libstdc++ into every library, as some
    toolchains installed beside the system's do (the system's, with -static-libstdc++)."""
    script = folder / "static-g++"
    script.write_text(f'#!/bin/sh\nexec {shutil.which(SYSTEM_COMPILER)} "$@" -static-libstdc++\n')
    script.chmod(0o755)
    return script


def test_the_built_kernel_library_links_the_shared_runtime_torch_uses(native_kernels):
    from common.cache_root import baton_cache_root
    from kernels.native import LIBRARY_NAME, build_folder

    needed = needed_libraries(build_folder(baton_cache_root()) / f"{LIBRARY_NAME}.so")
    assert "libstdc++.so.6" in needed and "libc10.so" in needed


def test_the_system_compiler_links_the_shared_runtime():
    assert links_shared_cxx_runtime(SYSTEM_COMPILER)
    assert choose_compiler({}) == SYSTEM_COMPILER


def test_a_compiler_with_a_static_runtime_is_replaced_by_the_system_one(tmp_path):
    static = static_runtime_compiler(tmp_path)
    assert not links_shared_cxx_runtime(str(static))
    assert choose_compiler({"CXX": str(static)}) == SYSTEM_COMPILER


def test_a_missing_or_failing_compiler_is_named(tmp_path):
    with pytest.raises(ToolchainError, match="'/no/such/c\\+\\+' not found"):
        choose_compiler({"CXX": "/no/such/c++"})
    failing = tmp_path / "failing-c++"
    failing.write_text("#!/bin/sh\necho 'licence expired' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(ToolchainError, match="failed on a one-line library: licence expired"):
        choose_compiler({"CXX": str(failing)})


def test_a_file_that_is_not_a_whole_elf_library_is_refused_by_name(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    with pytest.raises(ValueError, match="notes.txt: not a 64-bit little-endian ELF file"):
        needed_libraries(text)
    library = tmp_path / "probe.so"
    library.write_bytes(Path(shutil.which(SYSTEM_COMPILER)).read_bytes()[:100])  # a real ELF header, cut short
    with pytest.raises(ValueError, match="probe.so: damaged ELF file"):
        shares_cxx_runtime(library)
