"""kernels.linear.Linear: the prepacked oneDNN path gives F.linear's bits."""
import pytest
import torch
import torch.nn.functional as F

from kernels.linear import Linear, can_prepack


@pytest.mark.parametrize("tokens", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_bit_for_bit_in_bf16(tokens, bias):
    generator = torch.Generator().manual_seed(tokens)
    weight = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    bias_tensor = torch.randn(96, generator=generator).to(torch.bfloat16) if bias else None
    x = torch.randn(tokens, 64, generator=generator).to(torch.bfloat16)
    linear = Linear(weight.clone(), bias_tensor)
    assert linear.prepacked == can_prepack(weight)
    with torch.inference_mode():
        assert torch.equal(linear(x), F.linear(x, weight, bias_tensor))


def test_fp32_and_opt_out_keep_the_plain_weight():
    weight = torch.randn(8, 4)
    assert not Linear(weight).prepacked  # fp32 would change the summation order
    assert Linear(weight).weight is weight
    assert not Linear(weight.to(torch.bfloat16), prepack=False).prepacked


def test_bf16_on_this_cpu_is_prepacked_when_onednn_is_there():
    weight = torch.randn(8, 4).to(torch.bfloat16)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert Linear(weight).prepacked
    assert Linear(weight).weight.is_mkldnn
