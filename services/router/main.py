"""Entry point of the `router` role."""
from __future__ import annotations

import gc
import signal
import threading

from common.config import ClusterConfig
from services.router.service import RouterService


def quiet_gc() -> None:
    """The prefix index holds up to millions of small objects; a full cycle collection
    over them stalls placement for ~100 ms. Collect rarely: the index frees its nodes
    by reference counting, so little is ever left for the collector."""
    gc.set_threshold(200_000, 50, 100)


def run(config: ClusterConfig) -> None:
    quiet_gc()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    RouterService(config).run(stop)
