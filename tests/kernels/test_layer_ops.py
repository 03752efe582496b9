"""The C++ layer ops (kernels/csrc/elementwise.cpp) against their torch references."""

import pytest
import torch

from common.engine.config import ModelConfig, RopeScaling
from common.engine.rope import RotaryEmbedding, apply_rotary
from kernels.layer_ops import NativeLayerOps, TorchLayerOps, rms_norm, select_layer_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def native(native_kernels):
    return NativeLayerOps()


def assert_within_an_ulp(actual, expected):
    """Equal up to one unit in the last place of the dtype, on at most 1% of elements."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        return
    differ = actual != expected
    assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {differ.numel()} elements differ"
    ulp = torch.finfo(actual.dtype).eps * expected.float().abs().clamp_min(torch.finfo(actual.dtype).tiny)
    assert ((actual.float() - expected.float()).abs() <= 2 * ulp).all()


def rows(count, width, dtype, seed):
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count,width", [(1, 256), (32, 768), (300, 64)])
def test_rms_norm_and_its_fused_add_match_torch(native, dtype, count, width):
    x, delta = rows(count, width, dtype, 0), rows(count, width, dtype, 1)
    weight = rows(1, width, dtype, 2)[0]
    assert_within_an_ulp(native.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    expected_sum, expected_norm = TorchLayerOps().add_rms_norm(x, delta, weight, 1e-5)
    residual = x.clone()
    summed, normed = native.add_rms_norm(residual, delta, weight, 1e-5)
    assert summed is residual and torch.equal(residual, expected_sum)  # the add rounds exactly as torch's
    assert_within_an_ulp(normed, expected_norm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_torch(native, dtype):
    gate_up = rows(40, 2 * 768, dtype, 3) * 4  # gates well into both tails of the sigmoid
    assert_within_an_ulp(native.silu_and_mul(gate_up), TorchLayerOps().silu_and_mul(gate_up))


def model_config(head_dim, scaling):
    return ModelConfig(model_type="llama", vocab_size=512, hidden_size=4 * head_dim, intermediate_size=768,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=4096, rope_scaling=scaling)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,scaling", [
    (64, RopeScaling()),
    (128, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
])
def test_rotary_gives_the_reference_bits_in_place_on_the_packed_qkv(native, dtype, head_dim, scaling):
    rotary = RotaryEmbedding(model_config(head_dim, scaling), 4096, torch.device("cpu"), dtype)
    generator = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 4096, (33,), generator=generator)
    qkv = torch.randn(33, 8 * head_dim, generator=generator).to(dtype)
    query_key = qkv[:, :6 * head_dim].view(33, 6, head_dim)  # q and k heads; v follows in each row
    expected = apply_rotary(query_key, *TorchLayerOps().rotary_inputs(rotary, positions))
    value_before = qkv[:, 6 * head_dim:].clone()
    rotated = native.rotate(query_key, native.rotary_inputs(rotary, positions))
    assert rotated.data_ptr() == query_key.data_ptr() and torch.equal(rotated, expected)
    assert torch.equal(qkv[:, 6 * head_dim:], value_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotate_and_store_writes_what_rotate_and_the_backends_copy_write(native, dtype):
    head_dim, tokens, slots = 64, 21, 64
    rotary = RotaryEmbedding(model_config(head_dim, RopeScaling()), 4096, torch.device("cpu"), dtype)
    generator = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    slot_mapping = torch.randperm(slots, generator=generator)[:tokens]
    qkv = torch.randn(tokens, 8 * head_dim, generator=generator).to(dtype)  # 4 q, 2 k, 2 v heads a row
    value = qkv[:, 6 * head_dim:].view(tokens, 2, head_dim)
    reference_qk = qkv[:, :6 * head_dim].clone().view(tokens, 6, head_dim)
    expected_rotated, stored_by_torch = TorchLayerOps().rotate_and_store(
        reference_qk, value, TorchLayerOps().rotary_inputs(rotary, positions), torch.zeros(0), slot_mapping)
    expected_cache = torch.randn(2, slots, 2, head_dim, generator=generator).to(dtype)
    kv_layer = expected_cache.clone()
    expected_cache[0].index_copy_(0, slot_mapping, expected_rotated[:, 4:])
    expected_cache[1].index_copy_(0, slot_mapping, value)

    query_key = qkv[:, :6 * head_dim].view(tokens, 6, head_dim)
    rotated, stored = native.rotate_and_store(query_key, value, native.rotary_inputs(rotary, positions), kv_layer,
                                              slot_mapping)
    assert not stored_by_torch and stored and rotated.data_ptr() == query_key.data_ptr()
    assert torch.equal(rotated, expected_rotated) and torch.equal(kv_layer, expected_cache)  # other slots untouched
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.rotate_and_store(query_key, value, native.rotary_inputs(rotary, positions), kv_layer,
                                torch.full((tokens,), slots))
    with pytest.raises(RuntimeError, match="kv_layer"):
        native.rotate_and_store(query_key, value, native.rotary_inputs(rotary, positions),
                                kv_layer[:, :, :, :32], slot_mapping)


def test_ops_refuse_bad_input_by_name(native):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.rms_norm(torch.zeros(2, 24), torch.ones(24), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        native.rms_norm(torch.zeros(2, 32), torch.ones(32, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="delta"):
        native.add_rms_norm(torch.zeros(2, 32), torch.zeros(3, 32), torch.ones(32), 1e-5)
    table = torch.zeros(8, 64)
    with pytest.raises(RuntimeError, match="outside the tables"):
        native.rotate(torch.zeros(1, 2, 64), (torch.tensor([8]), table, table))


def test_selection_takes_the_cpp_ops_only_where_they_fit(native):
    assert isinstance(select_layer_ops(torch.device("cpu"), 256, 768, 64), NativeLayerOps)
    assert type(select_layer_ops(torch.device("cpu"), 256, 768, 80)) is TorchLayerOps  # 80: half not 16-wide
    assert type(select_layer_ops(torch.device("cpu"), 264, 768, 64)) is TorchLayerOps
    assert type(select_layer_ops(torch.device("cuda"), 256, 768, 64)) is TorchLayerOps
