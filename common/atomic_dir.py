"""Directories that appear whole or not at all: what Baton builds once into its cache (the
default model, GGUF conversions) is written in a temporary directory beside its final
path and renamed into place, so a reader never sees half of one, and processes racing to
build the same directory all end up using one complete copy. Imports nothing heavy."""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Build `out_dir` by calling `write(tmp)` on an empty temporary directory beside it,
    then rename that into place; returns `out_dir`.

    Raises FileExistsError if `out_dir` is a file or a non-empty directory, also when
    another writer renamed its copy there first. Whatever `write` raises propagates and
    leaves nothing behind.
    """
    out_dir = Path(out_dir)
    require_empty_or_absent(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
        write(tmp_dir)
        fsync_dir(tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)  # atomic; replaces out_dir only if it is empty
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise FileExistsError(f"{out_dir}: already holds a checkpoint "
                                  f"(written concurrently by another process)") from exc
        fsync_dir(out_dir.parent)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def cached_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """`out_dir`, built with `write_dir_atomically(out_dir, write)` unless it already holds
    something. Safe when several processes race to build it: each may build its own copy,
    the first rename wins and the others use the winner's."""
    out_dir = Path(out_dir)
    if is_non_empty_dir(out_dir):
        return out_dir
    try:
        write_dir_atomically(out_dir, write)
    except FileExistsError:
        if not is_non_empty_dir(out_dir):
            raise  # a file in the way, not a winner's directory
    return out_dir


def write_json(path: Path, value: dict[str, Any]) -> None:
    """`value` as indented JSON (non-ASCII kept as is), flushed to disk."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    fsync_file(path)


def fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_empty_or_absent(out_dir: Path) -> None:
    """FileExistsError unless `out_dir` is absent or an empty directory."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    if is_non_empty_dir(out_dir):
        raise FileExistsError(f"{out_dir}: directory exists and is not empty; "
                              f"refusing to write a checkpoint over it")


def is_non_empty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())
