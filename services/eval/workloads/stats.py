"""How long, shared and reused a workload's prompts are (the statistics Preble reports)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from common.hashing import chain_hashes, root_hash
from services.eval.workloads.base import WorkloadRequest


def workload_stats(requests: Sequence[WorkloadRequest], block_size: int = 16) -> dict:
    """Statistics of `requests`, taken in the order given (sort by arrival first if needed).

    Blocks are named as the prefix cache names them (common/hashing.chain_hashes over
    full `block_size`-token blocks, one chain root per tenant), so equal block hashes mean
    equal prefixes up to and including that block.

    - prompt_output_ratio: mean prompt tokens / mean output tokens.
    - shared_fraction: the fraction of all prompt tokens that lie in blocks an earlier
      request already had, i.e. what an unbounded prefix cache would not recompute.
    - reuse_count: the mean, over distinct shared blocks (those two or more requests
      have), of how many requests have the block; a shared sequence of n blocks counts n
      times, so this is the number of requests that reuse a shared token, on average.
    """
    if not requests:
        raise ValueError("workload_stats needs at least one request")
    roots: dict[str, int] = {}
    users: Counter[int] = Counter()
    shared_tokens = 0
    for request in requests:
        if request.tenant not in roots:
            roots[request.tenant] = root_hash("workload-stats", "", "", "", block_size, request.tenant)
        hashes = chain_hashes(roots[request.tenant], request.token_ids, block_size)
        shared_tokens += block_size * sum(1 for block in hashes if block in users)
        users.update(hashes)
    prompt_tokens = sum(request.num_tokens for request in requests)
    output_tokens = sum(request.output_tokens for request in requests)
    reuses = [count for count in users.values() if count >= 2]
    return {
        "num_requests": len(requests),
        "mean_prompt_tokens": prompt_tokens / len(requests),
        "mean_output_tokens": output_tokens / len(requests),
        "prompt_output_ratio": prompt_tokens / output_tokens if output_tokens else float("inf"),
        "shared_fraction": shared_tokens / prompt_tokens if prompt_tokens else 0.0,
        "reuse_count": sum(reuses) / len(reuses) if reuses else 0.0,
    }
