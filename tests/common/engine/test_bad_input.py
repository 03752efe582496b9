"""Invalid requests and engine settings are refused with errors that name the problem."""
import pytest
import torch

from common.engine.engine import EngineConfigError
from common.sampling_params import InvalidRequestError, SamplingParams


@pytest.mark.parametrize("params, param_name", [
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(max_tokens=2.5), "max_tokens"),
    (SamplingParams(seed=-3), "seed"),
    (SamplingParams(stop=("",)), "stop"),
    (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
    (SamplingParams(logprobs=1000), "logprobs"),
])
def test_invalid_sampling_parameters_are_named(make_engine, params, param_name):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", [5, 6, 7], params)
    assert error.value.param == param_name and param_name in str(error.value)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompt, fragment", [
    ([], "empty"),
    ("", "empty"),
    (list(range(4, 4 + 1024)), "context window"),
    ([5, 600], "outside the vocabulary"),
    ([5, -1], "outside the vocabulary"),
    ([5, "x"], "integers"),
])
def test_invalid_prompts_are_refused(make_engine, prompt, fragment):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", prompt, SamplingParams())
    assert error.value.param == "prompt" and fragment in str(error.value)


def test_duplicate_request_id_is_refused(make_engine):
    engine = make_engine()
    engine.add_request("same", [5, 6], SamplingParams())
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("same", [5, 6], SamplingParams())


def test_good_requests_still_run_after_bad_ones(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [5], SamplingParams(top_p=2.0))
    [result] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(result.token_ids) == 3


def test_kv_pool_too_small_for_one_sequence_is_refused(make_engine):
    with pytest.raises(EngineConfigError) as error:
        make_engine(kv_cache_gb=0.0001, max_model_len=4096)
    message = str(error.value)
    assert "kv_cache_gb" in message and "4096" in message and "256 blocks" in message


@pytest.mark.parametrize("overrides, name", [
    ({"dtype": "int8"}, "dtype"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"max_model_len": 10**6}, "max_model_len"),
    ({"queue_policy": "random"}, "queue_policy"),
    ({"attention_backend": "magic"}, "attention_backend"),
    ({"device": "tpu"}, "device"),
    ({"device": "cuda:one"}, "device"),
    ({"device": "cuda:64"}, "device"),  # no CUDA here, or not that many GPUs
    pytest.param({"device": "cuda:0"}, "device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="names a missing CUDA device; this machine has one")),
])
def test_bad_engine_settings_are_named(make_engine, overrides, name):
    with pytest.raises(ValueError) as error:
        make_engine(**overrides)
    assert name in str(error.value)
