"""The memory a transport moves: an engine's whole KV pool as flat bytes, on the CPU or a GPU.

A transport touches the pool only through the few methods below, so that where the pool
lives is decided here, once:

- HostPool, a CPU pool (a flat uint8 numpy array): every piece is a view of the pool,
  which UCX reads and writes in place and ZeroMQ sends without a copy.
- CudaPool, a GPU pool (a flat uint8 torch CUDA tensor): every piece is a slice of the
  tensor, which UCX reads and writes in GPU memory (ucxx takes anything exposing
  `__cuda_array_interface__`). ZeroMQ frames live in host memory, so over ZeroMQ each
  piece is staged: copied to the host before it is sent, copied to the GPU as it lands.

CUDA work is ordered with the engine's through the CUDA stream the engine uses (the
caller's current one): `settle_caller` waits for it before a transfer may touch blocks,
and a staged copy is synchronous. UCX's own copies complete before UCX completes a request.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from common.kv_transfer.memory import advise_huge_pages

if TYPE_CHECKING:
    import torch

    from common.engine.kv_cache import KVCache


class HostPool:
    """A CPU pool: pieces are views of one flat uint8 array, moved in place."""

    on_device = False

    def __init__(self, array: np.ndarray):
        if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError("pool must be a flat, contiguous uint8 array")
        self.array = array
        self.nbytes = array.nbytes

    def view(self, offset: int, length: int) -> np.ndarray:
        """The piece itself, for UCX to read or write in place."""
        return self.array[offset:offset + length]

    def to_host(self, offset: int, length: int) -> np.ndarray:
        """The piece as a ZeroMQ frame: here the view itself (no copy)."""
        return self.array[offset:offset + length]

    def from_host(self, offset: int, payload: np.ndarray) -> None:
        """Write a received ZeroMQ frame into the piece at `offset`."""
        self.array[offset:offset + payload.nbytes] = payload

    def settle_caller(self) -> None:
        """Nothing: a CPU engine's writes are done when it calls."""

    def bind_thread(self) -> None:
        """Nothing: host memory needs no context on the service thread."""

    def current(self) -> AbstractContextManager:
        """Nothing to make current while the data plane starts."""
        return nullcontext()

    def advise_huge_pages(self) -> str:
        return advise_huge_pages(self.array)


class CudaPool:
    """A GPU pool: pieces are slices of one flat uint8 CUDA tensor. UCX moves them in GPU
    memory; ZeroMQ stages them through host memory (one synchronous copy per piece)."""

    on_device = True

    def __init__(self, tensor: torch.Tensor):
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            raise ValueError(f"a KV pool is a numpy array (CPU) or a CUDA tensor, not {type(tensor).__name__}"
                             + (f" on {tensor.device}" if isinstance(tensor, torch.Tensor) else ""))
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("pool must be a flat, contiguous uint8 tensor")
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self._torch = torch

    def view(self, offset: int, length: int) -> torch.Tensor:
        return self.tensor[offset:offset + length]

    def to_host(self, offset: int, length: int) -> np.ndarray:
        return self.tensor[offset:offset + length].cpu().numpy()  # synchronous: the frame owns its copy

    def from_host(self, offset: int, payload: np.ndarray) -> None:
        # A blocking copy (the stream is synchronised): the blocks hold the bytes on return.
        self.tensor[offset:offset + payload.nbytes].copy_(self._torch.from_numpy(payload))

    def settle_caller(self) -> None:
        """Wait until the caller's stream (the engine's) has run every kernel queued so far:
        UCX's copies run on streams of their own, which would not wait for them."""
        self._torch.cuda.current_stream(self.tensor.device).synchronize()

    def bind_thread(self) -> None:
        """Make the pool's device (its primary context) current on this thread: UCX, which
        the service thread progresses, copies GPU memory in the thread's current context."""
        self._torch.cuda.set_device(self.tensor.device)
        self._torch.cuda.synchronize(self.tensor.device)  # a runtime call binds the context to the thread

    def current(self) -> AbstractContextManager:
        """The pool's device made current on the caller's thread for a while (UCX starts
        inside it), and the caller's own current device restored after."""
        return self._torch.cuda.device(self.tensor.device)

    def advise_huge_pages(self) -> str:
        return "device memory"


KvPool = HostPool | CudaPool


def as_pool(pool: Any) -> KvPool:
    """The pool a transport moves: HostPool for a numpy array, CudaPool for a CUDA tensor."""
    return HostPool(pool) if isinstance(pool, np.ndarray) else CudaPool(pool)


def pool_bytes(cache: KVCache) -> np.ndarray | torch.Tensor:
    """The flat uint8 view of a KVCache's pool, sharing its memory: a numpy array for a CPU
    pool, a uint8 CUDA tensor for a GPU one."""
    import torch

    data = cache.data
    if not data.is_contiguous():
        raise ValueError("the KV transports move a contiguous pool tensor")
    flat = data.view(-1).view(torch.uint8)
    if data.device.type == "cpu":
        return flat.numpy()
    if data.device.type == "cuda":
        return flat
    raise ValueError(f"the KV transports move CPU and CUDA pools, not {data.device.type} ones")
