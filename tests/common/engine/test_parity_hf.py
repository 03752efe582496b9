"""Logits and greedy tokens against Hugging Face transformers on the same weights."""
import math
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from common.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 64


def hf_model(model_dir, dtype, device):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return output[0, len(prompt):].tolist()


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt], device=model.device)).logits[0, -1].float().cpu()


def baton_last_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The engine's logits for the prompt's last position, through the real step path."""
    captured = {}
    original = engine.runner.sampler.sample

    def capture(logits, seqs):
        captured["logits"] = logits.clone()
        return original(logits, seqs)

    engine.runner.sampler.sample = capture
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    finally:
        engine.runner.sampler.sample = original
    return captured["logits"][0].float().cpu()


def write_hf_checkpoint(model_class, config, directory, tokenizer_dir):
    """A checkpoint written by transformers itself (so our loader reads HF's own output),
    with weights re-drawn at a scale that gives logits a clear argmax."""
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif param.dim() == 2:
                param.normal_(0, 1 / math.sqrt(param.shape[1]))
            else:
                param.normal_(0, 0.1)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory, tiny_model_dir):
    base = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                bos_token_id=0, eos_token_id=1)
    root = tmp_path_factory.mktemp("hf")
    llama3 = transformers.LlamaConfig(
        **base, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    linear = transformers.LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 4.0})
    qwen2 = transformers.Qwen2Config(**base, tie_word_embeddings=True)
    qwen3 = transformers.Qwen3Config(**base, head_dim=32, tie_word_embeddings=False)
    return {
        "llama3-gqa-rope-scaling": write_hf_checkpoint(transformers.LlamaForCausalLM, llama3, root / "l3",
                                                       tiny_model_dir),
        "llama-linear-rope": write_hf_checkpoint(transformers.LlamaForCausalLM, linear, root / "lin", tiny_model_dir),
        "qwen2-bias-tied": write_hf_checkpoint(transformers.Qwen2ForCausalLM, qwen2, root / "q2", tiny_model_dir),
        "qwen3-qk-norm": write_hf_checkpoint(transformers.Qwen3ForCausalLM, qwen3, root / "q3", tiny_model_dir),
    }


def test_tiny_default_matches_hf_fp32(make_engine, tiny_model_dir, random_prompts, test_device):
    engine = make_engine()
    reference = hf_model(tiny_model_dir, torch.float32, test_device)
    prompt = random_prompts([40], seed=1)[0]
    torch.testing.assert_close(baton_last_logits(engine, prompt), hf_last_logits(reference, prompt),
                               atol=1e-4, rtol=1e-4)
    [result] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)


def test_tiny_default_matches_hf_bf16(make_engine, tiny_model_dir, random_prompts, test_device):
    engine = make_engine(dtype="bfloat16")
    reference = hf_model(tiny_model_dir, torch.bfloat16, test_device)
    for prompt in random_prompts([12, 70], seed=2):
        baton, hf = baton_last_logits(engine, prompt), hf_last_logits(reference, prompt)
        # bf16 keeps 8 bits of mantissa; logits of this scale agree to a few bf16 ulps.
        assert (baton - hf).abs().max() < 0.1 * hf.abs().max()
        assert baton.argmax() == hf.argmax()


@pytest.mark.parametrize("variant", ["llama3-gqa-rope-scaling", "llama-linear-rope",
                                     "qwen2-bias-tied", "qwen3-qk-norm"])
def test_architecture_variants_match_hf(variant, variant_dirs, make_engine, random_prompts, test_device):
    model_dir = variant_dirs[variant]
    engine = make_engine(model_dir=model_dir)
    reference = hf_model(model_dir, torch.float32, test_device)
    # Long enough (> 256) that llama3 scaling's low-frequency band matters.
    prompt = random_prompts([300], seed=3)[0]
    torch.testing.assert_close(baton_last_logits(engine, prompt), hf_last_logits(reference, prompt),
                               atol=1e-4, rtol=1e-4)
    [result] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 32, 2080])
def test_rms_norm_matches_the_reference_bit_for_bit(dtype, rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kernels.layer_ops import rms_norm

    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 256, generator=generator) * 3).to(dtype)
    reference = LlamaRMSNorm(256, eps=1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.1 * torch.randn(256, generator=generator))
        expected = reference(x)
    assert torch.equal(rms_norm(x, reference.weight.detach(), 1e-5), expected)
