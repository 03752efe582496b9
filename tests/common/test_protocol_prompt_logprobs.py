"""Prompt logprobs on the wire: the sampling field round-trips, and long prompts' records
are split and packed so that every message fits MAX_BODY_BYTES (docs/wire.md §3)."""
import random

import msgspec

from common.protocol import (
    MAX_BODY_BYTES,
    MAX_PROMPT_LOGPROB_BYTES,
    Chunk,
    ChunkBatch,
    Tokens,
    TokensBatch,
    decode,
    encode,
    pack_by_prompt_logprobs,
    params_from_sampling,
    prompt_logprob_bytes,
    sampling_from_params,
    split_prompt_logprobs,
)
from common.sampling_params import SamplingParams


def records(count: int, top: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [None] + [{"token_id": rng.randrange(2**32), "logprob": -rng.random() * 30,
                      "top": [[rng.randrange(2**32), -rng.random() * 30] for _ in range(top)]}
                     for _ in range(count - 1)]


def test_prompt_logprobs_round_trip_through_sampling():
    params = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=5)
    assert params_from_sampling(sampling_from_params(params)) == params
    assert sampling_from_params(SamplingParams()).prompt_logprobs is None


def test_the_byte_bound_holds_for_every_size_of_top():
    for top in (0, 1, 14, 15, 16, 20):
        batch = records(50, top, seed=top)
        assert len(msgspec.msgpack.encode(batch)) <= prompt_logprob_bytes(batch) + 5  # + the array's header


def test_a_long_prompts_records_are_split_into_messages_that_fit():
    tokens = Tokens(request_id="r", token_ids=[42], worker_id="w", num_prompt_tokens=9000, logprobs=[{"x": 1}],
                    prompt_logprobs=records(9000, 20), prompt_logprobs_start=0)
    pieces = split_prompt_logprobs(tokens)
    assert len(pieces) > 1
    assert [t for piece in pieces for t in piece.prompt_logprobs] == tokens.prompt_logprobs
    starts = [piece.prompt_logprobs_start for piece in pieces]
    assert starts == [sum(len(p.prompt_logprobs) for p in pieces[:i]) for i in range(len(pieces))]
    assert all(piece.token_ids == [] and not piece.logprobs for piece in pieces[:-1])
    assert pieces[-1].token_ids == [42] and pieces[-1].logprobs == [{"x": 1}]
    for piece in pieces:
        assert prompt_logprob_bytes(piece.prompt_logprobs) <= MAX_PROMPT_LOGPROB_BYTES
    others = [Tokens(request_id=f"d{i}", token_ids=[i], logprobs=[{"token_id": i, "logprob": -1.0,
                                                                    "top": [[1, -1.0]] * 20}])
              for i in range(256)]
    groups = pack_by_prompt_logprobs(others[:100] + pieces + others[100:])
    assert [item for group in groups for item in group] == others[:100] + pieces + others[100:]
    for group in groups:
        frames = encode(TokensBatch(items=group))
        assert len(frames[1]) <= MAX_BODY_BYTES
        assert decode(frames)[0] == TokensBatch(items=group)


def test_a_short_prompts_records_stay_in_one_message():
    tokens = Tokens(request_id="r", token_ids=[], prompt_logprobs=records(300, 5), prompt_logprobs_start=64)
    assert split_prompt_logprobs(tokens) == [tokens]


def test_chunks_are_packed_like_tokens():
    chunks = [Chunk(request_id="r", token_ids=[], text="", prompt_logprobs=records(1500, 20, seed=i))
              for i in range(4)]
    groups = pack_by_prompt_logprobs(chunks)
    assert len(groups) == 4
    for group in groups:
        assert len(encode(ChunkBatch(items=group))[1]) <= MAX_BODY_BYTES
