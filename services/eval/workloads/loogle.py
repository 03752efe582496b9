"""Long-document QA (LooGLE-like): long documents, each asked several questions; a
prompt is the whole document followed by one question."""
from __future__ import annotations

from services.eval.workloads.base import Synth, WorkloadRequest, interleave, shared_context_questions, to_requests


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             questions_per_document: float = 18.0, concurrency: int = 16) -> list[WorkloadRequest]:
    """`num_requests` questions, on average `questions_per_document` (at least 2) per
    document, `concurrency` documents being asked about at once."""
    if questions_per_document < 2 or concurrency < 1:
        raise ValueError("questions_per_document must be >= 2 and concurrency >= 1")
    synth = Synth(seed, vocab_size, scale)
    documents = shared_context_questions(synth, questions_per_document, context=(22000, 6000, 8000, 40000),
                                         question=(40, 15, 8, 120), answer=(16, 10, 1, 64))
    return to_requests(interleave(documents, num_requests, synth.rng, concurrency), "loogle")
