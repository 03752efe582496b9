"""Paged attention with flash-attn's varlen kernel (NVIDIA GPUs with flash-attn).

flash-attn's own paged path needs pages of 256 tokens; Baton's blocks are smaller, so
each layer gathers the batch's context K/V into one packed varlen buffer and calls
`flash_attn_varlen_func` with bottom-right-aligned causal masking, which is exactly
"query j of a chunk sees context up to its own position".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func

from kernels.attention import AttentionBackend, AttentionInputs


@dataclass
class FlashMetadata:
    slot_mapping: torch.Tensor
    context_slots: torch.Tensor  # [sum(context_lens)] packed cache slots
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class FlashPagedBackend(AttentionBackend[FlashMetadata]):
    name = "flash"

    def prepare(self, inputs: AttentionInputs) -> FlashMetadata:
        device = inputs.block_table.device
        size = inputs.block_size
        ctx_lens = torch.tensor(inputs.context_lens, device=device, dtype=torch.int32)
        q_lens = torch.tensor(inputs.query_lens, device=device, dtype=torch.int32)
        cu_k = torch.zeros(inputs.num_seqs + 1, device=device, dtype=torch.int32)
        cu_q = torch.zeros_like(cu_k)
        torch.cumsum(ctx_lens, 0, out=cu_k[1:])
        torch.cumsum(q_lens, 0, out=cu_q[1:])
        seq_of_key = torch.repeat_interleave(torch.arange(inputs.num_seqs, device=device), ctx_lens)
        key_pos = torch.arange(int(cu_k[-1]), device=device) - cu_k[:-1].long()[seq_of_key]
        slots = inputs.block_table[seq_of_key, key_pos // size] * size + key_pos % size
        return FlashMetadata(inputs.slot_mapping, slots, cu_q, cu_k,
                             max(inputs.query_lens), max(inputs.context_lens))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
                metadata: FlashMetadata, kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            kv_layer[0].index_copy_(0, metadata.slot_mapping, key)
            kv_layer[1].index_copy_(0, metadata.slot_mapping, value)
        keys, values = kv_layer.index_select(1, metadata.context_slots)
        return flash_attn_varlen_func(
            query, keys, values, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
            metadata.max_seqlen_q, metadata.max_seqlen_k, causal=True)
