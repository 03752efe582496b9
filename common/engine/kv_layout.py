"""The paged KV pool's layout, without torch: the simulator and the planner size KV
transfers with it, and they must not import torch (common/engine/kv_cache.py holds the
pool itself).

Layout: [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]. A block is addressed
by its id in every layer; a token's slot is block_id * block_size + offset. The layout is
explicit so that a block can later be exported, shipped or stored and written back by
another process that agrees on it.
"""
from __future__ import annotations

from dataclasses import dataclass

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
