"""Program generation (APPS-like): every prompt is the same few-shot prefix (instructions
and solved examples) followed by a problem statement; each problem is sampled several
times (pass@k style), so whole prompts repeat too."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from services.eval.workloads.base import Prompt, Synth, WorkloadRequest, interleave, to_requests


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             samples_per_problem: int = 4, concurrency: int = 16) -> list[WorkloadRequest]:
    """`num_requests` completions, `samples_per_problem` per problem (each its own output
    length), `concurrency` problems in progress at once."""
    if samples_per_problem < 1 or concurrency < 1:
        raise ValueError("samples_per_problem and concurrency must be >= 1")
    synth = Synth(seed, vocab_size, scale)
    few_shot = synth.tokens(synth.scaled(3000))
    problems = _problems(synth, few_shot, samples_per_problem)
    return to_requests(interleave(problems, num_requests, synth.rng, concurrency), "programming")


def _problems(synth: Synth, few_shot: np.ndarray, samples: int) -> Iterator[list[Prompt]]:
    while True:
        prompt = (few_shot, synth.tokens(synth.length(700, 300, 100, 2000)))
        yield [Prompt(prompt, synth.length(80, 50, 10, 512), (0,), len(few_shot)) for _ in range(samples)]
