"""Long-document QA (LooGLE-like): long documents, each asked several questions; a
prompt is the whole document followed by one question."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from services.eval.workloads.base import Prompt, Synth, WorkloadRequest, interleave, to_requests


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             questions_per_document: float = 18.0, concurrency: int = 16) -> list[WorkloadRequest]:
    """`num_requests` questions, on average `questions_per_document` (at least 2) per
    document, `concurrency` documents being asked about at once."""
    if questions_per_document < 2 or concurrency < 1:
        raise ValueError("questions_per_document must be >= 2 and concurrency >= 1")
    synth = Synth(seed, vocab_size, scale)
    documents = _documents(synth, questions_per_document)
    return to_requests(interleave(documents, num_requests, synth.rng, concurrency), "loogle")


def _documents(synth: Synth, questions: float) -> Iterator[list[Prompt]]:
    while True:
        document = synth.tokens(synth.length(22000, 6000, 8000, 40000))
        yield [Prompt(np.concatenate([document, synth.tokens(synth.length(40, 15, 8, 120))]),
                      synth.length(16, 10, 1, 64))
               for _ in range(synth.count(questions, 2))]
