"""`svc up`: run a whole single-node cluster as child processes and keep it running.

Children start in dependency order (router, workers, tokenizer), each awaited until it
prints its ready line. A child that dies is reported and restarted with exponential
backoff. SIGINT/SIGTERM stop every child (SIGTERM, then SIGKILL after a grace period);
children also get SIGKILL if the supervisor itself dies, so nothing is left behind.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from common.logs import get_logger

log = get_logger("supervisor")
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 1.0
    restart_at: float | None = None


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Supervisor:
    def __init__(self, children: list[Child], ready_timeout_s: float = 180.0):
        self.children = children
        self.ready_timeout_s = ready_timeout_s

    def start_all(self) -> None:
        for child in self.children:
            process = self._spawn(child)
            deadline = time.monotonic() + self.ready_timeout_s
            while not child.ready.wait(0.2):
                if process.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with code {process.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} did not become ready within {self.ready_timeout_s:.0f} s")

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(0.2):
            now = time.monotonic()
            for child in self.children:
                self._check(child, now)

    def stop_all(self) -> None:
        running = [c.process for c in self.children if c.process and c.process.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    def _check(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                log.warning("restarting", child=child.name, restarts=child.restarts)
                self._spawn(child)
            return
        assert child.process is not None  # spawned by start_all before any check
        code = child.process.poll()
        if code is None:
            if now - child.started_at > STABLE_AFTER_S:
                child.backoff_s = 1.0
            return
        log.error("child_died", child=child.name, exit_code=code, restart_in_s=child.backoff_s)
        print(f"svc up: {child.name} died (exit code {code}); restarting in {child.backoff_s:.0f} s",
              file=sys.stderr, flush=True)
        child.restart_at = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)

    def _spawn(self, child: Child) -> subprocess.Popen:
        child.ready.clear()
        child.started_at = time.monotonic()
        process = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                   text=True, bufsize=1, preexec_fn=_die_with_parent)
        child.process = process
        threading.Thread(target=self._forward, args=(child, process), daemon=True).start()
        return process

    @staticmethod
    def _forward(child: Child, process: subprocess.Popen) -> None:
        """Relay the child's stdout with its name, and notice its ready line."""
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            if " ready" in line and line.startswith("baton "):
                child.ready.set()
            print(f"[{child.name}] {line}", end="", flush=True)
