"""Block copies between the KV store's slots and an engine's plane-major pool, each block's
CRC32C taken on the way (docs/kvstore.md §4).

A slot row is one block's K and V for every layer, its planes back to back; the pool is
[planes, blocks, piece], so a block's planes lie a pool plane apart. Baton's C++ kernel
(kernels/csrc/kv_copy.cpp) copies and checksums in one pass; where it did not build,
numpy copies a few blocks at a time and checksums what landed while it is in the cache.
Either way the checksum is of the bytes that landed, not of a second read of the source,
so a slot rewritten during the copy shows as a mismatch.
"""
from __future__ import annotations

from collections.abc import Sequence

import google_crc32c
import numpy as np
import torch

NUMPY_CHUNK_BYTES = 1 << 20  # blocks per numpy step: about what one core's cache holds


class BlockCopier:
    """Copies for one block geometry; `native` picks the C++ kernel (load it first)."""

    def __init__(self, num_planes: int, block_bytes: int, native: bool):
        if block_bytes % num_planes:
            raise ValueError(f"a block of {block_bytes} bytes does not split into {num_planes} planes")
        self.num_planes = num_planes
        self.block_bytes = block_bytes
        self.native = native
        self._chunk_blocks = max(1, NUMPY_CHUNK_BYTES // block_bytes)

    def pool_view(self, pool: np.ndarray) -> np.ndarray:
        """The flat uint8 pool as [planes, blocks, piece]."""
        if pool.dtype != np.uint8 or pool.ndim != 1 or pool.size % self.block_bytes:
            raise ValueError(f"the engine pool must be flat uint8, a multiple of {self.block_bytes} bytes")
        return pool.reshape(self.num_planes, pool.size // self.block_bytes, self.block_bytes // self.num_planes)

    def slots_to_pool(self, rows: np.ndarray, slots: Sequence[int], pool3: np.ndarray,
                      blocks: Sequence[int]) -> list[int]:
        """rows[slots[i]] into pool block blocks[i]; the CRC32C of each block that landed."""
        if self.native:
            return torch.ops.baton.kv_slots_to_pool(torch.from_numpy(rows), _ids(slots), torch.from_numpy(pool3),
                                                    _ids(blocks)).tolist()
        checksums: list[int] = []
        for start in range(0, len(slots), self._chunk_blocks):
            some_slots = np.asarray(slots[start:start + self._chunk_blocks], dtype=np.int64)
            some_blocks = np.asarray(blocks[start:start + self._chunk_blocks], dtype=np.int64)
            pool3[:, some_blocks, :] = rows[some_slots].reshape(len(some_slots), self.num_planes, -1).transpose(1, 0, 2)
            checksums += self._numpy_checksums(pool3, some_blocks.tolist())
        return checksums

    def rows_to_slots(self, values: np.ndarray, rows: np.ndarray, slots: Sequence[int]) -> list[int]:
        """values[i] (contiguous block rows) into rows[slots[i]]; the CRC32C of each."""
        if self.native:
            source = np.ascontiguousarray(values)
            if not source.flags.writeable:  # torch maps only writable arrays
                source = source.copy()
            as_pool = torch.from_numpy(source).view(1, len(values), self.block_bytes)
            return torch.ops.baton.kv_pool_to_slots(as_pool, _ids(range(len(values))), torch.from_numpy(rows),
                                                    _ids(slots)).tolist()
        checksums = []
        for value, slot in zip(values, slots):
            rows[slot] = value
            checksums.append(google_crc32c.value(value))  # while the value is in the cache
        return checksums

    def pool_checksums(self, pool3: np.ndarray, blocks: Sequence[int]) -> list[int]:
        """The CRC32C of each pool block (its planes in order), nothing copied."""
        if self.native:
            return torch.ops.baton.kv_pool_checksums(torch.from_numpy(pool3), _ids(blocks)).tolist()
        return self._numpy_checksums(pool3, blocks)

    def _numpy_checksums(self, pool3: np.ndarray, blocks: Sequence[int]) -> list[int]:
        checksums = []
        for block in blocks:
            crc = 0
            for plane in range(self.num_planes):
                crc = google_crc32c.extend(crc, pool3[plane, block])
            checksums.append(crc)
        return checksums


def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64))
