"""Entry point of the `router` role."""
from __future__ import annotations

import signal
import threading

from common.config import ClusterConfig
from services.router.service import RouterService


def run(config: ClusterConfig) -> None:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    RouterService(config).run(stop)
