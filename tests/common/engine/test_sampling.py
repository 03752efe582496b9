"""Sampling parameters: seeds, top-k/top-p, stop conditions, logprobs."""
import pytest
import torch

from common.sampling_params import SamplingParams


def test_same_seed_same_tokens_whatever_the_batch(make_engine, random_prompts):
    engine = make_engine()
    prompt, *others = random_prompts([20, 33, 8], seed=30)
    seeded = SamplingParams(max_tokens=30, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0].token_ids
    unseeded = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    batched = engine.generate([prompt, *others], [seeded, unseeded, unseeded])[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(max_tokens=30, temperature=1.0, seed=99, ignore_eos=True)
    assert engine.generate([prompt], other_seed)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([25], seed=31)[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    top_k = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=1.5, top_k=1, ignore_eos=True))[0]
    top_p = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=1.5, top_p=1e-6, ignore_eos=True))[0]
    assert greedy.token_ids == top_k.token_ids == top_p.token_ids


def test_top_k_only_draws_from_the_k_most_likely(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([25], seed=32)[0]
    params = SamplingParams(max_tokens=40, temperature=5.0, top_k=3, seed=7, logprobs=3, ignore_eos=True)
    [result] = engine.generate([prompt], params)
    for record in result.logprobs:
        assert record["token_id"] in [token for token, _ in record["top"]]


def test_high_temperature_spreads_tokens(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([10], seed=33)[0]
    draws = engine.generate([prompt] * 16, [SamplingParams(max_tokens=1, temperature=50.0, seed=s) for s in range(16)])
    assert len({r.token_ids[0] for r in draws}) > 8


def test_logprobs_are_the_model_distribution(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([15], seed=34)[0]
    [result] = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=4, ignore_eos=True))
    assert len(result.logprobs) == 5
    for token, record in zip(result.token_ids, result.logprobs):
        top = record["top"]
        assert len(top) == 4 and top[0][0] == token == record["token_id"]
        assert record["logprob"] == top[0][1] <= 0
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert sum(torch.tensor([lp for _, lp in top]).exp()) <= 1.0 + 1e-5


def test_max_tokens_and_stop_token_ids(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([12], seed=35)[0]
    [free] = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert len(free.token_ids) == 10 and free.finish_reason == "length"
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    [stopped] = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                         stop_token_ids=(stop_at,)))
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"


def test_eos_stops_unless_ignored(make_engine, random_prompts):
    engine = make_engine()
    eos = engine.model_config.eos_token_ids[0]
    free_run = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    # A prompt whose greedy continuation emits EOS somewhere, found in one batch.
    candidates = engine.generate(random_prompts([12] * 64, seed=0), free_run)
    free = next((c for c in candidates if eos in c.token_ids[:-1]), None)
    assert free is not None, "no prompt produced EOS; the test needs a wider search"
    prompt = free.prompt_token_ids
    [stopped] = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0))
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop"


def test_stop_strings_end_and_truncate_text(make_engine):
    engine = make_engine()
    prompt = "The baton passes"
    [free] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    text = free.text
    visible = [c for c in text if c.isprintable() and c != "\ufffd"]
    assert len(visible) >= 4, text
    # A stop string taken from the middle of the free text.
    start = text.index(visible[len(visible) // 2])
    stop = text[start:start + 2]
    [stopped] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]
    assert len(stopped.token_ids) < len(free.token_ids)


@pytest.mark.parametrize("vocab", [512, 2048, 32000, 32003])
@pytest.mark.parametrize("name", ["argmax_rows", "argmax_by_blocks"])
def test_argmax_rows_is_torch_argmax_ties_included(vocab, name):
    """argmax_rows (Baton's kernel where it is built) and the torch way it falls back to."""
    from common.engine import sampler

    argmax_rows = getattr(sampler, name)
    generator = torch.Generator().manual_seed(vocab)
    values = torch.randn(9, vocab, generator=generator)
    values[1, 5] = values[1, vocab - 1] = 100.0  # a tie across blocks: the first wins
    values[2, 130] = values[2, 131] = 100.0  # a tie inside one block
    values[3, vocab - 1] = 100.0  # the best in the padded last block
    values[4] = float("-inf")  # nothing finite: index 0, as torch gives
    values[4, vocab // 2] = float("-inf")
    values[5, :] = 7.0  # all equal
    assert torch.equal(argmax_rows(values), values.argmax(dim=-1))
    assert torch.equal(argmax_rows(values.bfloat16()), values.bfloat16().argmax(dim=-1))
    strided = values.t().contiguous().t()  # the same values, column-major
    assert torch.equal(argmax_rows(strided), values.argmax(dim=-1))
