"""The router's hot modules compiled with mypyc, loaded in place of their source when a
build of the current sources exists (docs/router.md §8.5).

mypyc (part of mypy) compiles the type-annotated modules below to C extensions: the
prefix index, the cluster state and its queue model, the lazy ranking, admission and
cost_aware. They make the same decisions (the build compiles with -ffp-contract=off, so
no float expression is fused differently from Python's) and run the placement path
1.3-1.5 times as fast.

A build lives under the Baton cache in a folder named by a digest of every source file of
`services/router` and `common` (what the compiled code was type-checked against), the
Python ABI and the machine, so an edited source is never shadowed by a stale build: the
digest changes and the source runs until the next build. `python -m
services.router.native_build` builds (services/router/native_build.py).
BATON_NATIVE_ROUTER=0 keeps the source modules.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from common.cache_root import baton_cache_root

REPO = Path(__file__).resolve().parents[2]
COMPILED = ("services/router/index.py", "services/router/cluster.py", "services/router/ranking.py",
            "services/router/admission.py", "services/router/policies/cost_aware.py")
DIGESTED = ("services/router", "common")  # what the compiled modules were checked against
DISABLE_ENV = "BATON_NATIVE_ROUTER"
COMPLETE = "complete"  # written last: a folder without it is a build that did not finish
CFLAGS = ("-ffp-contract=off",)  # a*b+c stays two roundings, as in Python, where FMA exists


def build_folder(cache_root: Path | None = None) -> Path:
    """Where the build of the current sources for this Python and machine lives."""
    return Path(cache_root or baton_cache_root()) / "router-native" / sources_digest()


@functools.cache
def sources_digest() -> str:
    """The digest a build is named by (read once per process)."""
    digest = hashlib.sha256()
    for top in DIGESTED:
        for source in sorted((REPO / top).rglob("*.py")):
            digest.update(str(source.relative_to(REPO)).encode() + b"\0" + source.read_bytes())
    digest.update(f"{sys.implementation.cache_tag} {sysconfig.get_platform()} {' '.join(CFLAGS)}".encode())
    return digest.hexdigest()[:16]


def use_compiled(package: str, package_path: list[str]) -> bool:
    """Put the build's folder for `package` (a dotted name) first on its __path__, so its
    compiled modules load instead of the sources; False (the sources run) when there is no
    complete build of these sources or BATON_NATIVE_ROUTER is 0."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    folder = build_folder()
    if not (folder / COMPLETE).is_file():
        return False
    compiled = str(folder.joinpath(*package.split(".")))
    if compiled not in package_path:
        package_path.insert(0, compiled)
    _load_runtime(folder)
    return True


def _load_runtime(folder: Path) -> None:
    """Load the build's shared mypyc runtime (a module at the folder's top, which every
    compiled module imports by its top-level name) from its file. Not by putting the
    folder on sys.path: that path passes to spawned child processes, where the folder's
    `services/` tree would then be found first, as a namespace package without the sources."""
    for runtime in folder.glob("*__mypyc.*"):
        name = runtime.name.split(".", 1)[0]
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, runtime)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the router's compiled runtime {runtime}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def compiled() -> bool:
    """Whether this process runs the build of every module in COMPILED (importing them)."""
    names = [path.removesuffix(".py").replace("/", ".") for path in COMPILED]
    return all(not str(importlib.import_module(name).__file__).endswith(".py") for name in names)
