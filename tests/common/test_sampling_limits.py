"""The ranges SamplingParams.validate() enforces (every entry path calls it): a value the
wire cannot carry, or that would cost without bound, is refused naming the field."""
from __future__ import annotations

import pytest

from common.protocol import MAX_BODY_BYTES, Generate, decode, encode, sampling_from_params
from common.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequestError,
    SamplingParams,
)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 2**70), ("max_tokens", 2**31), ("top_k", 2**70), ("top_k", 2**31), ("top_k", -1),
    ("seed", 2**64), ("seed", -1), ("logprobs", 2**70), ("stop_token_ids", (2**70,)), ("stop_token_ids", (2**32,)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", (0,) * (MAX_STOP_TOKEN_IDS + 1)),
    ("stop", ("x" * 600_000,) * 2), ("stop", ("x" * (MAX_STOP_STRING_CHARS + 1),)),
    ("stop", ("x",) * (MAX_STOP_STRINGS + 1)), ("top_p", True), ("ignore_eos", 1),
])
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**{field: value}).validate()
    assert refused.value.param == field


def test_the_largest_accepted_values_fit_the_wire():
    params = SamplingParams(max_tokens=2**31 - 1, top_k=2**31 - 1, seed=2**63 - 1, logprobs=20,
                            stop_token_ids=(2**32 - 1,) * MAX_STOP_TOKEN_IDS,
                            stop=("é" * MAX_STOP_STRING_CHARS,) * MAX_STOP_STRINGS)
    params.validate()
    generate = Generate(request_id="r-1", sampling=sampling_from_params(params), stream_address="tcp://h:1")
    frames = [bytes(frame) for frame in encode(generate, [[1]])]
    assert len(frames[1]) <= MAX_BODY_BYTES
    assert decode(frames)[0] == generate


def test_stop_token_ids_must_be_in_the_vocabulary_when_it_is_known():
    SamplingParams(stop_token_ids=(511,)).validate(vocab_size=512)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(512,)).validate(vocab_size=512)
