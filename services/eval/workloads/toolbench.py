"""Tool use (ToolBench-like): each prompt is a tool's long instructions and API
documentation followed by a short user query; tools are Zipf-popular, so a few tool
prompts serve most requests."""
from __future__ import annotations

import numpy as np

from services.eval.workloads.base import Prompt, Synth, WorkloadRequest, to_requests

REQUESTS_PER_TOOL = 20  # sizes the default tool catalogue, so statistics hold at any sample size


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             zipf_a: float = 1.1, num_tools: int | None = None) -> list[WorkloadRequest]:
    """`num_requests` tool calls; tool k (from 1) is chosen with probability ∝ k^-zipf_a
    among `num_tools` (default: one per REQUESTS_PER_TOOL requests)."""
    if zipf_a < 0:
        raise ValueError(f"zipf_a must be >= 0, got {zipf_a}")
    tools = num_tools if num_tools is not None else max(1, round(num_requests / REQUESTS_PER_TOOL))
    if tools < 1:
        raise ValueError(f"num_tools must be >= 1, got {tools}")
    synth = Synth(seed, vocab_size, scale)
    tool_prompts = [synth.tokens(synth.length(1800, 500, 600, 4000)) for _ in range(tools)]
    popularity = np.arange(1, tools + 1, dtype=np.float64) ** -zipf_a
    choices = synth.rng.choice(tools, size=num_requests, p=popularity / popularity.sum())
    # Per request, a query's length then an output's, drawn in one call (the same values).
    lengths = synth.lengths([(100, 50, 10, 400), (38, 15, 4, 160)], num_requests)
    queries = synth.token_runs(lengths[:, 0])
    prompts = [Prompt((tool_prompts[tool], query), output, (tool,), len(tool_prompts[tool]))
               for tool, query, output in zip(choices.tolist(), queries, lengths[:, 1].tolist())]
    return to_requests(prompts, "toolbench")
