"""Chat: multi-turn conversations behind one shared system prompt; each turn's prompt is
the whole conversation so far plus the new user message, and replies are long."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from services.eval.workloads.base import Prompt, Synth, WorkloadRequest, interleave, to_requests


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             concurrency: int = 16) -> list[WorkloadRequest]:
    """`num_requests` turns of conversations of 1-10 turns, `concurrency` at once."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    synth = Synth(seed, vocab_size, scale)
    system_prompt = synth.tokens(synth.scaled(400))
    conversations = _conversations(synth, system_prompt)
    return to_requests(interleave(conversations, num_requests, synth.rng, concurrency), "chat")


def _conversations(synth: Synth, system_prompt: np.ndarray) -> Iterator[list[Prompt]]:
    while True:
        context = [system_prompt]
        turns = []
        for _ in range(int(synth.rng.integers(1, 11))):
            context.append(synth.tokens(synth.length(80, 50, 5, 400)))  # the user's message
            reply = synth.length(250, 120, 10, 1024)
            turns.append(Prompt(tuple(context), reply))
            context.append(synth.tokens(reply))  # the assistant's reply, as it would have been
        yield turns
