"""Progress of long steps, on a terminal and in logs alike.

tqdm draws a bar on a terminal and nothing when stderr is a pipe or a log file (its
`disable=None`), which is how `svc up`, `scripts/up.sh`, compose and CI run: there a step
of a minute looked like a hang. `progress` keeps tqdm's bar on a terminal and elsewhere
writes a plain line to stderr at most every `every_s` seconds; `heartbeat` does the same
for a step that cannot count its work (a compiler run), from a thread, until it ends.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

EVERY_S = 2.0  # what the issue of first starts asked for: nothing silent for longer


class LineProgress:
    """tqdm's `update`/`close` for a stream that is no terminal: one line per `every_s`
    seconds at most, and a last one at close."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float = EVERY_S,
                 stream: TextIO | None = None) -> None:
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0
        self.started = self.last_line = time.monotonic()

    def update(self, count: int = 1) -> None:
        self.count += count
        now = time.monotonic()
        if now - self.last_line >= self.every_s:
            self._line(now)

    def close(self) -> None:
        self._line(time.monotonic())

    def _line(self, now: float) -> None:
        self.last_line = now
        print(f"{self.desc}: {self.count}/{self.total} {self.unit}s, {now - self.started:.0f} s",
              file=self.stream, flush=True)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@contextmanager
def progress(total: int, desc: str, unit: str) -> Iterator:
    """A tqdm bar on a terminal, else a LineProgress on stderr; call `.update(n)`."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, desc=desc, unit=unit) as bar:
            yield bar
    else:
        with LineProgress(total, desc, unit) as lines:
            yield lines


@contextmanager
def heartbeat(what: str, every_s: float = EVERY_S, stream: TextIO | None = None) -> Iterator[None]:
    """While the body runs, a line "<what>: <n> s" on stderr every `every_s` seconds (the
    first after `every_s`: a step done sooner prints nothing)."""
    out = stream if stream is not None else sys.stderr
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            print(f"{what}: {time.monotonic() - started:.0f} s", file=out, flush=True)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=every_s)  # it wakes on `done` at once; never wait on a stuck print
