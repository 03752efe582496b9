"""Incremental detokenisation and stop-string matching.

Decoding a growing token list from scratch each step costs O(n^2); instead each step
decodes only a short window, and text is released only once it is complete (byte-level
tokens can split a UTF-8 character, which decodes to U+FFFD until its last byte comes).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

INCOMPLETE = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # decoding starts a few prompt tokens back so leading spaces merge right


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.prefix_text: str | None = None
        self.text = ""
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        if self.prefix_text is None:  # decoded once per window, not once per token
            self.prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        prefix = self.prefix_text
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(INCOMPLETE):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.prefix_text = None
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
