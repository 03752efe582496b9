"""A one-line progress bar for long runs (`svc sim`, `svc bench`), with no dependency.

It redraws in place with a carriage return, at most `max_hz` times a second, and
draws nothing when its stream is not a terminal (logs and pipes stay clean) unless
forced.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 30


class Progress:
    """Progress(total, label).advance(n) ... .close(); also a context manager."""

    def __init__(
        self,
        total: int,
        label: str,
        file: TextIO | None = None,
        enabled: bool = True,
        force: bool = False,
        max_hz: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(0, total)
        self.label = label
        self.done = 0
        self._file = file if file is not None else sys.stderr
        self._enabled = enabled and (force or _is_tty(self._file))
        self._min_interval_s = 1.0 / max_hz
        self._clock = clock
        self._start = clock()
        self._last_draw: float | None = None
        self._drawn_width = 0
        self._closed = False

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self._enabled:
            return
        now = self._clock()
        if self._last_draw is None or now - self._last_draw >= self._min_interval_s:
            self._draw(now)

    def close(self) -> None:
        """Draw the final state and end the line; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self._enabled:
            self._draw(self._clock())
            self._file.write("\n")
            self._file.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self, now: float) -> str:
        """The text drawn at time `now` (without the carriage return)."""
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = round(fraction * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (
            f"{self.label} [{bar}] {self.done}/{self.total} {fraction:4.0%} "
            f"{elapsed:.1f}s {rate:.1f}/s"
        )

    def _draw(self, now: float) -> None:
        self._last_draw = now
        text = self.line(now)
        # Pad over the tail of a longer previous line: \r does not clear it.
        self._file.write("\r" + text.ljust(self._drawn_width))
        self._drawn_width = len(text)
        self._file.flush()


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
