"""Fixtures for the kernel tests."""
import os
import shutil

import pytest

from kernels.native import load_native_ops


@pytest.fixture(scope="session")
def native_kernels():
    """Baton's C++ kernels, built here: a machine with a C++ compiler must build them."""
    if not load_native_ops():
        if shutil.which(os.environ.get("CXX", "c++")) is not None:
            pytest.fail("a C++ compiler is here but kernels/csrc did not build (see the warning above)")
        pytest.skip("no C++ compiler: the engine runs its torch paths")
