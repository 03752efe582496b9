"""Workloads (docs/evaluation.md §5): seeded generators of token-id requests, one per workload shape.

Preble's five prompt-heavy shapes, a chat shape and Mooncake trace replay, by name:

  toolbench    tool use: Zipf-popular tool prompts (zipf_a, default 1.1) + a short query
  agent        embodied agent: episodes whose turns each extend the previous prompt
  programming  program generation: one shared few-shot prefix + a problem, sampled 4×
  videoqa      video QA: long per-video contexts, ~11 questions each, tiny answers
  loogle       long-document QA: ~22k-token documents, ~18 questions each
  chat         multi-turn conversations behind one shared system prompt
  mooncake     replay of a Mooncake-format trace file (trace=<path>), its own arrivals

The seed's ranges for Preble's workloads: prompts 37–2,494× the outputs, 85–97 % of
prompt tokens shared, each shared sequence reused by 8.6–126 requests. Measured with
workload_stats (16-token blocks; stats.py defines each figure), 1,000 requests, seed 0,
scale 1; the mooncake row is the whole 3,993-request shared/data trace:

  shape        prompt/output  shared  reuse  mean prompt  mean output  in the ranges
  toolbench          57×       91 %    23       2,150          38        yes
  agent             153×       96 %    29       2,497          16        yes
  programming        45×       95 %    21       3,674          82        yes
  videoqa         1,966×       90 %    11       7,888           4.0      yes
  loogle          1,438×       95 %    20      23,098          16        yes
  chat                6×       80 %     6       1,431         251        no (ratio, reuse)
  mooncake          103×       65 %     5      15,325         149        no (a trace)

Over seeds 0-9 at 200-400 requests the five Preble shapes stay inside all three ranges
(tests/services/eval/test_workloads.py checks one seed each). chat is not one of
Preble's shapes and is outside by design: its replies are long, so prompts are only ~6×
its outputs, and a conversation's turns share its context with few requests.
Pool sizes (tools, problems, videos, documents, episodes) grow with num_requests, so the
figures hold at other sample sizes; agent's few-shot prefixes are a fixed six (ALFWorld's
task types), so its reuse grows slowly with the sample (26 at 300 requests, 31 at 3,000).

Generated shapes arrive at 0.0: give them times with arrivals.py (poisson, bursty, trace).
Token ids lie in [4, vocab_size) (base.py); the embedded tiny model's vocabulary is 512,
its context 4,096 tokens, so a live run on it uses e.g. vocab_size=512, scale=0.05 (the
longest generated request is then ~1,700 tokens, loogle's). The Mooncake trace's longest
prompt is ~194k tokens: at scale 0.02 every request fits in 3,739 tokens.
"""
from __future__ import annotations

from collections.abc import Callable

from services.eval.workloads import agent, chat, loogle, mooncake, programming, toolbench, videoqa
from services.eval.workloads.base import MIN_VOCAB_SIZE, WorkloadRequest
from services.eval.workloads.stats import workload_stats

WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "toolbench": toolbench.generate,
    "agent": agent.generate,
    "programming": programming.generate,
    "videoqa": videoqa.generate,
    "loogle": loogle.generate,
    "chat": chat.generate,
    "mooncake": mooncake.generate,
}

__all__ = ["WORKLOADS", "WorkloadRequest", "make_workload", "workload_stats"]


def make_workload(name: str, num_requests: int, seed: int = 0, *, vocab_size: int = 32000,
                  scale: float = 1.0, trace: str | None = None, **options) -> list[WorkloadRequest]:
    """`num_requests` requests of the named shape (class label = the name), reproducible
    for a seed. `scale` multiplies every length (prompt parts and outputs, at least 1
    token). `trace` is the trace file mooncake replays (and only mooncake takes it);
    `options` are the shape's own keywords (e.g. zipf_a for toolbench)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if trace is not None:
        options["trace"] = trace
    return WORKLOADS[name](num_requests, seed, vocab_size=vocab_size, scale=scale, **options)
