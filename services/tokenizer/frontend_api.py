"""What the HTTP gateway needs from the tokenizer role, as an interface.

The tokenizer service implements it over ZeroMQ (router, workers); the gateway only
translates HTTP/OpenAI shapes to these calls and back.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from common.sampling_params import SamplingParams
from services.tokenizer.text_prompts import PromptByteLimit


@dataclass
class StreamEvent:
    """A request's progress: new tokens and the text they completed (a delta). With
    SamplingParams.prompt_logprobs, events with no token come first, carrying the prompt
    logprob records of the next prompt tokens, in order (None for token 0), until every
    prompt token has one; then come the tokens."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    # On the finished event only: a disaggregated request's TTFT split as its workers
    # measured it (queue_s, prefill_s, decode_wait_s, transfer_s; checked and merged).
    timings: dict[str, float] = field(default_factory=dict)


class FrontendApi(Protocol):
    model_name: str
    max_model_len: int
    prompt_byte_limit: PromptByteLimit  # a longer text prompt is refused before tokenize()

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a prompt text (with the tokenizer's special tokens). Called from a
        TokenizePool thread for long texts: it must be thread-safe, and should release
        the GIL for a long text."""

    def decode(self, token_ids: list[int]) -> str: ...

    def tenant_for(self, api_key: str | None) -> str:
        """The tenant an API key maps to; raises common.errors.Unauthorized for a bad key
        (or a missing one when keys are configured)."""

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 tenant: str, *, slo_class: str = "") -> AsyncIterator[StreamEvent]:
        """Stream the request's events; the last has finished=True. Raises a
        common.errors.BatonError subclass on failure (InvalidRequest, Rejected, ...;
        InvalidRequest for a `slo_class` that names no configured class; "" = the
        tenant's class or the default). Closing the iterator early aborts the request."""

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> dict:
        """{"ok": bool, ...details}; ok is False when no worker can serve."""

    def metrics_text(self) -> str:
        """Prometheus text exposition of this role's metrics."""
