"""Run a command with its stderr on a pseudo-terminal, for progress bars that draw only there."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
from pathlib import Path


def run_with_stderr_on_terminal(argv: list[str], cwd: Path, env: dict[str, str],
                                timeout: float) -> tuple[subprocess.CompletedProcess, bytes]:
    """Run argv with stdout piped and stderr on a 24x100 pseudo-terminal; the finished
    process (stdout as text) and every byte drawn on the terminal. The terminal is read
    once the process ends, so what it writes there must fit the pty's buffer (KiBs)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=terminal, text=True, cwd=cwd, env=env,
                              timeout=timeout)
        os.close(terminal)
        terminal = -1
        return done, _read_all(controller)
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)


def _read_all(controller: int) -> bytes:
    drawn = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal's other end is closed: all is read
            return drawn
        if not chunk:
            return drawn
        drawn += chunk
