"""Embodied agent (ALFWorld-like): an episode starts from its task type's few-shot
examples and the task's description; every turn appends the agent's last action and the
new observation, so each turn's prompt extends the previous one, and asks for the next
(short) action."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from services.eval.workloads.base import Prompt, Synth, WorkloadRequest, interleave, to_requests


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             num_task_types: int = 6, concurrency: int = 16) -> list[WorkloadRequest]:
    """`num_requests` agent turns from episodes of 10-40 turns, `concurrency` episodes
    in progress at once; `num_task_types` few-shot prefixes (ALFWorld has six task types)."""
    if num_task_types < 1 or concurrency < 1:
        raise ValueError("num_task_types and concurrency must be >= 1")
    synth = Synth(seed, vocab_size, scale)
    few_shots = [synth.tokens(synth.length(1200, 200, 700, 1800)) for _ in range(num_task_types)]
    prompts = interleave(_episodes(synth, few_shots), num_requests, synth.rng, concurrency)
    return to_requests(prompts, "agent")


def _episodes(synth: Synth, few_shots: list[np.ndarray]) -> Iterator[list[Prompt]]:
    while True:
        task_type = int(synth.rng.integers(len(few_shots)))
        context = [few_shots[task_type], synth.tokens(synth.length(150, 50, 30, 400))]
        turns = []
        for _ in range(int(synth.rng.integers(10, 41))):
            context.append(synth.tokens(synth.length(60, 25, 10, 200)))  # the observation
            action = synth.length(16, 8, 2, 64)
            turns.append(Prompt(tuple(context), action))
            context.append(synth.tokens(action))  # the action, as the agent would have said it
        yield turns
