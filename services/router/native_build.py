"""Build the router's compiled modules (services/router/native.py says what and why):
`python -m services.router.native_build`. It needs mypy (whose mypyc compiles them),
setuptools and a C compiler; scripts/_venv.sh runs it after an install. Where it cannot
build, it says why and exits 1, and the router runs its source modules."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.router.native import CFLAGS, COMPILED, COMPLETE, REPO, build_folder


def build(cache_root: Path | None = None) -> Path:
    """Compile COMPILED into build_folder(); returns it. Safe when several processes race:
    each builds in a folder of its own and the first rename wins."""
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped]

    folder = build_folder(cache_root)
    if (folder / COMPLETE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    try:
        cwd = os.getcwd()
        os.chdir(REPO)  # mypyc names the modules by their paths from here
        try:
            extensions = mypycify(list(COMPILED), opt_level="3", target_dir=str(work / "c"))
            for extension in extensions:
                extension.extra_compile_args = [*extension.extra_compile_args, *CFLAGS]
            distribution = Distribution({"name": "baton-router-native", "ext_modules": extensions})
            command = distribution.get_command_obj("build_ext")
            command.build_lib, command.build_temp = str(work / "lib"), str(work / "obj")
            distribution.run_command("build_ext")
        finally:
            os.chdir(cwd)
        (work / "lib" / COMPLETE).write_text("\n".join(COMPILED) + "\n")
        try:
            os.rename(work / "lib", folder)
        except OSError:
            if not (folder / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def main() -> None:
    try:
        print(f"built the router's compiled modules in {build()}")
    except Exception as error:  # noqa: BLE001 - any failure leaves the source modules in use
        print(f"the router runs its source modules: compiling them failed ({type(error).__name__}: {error})",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
