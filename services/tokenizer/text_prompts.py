"""Text prompts: a byte bound checked before tokenizing, and a bounded pool that tokenizes
(and renders chat templates) off the event loop.

Tokenizing costs about a microsecond per byte, so a multi-megabyte prompt would hold the
event loop (every client, /health included) for seconds, only to be refused for its
length. Two guards, shared by the HTTP gateway and the SDK socket:

- `prompt_byte_limit`: the most UTF-8 bytes a text prompt may have. For a byte-level BPE
  tokenizer each token covers at most as many bytes as its longest vocabulary entry (L),
  so a text longer than L × (max_model_len - 1) bytes needs max_model_len tokens or more
  and is refused without tokenizing. That holds only when the tokenizer drops no input:
  no normalizer but the Unicode normal forms (which shrink a text at most 4×: a code
  point is at most 4 bytes and becomes at least one), pre-tokenizers that keep every
  byte, and no fused unknown token. For any other tokenizer the bound is left to the
  configured `max_prompt_bytes` (0: none but the transport's own body limit).
- `TokenizePool`: a few threads for tokenizing and templating, with a bounded wait list
  (beyond it, 429 with a Retry-After). `tokenizers`' `encode` holds the GIL for the whole
  call; `encode_batch` releases it, so a frontend tokenizes long texts with that.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from common.errors import Rejected
from common.sampling_params import InvalidRequestError

T = TypeVar("T")

TOKENIZE_THREADS = 2  # tokenizing competes with the role's loop for its cores
MAX_QUEUED_JOBS = 64  # calls waiting for a thread; more are refused (bounded memory)
QUEUE_FULL_RETRY_AFTER_S = 1.0
INLINE_PROMPT_CHARS = 4096  # shorter texts are tokenized on the loop: a thread hop costs more
NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
NORMAL_FORM_SHRINK = 4  # the most a Unicode normal form shrinks a text's UTF-8 bytes
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})


def token_byte_bound(tokenizer_json: str) -> int | None:
    """The most bytes of input text one token can stand for, from a `tokenizer.json`
    (the tokenizer's `to_str()`), or None when this tokenizer's pipeline may drop input
    (then no byte count bounds the token count). See the module docstring."""
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if model.get("type") != "BPE" or model.get("fuse_unk") or shrink is None \
            or not _keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab") or {}
    longest = max((len(token) for token in vocab), default=1)  # byte-level: one char per byte
    added = max((len(str(token.get("content", "")).encode()) for token in spec.get("added_tokens") or ()),
                default=1)
    return max(longest, added, 1) * shrink


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind in NORMAL_FORMS:
        return NORMAL_FORM_SHRINK
    if kind == "Sequence":
        shrinks = [_normalizer_shrink(item) for item in normalizer.get("normalizers") or ()]
        if any(shrink is None for shrink in shrinks):
            return None
        return NORMAL_FORM_SHRINK if any(shrink != 1 for shrink in shrinks) else 1
    return None


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    """A byte-level pipeline whose pre-tokenizers split the text without removing any."""
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    steps = steps or []
    return any(step.get("type") == "ByteLevel" for step in steps) and all(
        step.get("type") in KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed" for step in steps)


@dataclass(frozen=True)
class PromptByteLimit:
    """The most UTF-8 bytes a text prompt may have (0: no limit), and why, for the error."""

    max_bytes: int = 0
    reason: str = ""

    def check(self, text: str, param: str) -> None:
        """Raise PromptTooLong naming `param` for a text over the limit (encoded only when
        its length in characters could be over: a character is 1 to 4 bytes)."""
        if not self.max_bytes or len(text) * 4 <= self.max_bytes:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise PromptTooLong(param, f"is {size} bytes of UTF-8, over the limit of {self.max_bytes} bytes "
                                f"({self.reason}); refused without tokenizing")


class PromptTooLong(InvalidRequestError):
    """A text prompt over its byte limit (HTTP: 400 context_length_exceeded)."""

    code = "context_length_exceeded"


def prompt_byte_limit(token_bytes: int | None, max_model_len: int, configured: int) -> PromptByteLimit:
    """The tighter of the tokenizer's bound for a prompt of fewer than `max_model_len`
    tokens (`token_bytes`: token_byte_bound's) and the configured `max_prompt_bytes`
    (0: none)."""
    limits = [PromptByteLimit(configured, "the server's max_prompt_bytes")] if configured else []
    if token_bytes:
        limits.append(PromptByteLimit(token_bytes * (max_model_len - 1),
                                      f"more cannot fit this model's context of {max_model_len} tokens"))
    return min(limits, key=lambda limit: limit.max_bytes, default=PromptByteLimit())


class TokenizePool:
    """Runs blocking calls (tokenizing, chat templating) on `threads` threads, off the
    event loop. At most `threads` run at once; at most `max_queued` wait, and a call
    beyond that raises Rejected (429, retry after a second). A caller cancelled while its
    call runs gives up the result, not the thread: the slot frees when the call ends."""

    def __init__(self, threads: int = TOKENIZE_THREADS, max_queued: int = MAX_QUEUED_JOBS):
        self.threads = threads
        self.max_queued = max_queued
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._slots: asyncio.Semaphore | None = None  # made on the loop that uses it
        self._queued = 0

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.threads)
        if self._queued >= self.max_queued:
            raise Rejected(f"the tokenizer is busy: {self._queued} prompts wait to be tokenized",
                           retry_after_s=QUEUE_FULL_RETRY_AFTER_S)
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1
        slots, loop = self._slots, asyncio.get_running_loop()
        try:
            job: Future[T] = self._executor.submit(call, *args)
        except BaseException:
            slots.release()
            raise
        job.add_done_callback(lambda _: _call_soon(loop, slots.release))
        return await asyncio.shield(asyncio.wrap_future(job))

    def close(self) -> None:
        """Stop taking calls; those not started are dropped, running ones end in their thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for the slot
        loop.call_soon_threadsafe(callback)
