"""The one chained block hash that names KV state everywhere (docs/kv-identity.md §1).

root     = H(namespace, model_fp, tokenizer_fp, adapter_id, kv_dtype, block_size, tenant_salt)
block[0] = H(root, tokens[0:B])
block[i] = H(block[i-1], tokens[i*B:(i+1)*B])      # only full blocks are named

H is xxh3-64 over a canonical byte encoding: the parent as 8 little-endian bytes, then
the block's token ids as little-endian uint32. The engine's prefix cache, KV events, the
router's index, transfer handles and store keys all take their names from here.
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import msgpack
import numpy as np
import xxhash

HASH_NAMESPACE = "baton.kv.v1"


def root_hash(
    model_fingerprint: str,
    tokenizer_fingerprint: str,
    adapter_id: str,
    kv_dtype: str,
    block_size: int,
    tenant_salt: str = "",
) -> int:
    """The hash every chain starts from; two requests share blocks only if all of
    these agree."""
    fields = [HASH_NAMESPACE, model_fingerprint, tokenizer_fingerprint, adapter_id,
              kv_dtype, int(block_size), tenant_salt]
    return xxhash.xxh3_64_intdigest(msgpack.packb(fields))


def block_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """H(parent, tokens) for one full block."""
    payload = parent.to_bytes(8, "little") + np.asarray(block_tokens, dtype="<u4").tobytes()
    return xxhash.xxh3_64_intdigest(payload)


def token_id_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """The token ids as little-endian uint32, the encoding every block hash reads."""
    if isinstance(tokens, list) and sys.byteorder == "little" and array("I").itemsize == 4:
        return array("I", tokens).tobytes()  # from a list, about twice numpy's speed
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


def chain_hashes(parent: int, tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Hashes of every full block of `tokens`, chained from `parent`.

    A trailing partial block is not named. Pass the last hash of an earlier call as
    `parent` to extend a chain (tokens must then start on a block boundary).
    """
    token_bytes = token_id_bytes(tokens)
    # One C call cuts every full block's bytes; the loop only chains the hashes.
    blocks = np.frombuffer(token_bytes, dtype=f"V{4 * block_size}", count=len(token_bytes) // (4 * block_size))
    hashes: list[int] = []
    for block in blocks.tolist():
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + block)
        hashes.append(parent)
    return hashes
