"""kernels.linear.Linear: the prepacked oneDNN path gives F.linear's bits, at the row
count it pads a long call to; without native bf16, the widened path gives fp32's rounded."""
import pytest
import torch
import torch.nn.functional as F

from kernels.linear import FEW_ROWS, Linear, can_prepack, onednn_bf16_native, row_bucket, row_buckets


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
        if linear.widened:  # no native bf16: torch's bf16 GEMM sums in another order
            want = F.linear(x.float(), weight.float(), bias_tensor.float() if bias else None).to(torch.bfloat16)
        else:
            want = F.linear(x, weight, bias_tensor)
        assert torch.equal(linear(x), want)


def test_fp32_and_opt_out_keep_the_plain_weight():
    weight = torch.randn(8, 4)
    assert not Linear(weight).prepacked  # fp32 would change the summation order
    assert Linear(weight).weight is weight
    assert not Linear(weight.to(torch.bfloat16), prepack=False).prepacked


def test_bf16_on_this_cpu_is_prepacked_when_onednn_runs_bf16_here():
    weight = torch.randn(8, 4).to(torch.bfloat16)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # no AVX-512 here: the reorder would raise
        assert not Linear(weight).prepacked and Linear(weight).kernel == "widened"
        return
    assert Linear(weight).prepacked
    assert Linear(weight).weight.is_mkldnn


@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_bf16_without_native_bf16_multiplies_widened_to_fp32(tokens):
    """Not torch's scalar bf16 GEMM: the weight kept in fp32, the result rounded to bf16
    (tests/kernels/test_isa_cap.py runs this under an AVX2 cap on other CPUs)."""
    if onednn_bf16_native():
        pytest.skip("oneDNN computes bf16 natively on this CPU")
    generator = torch.Generator().manual_seed(tokens)
    weight = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)
    x = torch.randn(tokens, 64, generator=generator).to(torch.bfloat16)
    linear = Linear(weight, bias)
    assert linear.kernel == "widened" and linear.weight.dtype == torch.float32
    with torch.inference_mode():
        got = linear(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16))


def test_a_bf16_engine_without_native_bf16_multiplies_every_linear_widened(make_engine, test_device):
    if test_device != "cpu" or onednn_bf16_native():
        pytest.skip("a GPU, or oneDNN computes bf16 natively on this CPU")
    assert make_engine(dtype="bfloat16").model.linear_kernels() == "widened"


def test_row_buckets_are_few_and_waste_at_most_an_eighth():
    buckets = {row_bucket(rows) for rows in range(FEW_ROWS + 1, 4097)}
    assert all(row_bucket(rows) >= rows and row_bucket(rows) <= rows * 1.125 for rows in range(FEW_ROWS + 1, 4097))
    assert len(buckets) <= 8 * 6  # 8 per octave from 64 to 4096
    assert all(row_bucket(bucket) == bucket for bucket in buckets)
    assert [row_bucket(rows) for rows in (65, 401, 1000, 2048)] == [72, 416, 1024, 2048]


def test_a_long_call_is_padded_to_its_bucket_and_cut_back():
    """A prefill chunk of 401 rows runs as 416 (so a 410-row chunk reuses oneDNN's kernel):
    its rows are F.linear's at 416 rows, and the pad rows never reach the caller."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    if not can_prepack(weight):
        pytest.skip("no oneDNN bf16 path here (no oneDNN, or bf16 widened to fp32): nothing is padded")
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)
    x = torch.randn(401, 64, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        out = Linear(weight.clone(), bias)(x)
        at_bucket = F.linear(F.pad(x, (0, 0, 0, 416 - 401)), weight, bias)[:401]
    assert out.shape == (401, 96) and out.is_contiguous()
    assert torch.equal(out, at_bucket)


def test_row_buckets_list_every_bucket_a_call_up_to_max_rows_is_padded_to():
    for max_rows in (FEW_ROWS, FEW_ROWS + 1, 100, 2048, 2050):
        assert row_buckets(max_rows) == sorted({row_bucket(rows) for rows in range(FEW_ROWS + 1, max_rows + 1)})
    assert row_buckets(FEW_ROWS) == []


def test_linears_of_one_shape_and_path_share_a_build_key_whatever_their_values():
    weight = torch.randn(96, 64).to(torch.bfloat16)
    key = Linear(weight.clone()).build_key
    assert Linear(torch.randn(96, 64).to(torch.bfloat16)).build_key == key
    assert Linear(torch.randn(64, 96).to(torch.bfloat16)).build_key != key
    assert Linear(weight.clone(), torch.zeros(96, dtype=torch.bfloat16)).build_key != key
    # Where bf16 is widened to fp32 (no native bf16), it runs what an fp32 weight runs.
    assert (Linear(weight.float()).build_key != key) == Linear(weight).prepacked


def test_warm_up_calls_the_prepacked_weight_once_per_bucket_and_leaves_it_alone():
    weight = torch.randn(96, 64).to(torch.bfloat16)
    linear = Linear(weight.clone())
    x = torch.randn(300, 64).to(torch.bfloat16)
    with torch.inference_mode():
        before = linear(x)
        assert linear.warm_up(512) == (len(row_buckets(512)) if linear.prepacked else 0)
        assert torch.equal(linear(x), before)
    assert Linear(weight, prepack=False).warm_up(512) == 0  # F.linear builds no per-size kernel
