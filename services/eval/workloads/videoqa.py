"""Video QA (NExT-QA-like): a long per-video context (the video's frame tokens) shared by
several questions about that video, each with a very short answer."""
from __future__ import annotations

from services.eval.workloads.base import Synth, WorkloadRequest, interleave, shared_context_questions, to_requests


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             questions_per_video: float = 11.0, concurrency: int = 16) -> list[WorkloadRequest]:
    """`num_requests` questions, on average `questions_per_video` (at least 2) per video,
    `concurrency` videos being asked about at once."""
    if questions_per_video < 2 or concurrency < 1:
        raise ValueError("questions_per_video must be >= 2 and concurrency >= 1")
    synth = Synth(seed, vocab_size, scale)
    videos = shared_context_questions(synth, questions_per_video, context=(7500, 3500, 2000, 24000),
                                      question=(60, 20, 10, 200), answer=(4, 1.5, 1, 10))
    return to_requests(interleave(videos, num_requests, synth.rng, concurrency), "videoqa")
