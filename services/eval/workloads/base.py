"""What every workload generator emits, and the few helpers the generated shapes share.

Token ids are drawn uniformly from [FIRST_TOKEN_ID, vocab_size): ids 0..3 are the special
tokens of the embedded default model (<s>, </s>, <unk>, <pad>; common/engine/
default_model.py), whose "tiny" size has a vocabulary of 512 and "small" one of 32,000.
Random content means two blocks are equal only where the generator meant them to be.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

FIRST_TOKEN_ID = 4
MIN_VOCAB_SIZE = 64  # below this, random 16-token blocks start to collide by chance

Item = TypeVar("Item")


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float          # seconds from the start of the run
    # The uint32 prompt token ids: an array, or its parts in order as a generator shares
    # them (a tool's prompt, a conversation's earlier turns, a trace's blocks), read-only:
    # one copy of a shared part serves every request that holds it, so a run of a million
    # requests does not keep a million copies of its shared prompts. `token_ids` joins them.
    prompt: np.ndarray | tuple[np.ndarray, ...]
    output_tokens: int        # how many tokens to generate (max_tokens, ignore_eos)
    slo_class: str            # the class label (e.g. the shape name, or "interactive"/"batch")
    tenant: str = ""
    # Optional names of the prompt's leading `span_tokens`-token spans: span i's tokens are
    # a function of span_ids[i] alone (a Mooncake trace's hash_ids; a generated shape's
    # shared part, such as a tool's prompt, by its index), so a consumer may memoise
    # per-span work such as block hashes (services/eval/simulator.py _PromptHashes).
    span_ids: tuple[int, ...] = ()
    span_tokens: int = 0
    num_tokens: int = field(init=False, repr=False, compare=False)  # the prompt's length, made once

    def __post_init__(self) -> None:
        prompt = self.prompt
        length = len(prompt) if isinstance(prompt, np.ndarray) else sum(len(part) for part in prompt)
        object.__setattr__(self, "num_tokens", length)

    @property
    def token_ids(self) -> np.ndarray:
        """The prompt's token ids as one array: where it has several parts, joined anew on
        each read (so a caller that needs them twice keeps the array it read)."""
        prompt = self.prompt
        if isinstance(prompt, np.ndarray):
            return prompt
        return prompt[0] if len(prompt) == 1 else np.concatenate(prompt)


@dataclass(frozen=True)
class Prompt:
    """One generated request before it gets its id: its prompt (WorkloadRequest.prompt:
    an array or its shared parts), output length, and the name of its shared leading part
    where it has one (WorkloadRequest.span_ids)."""

    parts: np.ndarray | tuple[np.ndarray, ...]
    output_tokens: int
    span_ids: tuple[int, ...] = ()
    span_tokens: int = 0


class Synth:
    """Lengths and token ids for one generator run, from two streams seeded by `seed`:
    `rng` for the structure (lengths, counts, choices, order) and another for the tokens.

    Every length is drawn at full size and then multiplied by `scale` (at least 1 token);
    as the token stream is separate, a scaled run has the same structure as the full one,
    with shorter parts.
    """

    def __init__(self, seed: int, vocab_size: int, scale: float):
        structure, content = np.random.SeedSequence(seed).spawn(2)
        self.rng = np.random.default_rng(structure)
        self._content = np.random.default_rng(content)
        self.vocab_size = vocab_size
        self.scale = scale

    def length(self, mean: float, sd: float, low: int, high: int) -> int:
        """A normal draw clipped to [low, high], then scaled."""
        return self.scaled(min(max(round(self.rng.normal(mean, sd)), low), high))

    def lengths(self, draws: Sequence[Draw], count: int) -> np.ndarray:
        """`count` rows (shape count × len(draws)) of length(*draw) for each draw, the
        same values as calling length row by row, in one call: the generator draws a
        normal element by element, and numpy rounds half to even as round() does."""
        means, sds, lows, highs = (np.array([draw[field] for draw in draws], dtype=np.float64) for field in range(4))
        values = self.rng.normal(np.tile(means, count), np.tile(sds, count)).reshape(count, len(draws))
        clipped = np.minimum(np.maximum(np.rint(values), lows), highs)
        return np.maximum(1.0, np.rint(clipped * self.scale)).astype(np.int64)

    def scaled(self, length: int) -> int:
        return max(1, round(length * self.scale))

    def count(self, mean: float, low: int) -> int:
        """A group size: `low` plus a Poisson draw, so its mean is `mean`. Not scaled."""
        return low + int(self.rng.poisson(max(mean - low, 0.0)))

    def tokens(self, length: int) -> np.ndarray:
        """`length` random token ids, read-only: prompts share them (WorkloadRequest.prompt)."""
        tokens = self._content.integers(FIRST_TOKEN_ID, self.vocab_size, length, dtype=np.uint32)
        tokens.flags.writeable = False
        return tokens

    def token_runs(self, lengths: np.ndarray) -> list[np.ndarray]:
        """tokens(length) for each length in turn, in one draw: the generator draws 32-bit
        values one after another, carrying the spare half of a 64-bit draw across calls,
        so the runs are the ones separate calls give."""
        return np.split(self.tokens(int(lengths.sum())), np.cumsum(lengths)[:-1])


Draw = tuple[float, float, int, int]  # Synth.length's (mean, sd, low, high)


def shared_context_questions(synth: Synth, questions: float, context: Draw, question: Draw,
                             answer: Draw) -> Iterator[list[Prompt]]:
    """Endless groups: one shared context, then about `questions` (at least 2) prompts of
    that context followed by a question of their own, each with its answer length."""
    for group in itertools.count():
        shared = synth.tokens(synth.length(*context))
        yield [Prompt((shared, synth.tokens(synth.length(*question))), synth.length(*answer), (group,), len(shared))
               for _ in range(synth.count(questions, 2))]


def interleave(groups: Iterator[list[Item]], num_items: int, rng: np.random.Generator,
               concurrency: int) -> list[Item]:
    """`num_items` items of `groups` (each an ordered list, e.g. a conversation's turns) as
    `concurrency` groups in progress at once would send them: each step takes the next
    item of a random group in progress, and a finished group is replaced by the next.
    Each group's own order is kept. Only the last group opened is cut short, so the
    sample's groups keep their sizes (and its sharing statistics) at any num_items."""
    active: list[Iterator[Item]] = []
    opened = 0
    items: list[Item] = []
    while len(items) < num_items:
        while len(active) < concurrency and opened < num_items:
            group = next(groups)[:num_items - opened]
            opened += len(group)
            active.append(iter(group))
        position = int(rng.integers(len(active)))
        item = next(active[position], None)
        if item is None:
            active.pop(position)
        else:
            items.append(item)
    return items


def to_requests(prompts: list[Prompt], shape: str) -> list[WorkloadRequest]:
    """Requests named `<shape>-<index>`, class `shape`, all arriving at 0.0 (arrivals are
    assigned separately; services/eval/workloads/arrivals.py)."""
    return [WorkloadRequest(f"{shape}-{index}", 0.0, prompt.parts, prompt.output_tokens, shape,
                            span_ids=prompt.span_ids, span_tokens=prompt.span_tokens)
            for index, prompt in enumerate(prompts)]
