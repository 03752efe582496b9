"""Picking the decode worker of a disaggregated request (docs/router.md §6).

The prefill is placed by the placement policy over the engines that prefill; the decode
worker is picked here, over the decode pool, by one cost in seconds: its decode load
(services/router/cluster.py) less the prefill time the part of the prompt it already
holds would save (those blocks are not pulled, and a failed pull recomputes less). Only
workers with room for the blocks the request would take are considered while any has it.
"""
from __future__ import annotations

from services.router.cluster import ClusterState, Request


def pick_decode_worker(request: Request, pool: ClusterState, now: float,
                       exclude: frozenset[str] = frozenset()) -> str | None:
    """The decode worker for `request` (matched against `pool`'s index), leaving out
    `exclude`; None if no worker is left."""
    workers = [w for w in pool.worker_ids if w not in exclude]
    if not workers:
        return None
    loads = pool.loads(now)

    def cost(worker_id: str) -> tuple[float, int, str]:
        saved_s = pool.chunked_prefill_s(request.cached_tokens(worker_id), 0)
        return loads[worker_id] - saved_s, -pool.free_blocks[worker_id], worker_id

    roomy = [w for w in workers if pool.free_blocks[w] >= request.blocks_needed(w)]
    return min(roomy or workers, key=cost)


def computes_locally(request: Request, decode_worker: str, max_local_prefill_tokens: int) -> bool:
    """Dynamo's conditional disaggregation: a prefill this short is left to the decode
    worker (nothing moves)."""
    return request.num_tokens - request.cached_tokens(decode_worker) <= max_local_prefill_tokens
