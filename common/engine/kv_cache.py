"""The paged KV pool: one tensor holding K and V of every layer, split into blocks, in
the layout KVLayout describes (common/engine/kv_layout.py, torch-free).
"""
from __future__ import annotations

import torch

from common.engine.kv_layout import DTYPE_BYTES, KVLayout

__all__ = ["DTYPE_BYTES", "KVCache", "KVLayout"]


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.data = torch.zeros(
            layout.num_layers, 2, num_blocks * layout.block_size, layout.num_kv_heads,
            layout.head_dim, dtype=getattr(torch, layout.dtype), device=device)
        # Per layer, K and V side by side: [2, slots, kv_heads, head_dim].
        self.layers = [self.data[layer] for layer in range(layout.num_layers)]
