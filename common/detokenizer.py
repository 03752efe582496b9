"""Incremental detokenisation and stop-string matching.

Decoding is tokenizers' own `decoders.DecodeStream`: each step decodes a short window
rather than the whole output, and releases text only once it is complete (byte-level
tokens can split a UTF-8 character, which decodes to U+FFFD until its last byte comes).
Stop strings are Baton's, matched on the released text.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from tokenizers import Tokenizer

INCOMPLETE = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # decoding starts a few prompt tokens back so leading spaces merge right
MAX_CHAR_TOKENS = 3  # a UTF-8 character's continuation bytes, each possibly a token of its own
INVALID_PREFIX = "Invalid prefix"  # DecodeStream's error when a step rewrites text it already released


class IncrementalDetokenizer:
    """One request's generated text, token by token.

    `push(token_id)` returns the text that token completed (often "", e.g. mid-character)
    and appends it to `text`. The deltas add up to the text the generated tokens add to
    the prompt's: decode(prompt + output) less the prompt's own complete text, special
    tokens skipped. A character that the prompt starts and the output completes belongs
    to the output. `find_stop` then cuts `text` at the first stop string a delta
    completed."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        # The last ids whose text is out (the prompt's to start with), and those fed
        # since: what a fresh stream needs to go on from where this one is.
        self.released = deque(prompt_ids[-PROMPT_CONTEXT_TOKENS - MAX_CHAR_TOKENS:],
                              maxlen=PROMPT_CONTEXT_TOKENS + MAX_CHAR_TOKENS)
        self.pending: list[int] = []
        self.stream, self.owed = self._primed_stream()
        self.text = ""
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        try:
            chunk = self.stream.step(self.tokenizer, token_id)
        except Exception as error:  # the binding raises a bare Exception
            if not str(error).startswith(INVALID_PREFIX):
                raise
            chunk = self._restart(token_id)
        self.pending.append(token_id)
        if chunk is None:
            return ""
        self.released.extend(self.pending)
        self.pending.clear()
        delta = self._unowed(chunk)
        self.text += delta
        return delta

    def find_stop(self, delta: str) -> str | None:
        """The stop string that the last delta completed, truncating `text` before it."""
        if not delta or not self.stop:
            return None
        window_start = max(0, len(self.text) - len(delta) - self.longest_stop + 1)
        best: tuple[int, str] | None = None
        for stop_string in self.stop:
            index = self.text.find(stop_string, window_start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop_string)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]

    def _context(self, ids: Sequence[int]) -> list[int]:
        """The last few of `ids`, reaching back to where a character starts: a context cut
        through one decodes to U+FFFD there, which would come out as the output's text."""
        start = max(0, len(ids) - PROMPT_CONTEXT_TOKENS)
        floor = max(0, start - MAX_CHAR_TOKENS)
        while start > floor and not self._starts_a_character(ids, start):
            start -= 1
        return list(ids[start:])

    def _starts_a_character(self, ids: Sequence[int], start: int) -> bool:
        """Whether ids[start] begins with a character's first byte. Short windows from
        there, not the rest of `ids`: byte-fallback decoders turn a whole run of byte
        tokens into U+FFFDs when its end is incomplete."""
        return any(not self.tokenizer.decode(list(ids[start:start + k])).startswith(INCOMPLETE)
                   for k in range(1, MAX_CHAR_TOKENS + 2))

    def _primed_stream(self) -> tuple[DecodeStream, str]:
        """A stream fed the context of the `released` ids (text not to release again),
        and the part of its text the stream still holds: the prompt may end
        mid-character, and then the stream's next chunk starts with the text before it."""
        stream = DecodeStream(skip_special_tokens=True)
        context = self._context(list(self.released))
        if not context or stream.step(self.tokenizer, context) is not None:
            return stream, ""
        return stream, self._complete_head(context)

    def _complete_head(self, ids: list[int]) -> str:
        """The text of `ids` before the incomplete character they end in."""
        for end in range(len(ids) - 1, max(-1, len(ids) - 2 - MAX_CHAR_TOKENS), -1):
            text = self.tokenizer.decode(ids[:end])
            if not text.endswith(INCOMPLETE):
                return text
        return self.tokenizer.decode(ids).rstrip(INCOMPLETE)

    def _restart(self, token_id: int) -> str | None:
        """Go on in a fresh stream after DecodeStream refused a step: byte-fallback
        bytes can decode differently once a later byte extends their run, rewriting
        text already released. What was released stays; the pending ids and this one
        are decoded after the released context, or alone if that rewrites it too."""
        self.stream, self.owed = self._primed_stream()
        try:
            return self.stream.step(self.tokenizer, self.pending + [token_id])
        except Exception as error:
            if not str(error).startswith(INVALID_PREFIX):
                raise
        self.stream, self.owed = DecodeStream(skip_special_tokens=True), ""
        return self.stream.step(self.tokenizer, self.pending + [token_id])

    def _unowed(self, chunk: str) -> str:
        """`chunk` less the context text it starts with (see _primed_stream)."""
        if not self.owed:
            return chunk
        skip = len(os.path.commonprefix([chunk, self.owed]))
        self.owed = ""
        return chunk[skip:]
