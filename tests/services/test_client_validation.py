"""The SDK refuses, before sending, what the wire cannot carry: InvalidRequest naming the field."""
from __future__ import annotations

import math

import pytest

from common.errors import InvalidRequest
from services.client._shared import build_submit


@pytest.mark.parametrize("prompt, token_ids, timeout_s, sampling, field", [
    ("hi", None, 1.0, {"top_k": 2**70}, "top_k"),
    ("hi", None, 1.0, {"stop_token_ids": [2**70]}, "stop_token_ids"),
    ("hi", None, 1.0, {"stop": ["x" * 600_000] * 2}, "stop"),
    ("hi", None, math.inf, {}, "timeout_s"),
    ("hi", None, math.nan, {}, "timeout_s"),
    (None, [2**32], 1.0, {}, "token_ids"),
    (None, [-1], 1.0, {}, "token_ids"),
    ("x" * (2 << 20), None, 1.0, {}, "prompt"),
    (5, None, 1.0, {}, "prompt"),
    ("hi", None, 1.0, {"stop": ["ok", "\ud800"]}, r"stop\[1\]"),  # a lone surrogate: not valid Unicode
    ("a\udc00", None, 1.0, {}, "prompt"),
    ("hi", None, 1.0, {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("hi", None, 1.0, {"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_what_the_wire_cannot_carry_is_refused_before_sending(prompt, token_ids, timeout_s, sampling, field):
    with pytest.raises(InvalidRequest, match=f"^{field}:"):
        build_submit(prompt, token_ids, "", timeout_s, sampling)


def test_the_largest_accepted_request_is_sent():
    _, frames = build_submit(None, [2**32 - 1, 0], "", 1.0, {"top_k": 2**31 - 1, "stop": ["x" * 1024] * 16})
    assert len(frames) == 3


def test_a_lone_surrogate_is_named_as_such():
    with pytest.raises(InvalidRequest, match=r"^stop\[0\]: is not valid Unicode: it holds a lone surrogate"):
        build_submit("hi", None, "", 1.0, {"stop": "\ud800"})
    with pytest.raises(InvalidRequest, match="^slo_class: is not valid Unicode"):
        build_submit("hi", None, "", 1.0, {}, slo_class="\udfff")


def test_an_empty_text_prompt_is_sent_for_the_server_to_tokenize():
    """The server decides, as over HTTP (served when its tokenizer adds BOS)."""
    _, frames = build_submit("", None, "", 1.0, {})
    assert len(frames) == 2
