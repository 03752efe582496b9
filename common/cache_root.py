"""Where Baton keeps what it builds and measures on a machine: default models, compiled
kernels and router modules, node profiles. Imports nothing heavy: the router reads it."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "BATON_CACHE_DIR"


def baton_cache_root() -> Path:
    """$BATON_CACHE_DIR, else ~/.cache/baton."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "baton")
