"""The engine-side state of one request."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.hashing import chain_hashes
from common.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's types; this module stays importable without torch
    import torch

    from common.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"  # its prompt's KV is arriving from elsewhere (Engine.begin_load)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's tokens, KV blocks and progress. Equal only to itself: two requests with
    the same fields are still two (and the scheduler's list removals compare identities,
    not every field).

    `token_ids` holds the prompt followed by every generated token; the first
    `num_computed` of them have KV in `block_ids`. `block_hashes[i]` names block i once
    all of its tokens are known (docs/kv-identity.md §1); it is extended as tokens arrive.
    """

    request_id: str
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    root_hash: int
    block_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_text: str | None = None  # the stop string that ended it, if one did
    logprobs: list[dict] = field(default_factory=list)
    # With params.prompt_logprobs: the records of prompt tokens 0, 1, ... computed so far
    # (None for token 0), as prefill chunks compute them (docs/engine.md §2).
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    generator: torch.Generator | None = None  # when params.seed is set
    detokenizer: IncrementalDetokenizer | None = None  # when stop strings are watched
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    hold_kv: bool = False  # on finishing, keep the prompt's blocks under a lease (prefill role)
    pending_token_id: int | None = None  # an import's first token, sampled by the prefill engine
    load_through_end: bool = False  # loading its whole prompt, computed elsewhere (it then decodes)
    loading: bool = False  # RECEIVING KV from elsewhere (Engine.begin_load)
    abort_on_loaded: bool = False  # aborted while loading: ends when the load completes

    def __post_init__(self) -> None:
        self.extend_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def next_prompt_logprob_row(self) -> int | None:
        """The first position whose logits still score a prompt token (position p scores
        token p + 1), or None when the request wants no prompt logprobs or has them all.
        Prefix-cache hits must not reach past it: a cached token's logits are never computed."""
        if self.params.prompt_logprobs is None:
            return None
        row = max(len(self.prompt_logprobs) - 1, 0)
        return row if row < self.prompt_len - 1 else None

    def extend_hashes(self) -> None:
        """Name every block whose tokens are all known and not yet named."""
        named_tokens = len(self.block_hashes) * self.block_size
        if self.num_tokens - named_tokens < self.block_size:
            return
        parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
        self.block_hashes.extend(
            chain_hashes(parent, self.token_ids[named_tokens:], self.block_size))

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self.extend_hashes()

    def check_stop(self, token_id: int) -> str | None:
        """The finish reason the newest token causes, from ids and lengths alone."""
        params = self.params
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None
