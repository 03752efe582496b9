"""What the simulator needs to model prefill/decode disaggregation: the links KV moves
over, their contention, the bytes a transfer moves, and the choice of a decode worker.

Transfer time = link latency + bytes / link bandwidth, bytes = the blocks the decode
worker does not hold × KVLayout.bytes_per_block. Contention: every worker has one link
in each direction; a transfer holds its sender's outgoing and its receiver's incoming
link for its whole duration, and starts when both are free (FIFO in the order transfers
are asked for). A link thus carries one transfer at a time at full bandwidth, which moves
the same bytes per second as sharing it fairly between concurrent transfers; the
difference is that transfers finish one after another rather than all late together.
Bandwidths are line rates, taken as achieved: an optimistic bound on a real transfer.

`rank_decode_workers` is a pure function so the live router can share it later.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

from common.engine.kv_layout import KVLayout
from common.profiles import MODELS, ModelShape

DEFAULT_LINK = "rdma-400g"
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 1000  # Dynamo's conditional disaggregation threshold (docs/evaluation.md §3.1)


@dataclass(frozen=True)
class Link:
    """One worker's link in one direction: bytes per second and a fixed cost per transfer
    (the pull's request and its completion, not the bytes)."""

    name: str
    bandwidth_bytes_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0 or self.latency_s < 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0 and latency >= 0")

    def seconds(self, num_bytes: float) -> float:
        """Time one transfer of `num_bytes` takes with the link to itself."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_s


GB = 1e9
# Per-direction line rates from the datasheets / standards; latencies are typical
# one-transfer costs (a small control round trip), which only matter for small pulls.
LINKS = MappingProxyType({
    # NVLink 4 on H100/H200 SXM: 900 GB/s both ways per GPU (NVIDIA H100 datasheet).
    "nvlink": Link("nvlink", 450 * GB, 5e-6),
    # NVLink 3 on A100 SXM: 600 GB/s both ways (NVIDIA A100 datasheet).
    "nvlink3": Link("nvlink3", 300 * GB, 5e-6),
    # PCIe 5.0 / 4.0 x16: 64 / 32 GB/s per direction on paper (~63 / ~31.5 after encoding).
    "pcie5": Link("pcie5", 63 * GB, 10e-6),
    "pcie4": Link("pcie4", 31.5 * GB, 10e-6),
    # InfiniBand NDR / HDR / EDR or RoCE NICs (ConnectX-7/6): 400 / 200 / 100 Gb/s; RDMA
    # verbs take a few µs; Mooncake's nodes carry 8 × 400 Gb/s, one NIC per GPU.
    "rdma-400g": Link("rdma-400g", 400 / 8 * GB, 10e-6),
    "rdma-200g": Link("rdma-200g", 200 / 8 * GB, 10e-6),
    "rdma-100g": Link("rdma-100g", 100 / 8 * GB, 10e-6),
    # Kernel TCP over 100 / 25 / 10 GbE: tens of µs of stack and round trip per message.
    "tcp-100g": Link("tcp-100g", 100 / 8 * GB, 50e-6),
    "tcp-25g": Link("tcp-25g", 25 / 8 * GB, 50e-6),
    "tcp-10g": Link("tcp-10g", 10 / 8 * GB, 50e-6),
})


def link_named(name: str) -> Link:
    """The link of that name; ValueError listing the known ones otherwise."""
    link = LINKS.get(name.strip().lower())
    if link is None:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}")
    return link


def model_layout(model: ModelShape, block_size: int) -> KVLayout:
    """The bf16 KV layout of an analytic model shape (common/profiles.py)."""
    return KVLayout(model.layers, model.kv_heads, model.hidden // model.heads, block_size, "bfloat16")


def layout_for_model(model_key: str, block_size: int) -> KVLayout:
    return model_layout(MODELS[model_key], block_size)


def blocks_to_move(prompt_tokens: int, held_blocks: int, block_size: int) -> int:
    """Blocks of a prompt's KV the decode worker lacks: every block the prompt fills or
    starts (the last may be partial) beyond the `held_blocks` leading ones it holds."""
    return max(0, -(-prompt_tokens // block_size) - held_blocks)


class LinkQueues:
    """When each worker's outgoing and incoming link is next free (module docstring)."""

    def __init__(self, link: Link):
        self.link = link
        self.free_at: dict[tuple[str, str], float] = {}

    def reserve(self, now: float, sender: str, receiver: str, num_bytes: float) -> tuple[float, float]:
        """(start, end) of a transfer of `num_bytes` asked for at `now`; holds both links
        until `end`."""
        out_key, in_key = (sender, "out"), (receiver, "in")
        start = max(now, self.free_at.get(out_key, 0.0), self.free_at.get(in_key, 0.0))
        end = start + self.link.seconds(num_bytes)
        self.free_at[out_key] = self.free_at[in_key] = end
        return start, end


@dataclass(frozen=True)
class DecodeCandidate:
    """What the router knows of one decode worker for one request."""

    worker_id: str
    decode_load_s: float  # seconds of decode work in flight there (docs/router.md §3)
    room_blocks: int  # KV blocks it could still allocate (free or evictable cache)
    held_blocks: int  # leading prompt blocks it already holds


def rank_decode_workers(candidates: Iterable[DecodeCandidate], prompt_tokens: int, block_size: int,
                        seconds_per_block: float) -> list[str]:
    """Decode workers for a request, best first.

    Workers with room for the blocks they would receive (plus one for the first output
    tokens) come first. Among them the cost is decode load + the time to pull what the
    worker lacks (blocks_to_move × seconds_per_block), so a worker that holds part of
    the prompt is preferred by exactly what it saves; ties go to more room, then the id.
    Workers without room follow, most room first."""
    def key(candidate: DecodeCandidate) -> tuple:
        moving = blocks_to_move(prompt_tokens, candidate.held_blocks, block_size)
        fits = candidate.room_blocks >= moving + 1
        cost = candidate.decode_load_s + moving * seconds_per_block
        return (not fits, cost if fits else -candidate.room_blocks, -candidate.room_blocks, candidate.worker_id)

    return [candidate.worker_id for candidate in sorted(candidates, key=key)]
