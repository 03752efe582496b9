"""What a KV transfer moves, computed the same way on both sides.

The engine's pool (common/engine/kv_cache.py) is one tensor shaped
[layers, 2 (K, V), blocks·block_size, kv_heads, head_dim]. So a block is not one run of
bytes: it is one run of `plane_block_bytes` in each of the 2·layers planes (K or V of one
layer). Consecutive block ids are consecutive within a plane, so a run of n consecutive
source ids that lands on n consecutive destination ids is one run of n·plane_block_bytes
per plane, and that is the only coalescing the layout allows (runs of different planes
are 2·layers·…·blocks apart). The plan cuts each such run into pieces of at most
`max_piece_bytes`; a piece is one UCX message, or one frame of a ZeroMQ message.

The KV store's DRAM pool is block-major instead (a block's planes side by side, one slot
after another; services/kvstore): there a block's plane is its own run, so a plan with a
block-major side moves one piece per plane per block.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import xxhash

from common.engine.kv_layout import KVLayout
from common.protocol import PROTOCOL_VERSION, KvCompat

COMPAT_NAMESPACE = "baton.kv-transfer.v1"
MAX_PIECES = 1 << 24  # the UCX tag keeps 24 bits for the piece index


class PlanError(ValueError):
    """Block ids that cannot be transferred (out of range, repeated, lengths differ)."""


@dataclass(frozen=True)
class PoolGeometry:
    """The byte layout of one process's pool: the engine's KV layout and how many blocks
    the pool has; what plans are made from."""

    layout: KVLayout
    num_blocks: int
    block_major: bool = False  # the KV store's pool: [blocks, planes, plane bytes]

    @property
    def num_planes(self) -> int:
        return 2 * self.layout.num_layers

    @property
    def plane_block_bytes(self) -> int:
        return self.layout.bytes_per_block // self.num_planes

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def offset(self, plane: int, block: int) -> int:
        """Byte offset of `block` in `plane` of the flat pool."""
        if self.block_major:
            return (block * self.num_planes + plane) * self.plane_block_bytes
        return (plane * self.num_blocks + block) * self.plane_block_bytes


@dataclass(frozen=True)
class Piece:
    """`length` bytes at src_offset in the source pool go to dst_offset in the destination's."""

    src_offset: int
    dst_offset: int
    length: int


def compat_of(geometry: PoolGeometry, model_fingerprint: str) -> KvCompat:
    layout = geometry.layout
    return KvCompat(model_fingerprint=model_fingerprint, kv_dtype=layout.dtype, num_layers=layout.num_layers,
                    num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, block_size=layout.block_size)


def compat_hash(compat: KvCompat, protocol_version: int = PROTOCOL_VERSION) -> str:
    """xxh3-64 (hex) over the namespace, the protocol version and every field, in order:
    stable across processes and hosts (never Python's hash())."""
    fields = [COMPAT_NAMESPACE, protocol_version, *msgspec.structs.astuple(compat)]
    return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(fields))


def first_mismatch(ours: KvCompat, theirs: KvCompat, our_version: int, their_version: int) -> str | None:
    """The first differing field as 'name: ours here, theirs there', or None."""
    if our_version != their_version:
        return f"protocol_version: {our_version} here, {their_version} there"
    for name in ours.__struct_fields__:
        mine, other = getattr(ours, name), getattr(theirs, name)
        if mine != other:
            return f"{name}: {mine!r} here, {other!r} there"
    return None


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    """PlanError unless every id is an int in [0, num_blocks) and none repeats."""
    if len(set(block_ids)) != len(block_ids):
        raise PlanError(f"{what} block ids repeat")
    for block in block_ids:
        if type(block) is not int or not 0 <= block < num_blocks:
            raise PlanError(f"{what} block id {block!r} is outside the pool of {num_blocks} blocks")


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) of maximal runs where both id lists step by one."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids):
        if runs:
            src0, dst0, count = runs[-1]
            if src == src0 + count and dst == dst0 + count:
                runs[-1] = (src0, dst0, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def plan_pieces(src: PoolGeometry, dst: PoolGeometry, src_ids: Sequence[int], dst_ids: Sequence[int],
                max_piece_bytes: int) -> list[Piece]:
    """The pieces that move `src_ids` of the source pool into `dst_ids` of the destination
    pool, plane by plane (layer 0's K first), each at most max_piece_bytes."""
    if len(src_ids) != len(dst_ids):
        raise PlanError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    if src.plane_block_bytes != dst.plane_block_bytes or src.num_planes != dst.num_planes:
        raise PlanError("source and destination pools have different block layouts")
    check_block_ids(src_ids, src.num_blocks, "source")
    check_block_ids(dst_ids, dst.num_blocks, "destination")
    if max_piece_bytes <= 0:
        raise PlanError("max_piece_bytes must be positive")
    runs = ([(src_id, dst_id, 1) for src_id, dst_id in zip(src_ids, dst_ids)] if src.block_major or dst.block_major
            else paired_runs(src_ids, dst_ids))
    pieces: list[Piece] = []
    for plane in range(src.num_planes):
        for src_start, dst_start, count in runs:
            pieces.extend(_cut(src.offset(plane, src_start), dst.offset(plane, dst_start),
                               count * src.plane_block_bytes, max_piece_bytes))
    if len(pieces) > MAX_PIECES:
        raise PlanError(f"{len(pieces)} pieces, over the {MAX_PIECES} limit of one transfer")
    return pieces


def _cut(src_offset: int, dst_offset: int, length: int, max_piece_bytes: int) -> Iterable[Piece]:
    for start in range(0, length, max_piece_bytes):
        yield Piece(src_offset + start, dst_offset + start, min(max_piece_bytes, length - start))


def group_pieces(pieces: Sequence[Piece], target_bytes: int, max_frames: int) -> list[tuple[int, int]]:
    """(first, end) index ranges of consecutive pieces, each group closed as soon as it
    holds target_bytes or max_frames pieces: how pieces are packed into ZeroMQ messages."""
    groups, first, size = [], 0, 0
    for index, piece in enumerate(pieces):
        size += piece.length
        if size >= target_bytes or index + 1 - first >= max_frames:
            groups.append((first, index + 1))
            first, size = index + 1, 0
    if first < len(pieces):
        groups.append((first, len(pieces)))
    return groups
