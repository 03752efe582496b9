"""Moving KV blocks between engine processes (prefill to decode): docs/kv-transfer.md §1.

`make_transport(setting, …)` picks the data plane: `ucx` (ucxx tag messages, in place),
`zmq` (ZeroMQ frames) or `auto` (UCX when it starts, else ZeroMQ with a warning), and
logs which it chose. Both implement KvTransport (transport.py), over a CPU or a CUDA
pool (pool.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from common.config import KV_TRANSPORTS
from common.kv_transfer.plan import PlanError, PoolGeometry, compat_hash, plan_pieces
from common.kv_transfer.pool import pool_bytes
from common.kv_transfer.transport import (
    HandshakeRefused,
    KvTransport,
    PullHandle,
    PullResult,
    TransferEvent,
    TransferOptions,
)
from common.kv_transfer.zmq_transport import ZmqTransport
from common.logs import get_logger
from common.sockets import Security

if TYPE_CHECKING:
    import torch  # only for the annotations

    from common.engine.kv_cache import KVCache


log = get_logger("kv_transfer")


def ucx_available() -> str | None:
    """None when ucxx imports, else why not."""
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except Exception as error:  # ImportError, or a missing shared library underneath
        return f"{type(error).__name__}: {error}"
    return None


def make_transport(setting: str, pool: np.ndarray | torch.Tensor, geometry: PoolGeometry, model_fingerprint: str,
                   security: Security, peer_id: str, options: TransferOptions | None = None) -> KvTransport:
    """The transport `kv_transport = setting` asks for. `ucx` fails loudly if UCX cannot
    start; `auto` falls back to ZeroMQ with a warning. The choice is made here, once, and
    logged: a transport never changes under a running transfer."""
    if setting not in KV_TRANSPORTS:
        raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {setting!r}")
    args = (pool, geometry, model_fingerprint, security, peer_id, options)
    if setting in ("auto", "ucx"):
        try:
            transport = _start_ucx(*args)
        except Exception as error:
            if setting == "ucx":
                raise RuntimeError(f"kv_transport = ucx, but UCX did not start: {error}") from error
            log.warning("kv_transport_fallback", wanted="ucx", chosen="zmq", reason=str(error))
        else:
            log.info("kv_transport_chosen", setting=setting, chosen="ucx")
            return transport
    transport = ZmqTransport(*args)
    log.info("kv_transport_chosen", setting=setting, chosen="zmq")
    return transport


def transport_for_cache(setting: str, cache: KVCache, model_fingerprint: str, security: Security, peer_id: str,
                        options: TransferOptions | None = None) -> KvTransport:
    """`make_transport` over an engine's KV cache: a CPU pool, or a CUDA one (which UCX
    moves in GPU memory and ZeroMQ stages through host memory); ValueError otherwise."""
    return make_transport(setting, pool_bytes(cache), PoolGeometry(cache.layout, cache.num_blocks),
                          model_fingerprint, security, peer_id, options)


def _start_ucx(*args: Any) -> KvTransport:
    reason = ucx_available()
    if reason is not None:
        raise RuntimeError(f"ucxx does not import ({reason})")
    from common.kv_transfer.ucx_transport import UcxTransport

    return UcxTransport(*args)


__all__ = ["HandshakeRefused", "KV_TRANSPORTS", "KvTransport", "PlanError", "PoolGeometry", "PullHandle",
           "PullResult", "TransferEvent", "TransferOptions", "ZmqTransport", "compat_hash", "make_transport",
           "plan_pieces", "pool_bytes", "transport_for_cache", "ucx_available"]
