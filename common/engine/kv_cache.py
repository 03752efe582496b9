"""The paged KV pool: one tensor holding K and V of every layer, split into blocks.

Layout (KVLayout): [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]. A block
is addressed by its id in every layer; a token's slot is block_id * block_size + offset.
The layout is explicit so that a block can later be exported, shipped or stored and
written back by another process that agrees on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.config import ModelConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: str) -> KVLayout:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * DTYPE_BYTES[self.dtype])

    def blocks_for_bytes(self, num_bytes: float) -> int:
        return int(num_bytes // self.bytes_per_block)


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.data = torch.zeros(
            layout.num_layers, 2, num_blocks * layout.block_size, layout.num_kv_heads,
            layout.head_dim, dtype=getattr(torch, layout.dtype), device=device)
        # Per layer, K and V side by side: [2, slots, kv_heads, head_dim].
        self.layers = [self.data[layer] for layer in range(layout.num_layers)]
