"""Sampling parameters of one request and their validation.

Kept free of torch so that light processes (tokenizer, router, client SDK) can build and
check them before a request ever reaches an engine.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20
# Counts and sizes are bounded so a request always fits one protocol message (1 MiB body)
# and costs little per token. OpenAI allows 4 stop strings; 16 of at most 1,024 characters
# leave room for real uses (chat markers, code fences) while every stop string is searched
# after every token and the longest one is held back from the stream: 16 x 1,024 is at
# most 64 KiB of UTF-8 on the wire and a bounded search.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_INT32 = 2**31 - 1  # max_tokens and top_k: far beyond any context window or vocabulary
MAX_TOKEN_ID = 2**32 - 1  # token ids travel as uint32
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes


class InvalidRequestError(ValueError):
    """A request parameter is out of range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 disables top-k. logprobs=None returns none;
    logprobs=n returns the sampled token's logprob and the n most likely alternatives.
    prompt_logprobs=n (None: none) returns, for each prompt token after the first, its
    logprob given the tokens before it and the n most likely tokens at its place (the
    first prompt token has none: None in its place). Such a request computes its whole
    prompt: it is not served from the prefix cache (docs/engine.md §2).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad parameter; stop token ids must be
        in the vocabulary when its size is given (else they must fit a uint32)."""
        _check_int("max_tokens", self.max_tokens, low=1, high=MAX_INT32)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise InvalidRequestError("temperature", "must be a number")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise InvalidRequestError("temperature", f"must be >= 0 and finite, got {self.temperature}")
        _check_int("top_k", self.top_k, low=0, high=MAX_INT32)
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        self._validate_stop_token_ids(vocab_size)
        self._validate_stop_strings()
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} are accepted, "
                                      f"got {len(self.stop_token_ids)}")
        high = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0, high=high)

    def _validate_stop_strings(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings are accepted, "
                                      f"got {len(self.stop)}")
        for stop_string in self.stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise InvalidRequestError("stop", "every stop string must be a non-empty string")
            if len(stop_string) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} "
                                          f"characters, got {len(stop_string)}")


def validate_prompt(prompt_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt must be non-empty, in the vocabulary, and leave room for one new token."""
    if len(prompt_ids) == 0:
        raise InvalidRequestError("prompt", "is empty")
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {len(prompt_ids)} tokens; the context window is {max_model_len} "
            "and must leave room for at least one generated token")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequestError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def _check_int(param: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(param, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(param, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(param, f"must be <= {high}, got {value}")
