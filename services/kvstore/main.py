"""Entry point of the `kvstore` role: derive the KV layout from the model's config (no
weights are loaded), open the tiers, serve until SIGTERM or SIGINT."""
from __future__ import annotations

import signal
import threading

from common.config import ClusterConfig, model_dir
from common.engine.checkpoint import fingerprints, load_model_config
from common.engine.kv_layout import KVLayout
from common.engine.node_dtype import node_dtype


def store_layout(config: ClusterConfig) -> KVLayout:
    """The KV layout of the cluster's engines: the model's shape, their block size and the
    dtype they compute in (`auto` resolved as the engines of this node resolve it)."""
    return KVLayout.for_model(load_model_config(model_dir(config)), config.block_size,
                              node_dtype(config.dtype, config.device))


def run(config: ClusterConfig) -> None:
    from services.kvstore.service import StoreService

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    model_fingerprint, _ = fingerprints(model_dir(config))  # the KV transport's handshake compares it
    StoreService(config, store_layout(config), model_fingerprint).run(stop)
