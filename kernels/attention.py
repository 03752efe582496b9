"""One attention interface over the paged KV cache, and the choice of backend.

Every step the runner describes its batch once (AttentionInputs); the backend turns that
into its own metadata (`prepare`), then each layer calls `forward`, which writes the
step's new K/V into the cache (unless the layer's rotary op did) and attends over each
sequence's whole context.

Batch layout contract: the step's tokens are flattened; sequences whose query is a single
token come first (rows 0..num_single-1, one each), then the multi-token chunks.
"""
from __future__ import annotations

import contextlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

# A backend's per-step metadata type: what its `prepare` makes and its `forward` takes.
Metadata = TypeVar("Metadata")


@dataclass
class AttentionInputs:
    """One step's batch, as every backend needs it.

    query_starts/query_lens: each sequence's rows in the flat batch; context_lens: its
    KV length once this step's tokens are written; block_table: [seqs, max_blocks]
    block ids (padded with 0); slot_mapping: [tokens] the cache slot each new token's
    K/V goes to; seq_keys: a key per sequence, unique among the engine's sequences (a
    backend may keep per-sequence state across steps under it), or None.
    """

    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    num_single: int
    block_size: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    seq_keys: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC, Generic[Metadata]):
    name: str
    native: bool = False  # whether it runs Baton's C++ CPU kernel (kernels/csrc) for some groups
    amx_chunks: bool = False  # whether chunks over cached context go through the AMX kernel

    @abstractmethod
    def prepare(self, inputs: AttentionInputs) -> Metadata:
        """Per-step metadata, computed once and shared by all layers."""

    def step_scope(self) -> contextlib.AbstractContextManager:
        """Entered once around each step's forward pass (every layer's `forward`); by
        default nothing."""
        return contextlib.nullcontext()

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_layer: torch.Tensor, metadata: Metadata, kv_stored: bool = False) -> torch.Tensor:
        """query [tokens, q_heads, head_dim], key/value [tokens, kv_heads, head_dim];
        kv_layer [2 (K, V), slots, kv_heads, head_dim], this layer's cache, into which the
        step's key and value are written first unless `kv_stored` says the layer's ops did
        (kernels/layer_ops.py rotate_and_store). Returns [tokens, q_heads, head_dim]."""


def flash_attn_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def select_backend(name: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> AttentionBackend:
    """The backend called `name`, or for "auto" the best this machine has. On the CPU the
    SDPA backend decodes through Baton's C++ kernel where it builds and fits the head dim,
    and in bf16 attends chunks over cached context with the AMX kernel where the CPU has it."""
    from kernels.native import native_supports_head_dim
    from kernels.sdpa_paged import SdpaPagedBackend, amx_chunks_fit

    if name == "auto":
        name = "flash" if flash_attn_available(device) else "sdpa"
    if name == "sdpa":
        return SdpaPagedBackend(device, native=None if native_supports_head_dim(head_dim) else False,
                                amx_chunks=amx_chunks_fit(device, dtype, head_dim))
    if name == "flash":
        if not flash_attn_available(device):
            raise RuntimeError("attention_backend 'flash' needs a CUDA device and the flash-attn "
                               "package (pip install 'baton[gpu]')")
        from kernels.flash_paged import FlashPagedBackend

        return FlashPagedBackend()
    raise ValueError(f"attention_backend: unknown backend {name!r}; choose auto, sdpa or flash")
