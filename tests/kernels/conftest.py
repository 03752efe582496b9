"""Fixtures for the kernel tests."""
import os
import shutil
import sys
from pathlib import Path

import pytest

from kernels.native import load_native_ops


def can_build() -> bool:
    """A C++ compiler and ninja (the engine extra's, next to this interpreter, or on PATH)."""
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    return shutil.which(os.environ.get("CXX", "c++")) is not None and ninja is not None


@pytest.fixture(scope="session")
def native_kernels():
    """Baton's C++ kernels, built here: a machine that can build them must."""
    if not load_native_ops():
        if can_build():
            pytest.fail("a C++ compiler and ninja are here but kernels/csrc did not build (see the warning above)")
        pytest.skip("no C++ compiler or ninja: the engine runs its torch paths")
