"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability
given the tokens before it, from the prefill's own forward pass (docs/engine.md §2)."""
import pytest
import torch

from common.engine.scheduler import max_hit_tokens
from common.sampling_params import InvalidRequestError, SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def reference_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1] log-probabilities of prompt[1:] from transformers on the same
    checkpoint, fp32: log_softmax of each position's logits at the next token."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def logprob_values(records: list) -> torch.Tensor:
    return torch.tensor([record["logprob"] for record in records[1:]])


def test_prompt_logprobs_are_the_reference_log_softmax(make_engine, tiny_model_dir, random_prompts):
    engine = make_engine()
    prompt = random_prompts([70], seed=40)[0]
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))
    [scored] = engine.generate([prompt], SamplingParams(max_tokens=4, prompt_logprobs=3, **GREEDY))
    records = scored.prompt_logprobs
    assert len(records) == len(prompt) and records[0] is None
    assert [record["token_id"] for record in records[1:]] == prompt[1:]
    torch.testing.assert_close(logprob_values(records), reference_logprobs(tiny_model_dir, prompt),
                               atol=1e-4, rtol=0)
    for record in records[1:]:
        top = record["top"]
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert record["logprob"] <= top[0][1] + 1e-6
        assert (record["token_id"] in [t for t, _ in top]) == (record["logprob"] >= top[-1][1])
    assert scored.token_ids == plain.token_ids  # scoring changes nothing generated
    assert scored.num_cached_tokens == 0  # the plain run cached the prompt: not used


def test_chunked_prefill_gives_the_numbers_of_one_chunk(make_engine, random_prompts):
    prompt = random_prompts([150], seed=41)[0]
    params = SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY)
    [whole] = make_engine(max_num_batched_tokens=512).generate([prompt], params)
    chunked = make_engine(max_num_batched_tokens=48)
    chunked.add_request("r", prompt, params)
    outputs = []
    while chunked.has_unfinished():
        outputs.extend(chunked.step())
    pieces = [(o.prompt_logprobs_start, len(o.prompt_logprobs), o.new_token_ids) for o in outputs
              if o.prompt_logprobs]
    # 48-token chunks: token 0's None and 48 records, then 48 a chunk, the last with the first token.
    assert pieces == [(0, 49, []), (49, 48, []), (97, 48, []), (145, 5, [outputs[-2].new_token_ids[0]])]
    records = [record for o in outputs for record in o.prompt_logprobs]
    assert records[0] is None and whole.prompt_logprobs[0] is None
    torch.testing.assert_close(logprob_values(records), logprob_values(whole.prompt_logprobs), atol=1e-5, rtol=0)
    for got, expected in zip(records[1:], whole.prompt_logprobs[1:]):
        assert [t for t, _ in got["top"]] == [t for t, _ in expected["top"]]


def test_a_scored_request_batched_with_others_changes_none_of_them(make_engine, random_prompts):
    engine = make_engine(max_num_batched_tokens=64)
    prompts = random_prompts([40, 90, 25], seed=42)
    plain = SamplingParams(max_tokens=12, **GREEDY)
    alone = [engine.generate([prompt], plain)[0].token_ids for prompt in prompts]
    batched = engine.generate(prompts, [plain, SamplingParams(max_tokens=12, prompt_logprobs=0, **GREEDY), plain])
    assert [result.token_ids for result in batched] == alone
    assert [len(result.prompt_logprobs) for result in batched] == [0, 90, 0]
    assert all(record["top"] == [] for record in batched[1].prompt_logprobs[1:])
    engine.check_integrity()


def test_a_preempted_scored_request_gives_each_record_once(make_engine, random_prompts):
    engine = make_engine(num_kv_blocks=12, max_model_len=190, max_num_batched_tokens=32)
    prompts = random_prompts([60, 60, 60], seed=43)
    params = [SamplingParams(max_tokens=40, prompt_logprobs=1, **GREEDY)] * 3
    results = engine.generate(prompts, params)
    assert engine.stats.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert [r["token_id"] for r in result.prompt_logprobs[1:]] == prompt[1:]
    reference = make_engine().generate(prompts, params)
    for result, expected in zip(results, reference):
        torch.testing.assert_close(logprob_values(result.prompt_logprobs),
                                   logprob_values(expected.prompt_logprobs), atol=1e-5, rtol=0)
    engine.check_integrity()


def test_prefix_cache_serves_no_scored_position_and_works_for_the_rest(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([100], seed=44)[0]
    engine.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))
    [scored] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == 100
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))
    assert plain.num_cached_tokens == 96  # the cache still serves requests that score nothing


def test_max_hit_tokens_stops_at_the_first_position_still_to_score(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([40], seed=45)[0]
    engine.add_request("s", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
    seq = engine._seqs["s"]
    assert max_hit_tokens(seq) == 0
    seq.prompt_logprobs = [None] + [{}] * 20  # tokens 0..20 scored: position 20 scores token 21
    assert max_hit_tokens(seq) == 20
    seq.prompt_logprobs = [None] + [{}] * 39  # all scored
    assert max_hit_tokens(seq) == 39
    engine.abort("s")


def test_a_one_token_prompt_has_only_its_none(make_engine):
    [result] = make_engine().generate([[7]], SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY))
    assert result.prompt_logprobs == [None] and len(result.token_ids) == 3


def test_a_scored_request_is_not_fetched_from_the_kv_store(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([80], seed=46)[0]
    assert engine.begin_load("s", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)) is None
    fetch = engine.begin_load("p", prompt, SamplingParams(max_tokens=1))
    assert fetch is not None
    engine.complete_load("p", 0)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_an_import_computes_no_prompt_logprobs(make_engine, random_prompts):
    engine = make_engine()
    prompt = random_prompts([40], seed=47)[0]
    kv_import = engine.begin_load("d", prompt, SamplingParams(max_tokens=3, prompt_logprobs=2), first_token_id=9)
    assert kv_import is not None
    assert engine._seqs["d"].params.prompt_logprobs is None  # the prefill engine gave them
    engine.cancel_load("d")


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_prompt_logprobs_out_of_range_is_refused_naming_it(value):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(prompt_logprobs=value).validate()
    assert caught.value.param == "prompt_logprobs"
