"""KV leases: a finished prefill's blocks, held for the decode worker that will pull them.

A prefill worker computes a prompt, samples its first token, and then keeps the prompt's
blocks referenced under a lease instead of releasing them (docs/architecture.md §7). The
decode worker pulls the blocks, and the lease is released. How long a lease may wait is
not kept here: the prefill role exposes the blocks on its KV transport for
`kv_lease_ttl_s`, and that exposure's end releases the lease (services/prefill), so
there is one clock, the one that knows whether a send still reads the blocks.

This module is bookkeeping only: it never touches the block manager. The engine takes
the blocks a lease returns and releases them there. Lease ids are 128 random bits, so a
handle cannot be guessed, and every call names the request too: a stale or forged handle
frees nothing that belongs to another request.
"""
from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass


class LeaseError(ValueError):
    """A lease call names no live lease of that request (forged, stale, or released)."""


@dataclass(frozen=True)
class KvLease:
    """What a decode worker needs to pull a request's prompt KV.

    `block_ids[i]` holds the prompt's tokens [i * block_size, (i + 1) * block_size);
    `block_hashes` names the full blocks (the last block may be partial and unnamed);
    `num_tokens` is the prompt length whose KV the blocks hold.

    A part (`part`; docs/disaggregation.md §2.1) holds prompt blocks [first_block,
    first_block + len(block_ids)) of a prompt still being prefilled, all full, beside the
    request's own reference; it has no first token yet (-1)."""

    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    num_tokens: int
    first_token_id: int
    part: bool = False
    first_block: int = 0


class KvLeases:
    """The live leases of one engine, by lease id: the engine's sink
    (common/engine/kv_connector.py) for the prompts of requests that hold their KV."""

    name = "lease"

    def __init__(self) -> None:
        self._held: dict[str, KvLease] = {}

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Blocks held under leases (the leased-blocks gauge)."""
        return sum(len(lease.block_ids) for lease in self._held.values())

    def evicted(self, blocks: Seq[object]) -> None:
        """A leased block is referenced, so never evicted: nothing to do."""

    def held(self, request_id: str, block_ids: Seq[int], block_hashes: Seq[int], num_tokens: int,
             last_token_id: int) -> KvLease:
        """Grant a lease on a finished prompt's blocks (the engine keeps their reference)."""
        lease = KvLease(os.urandom(16).hex(), request_id, tuple(block_ids), tuple(block_hashes),
                        num_tokens, last_token_id)
        self._held[lease.lease_id] = lease
        return lease

    def part(self, request_id: str, first_block: int, block_ids: Seq[int], block_hashes: Seq[int],
             num_tokens: int) -> KvLease:
        """Grant a lease on a part of a prompt still being prefilled (the caller took a
        reference to each block for it)."""
        lease = KvLease(os.urandom(16).hex(), request_id, tuple(block_ids), tuple(block_hashes), num_tokens, -1,
                        part=True, first_block=first_block)
        self._held[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str, request_id: str) -> KvLease:
        lease = self._held.get(lease_id)
        if lease is None or lease.request_id != request_id:
            raise LeaseError(f"no live KV lease {lease_id[:8]}… for request {request_id!r} "
                             "(it was released, or never existed)")
        return lease

    def release(self, lease_id: str, request_id: str) -> tuple[int, ...]:
        """End a lease; returns its blocks for the caller to release."""
        self.get(lease_id, request_id)
        return self._held.pop(lease_id).block_ids

    def block_tables(self) -> list[tuple[int, ...]]:
        """Each lease's blocks, for the block manager's integrity check (a lease holds
        one reference to each)."""
        return [lease.block_ids for lease in self._held.values()]
