"""The AMX few-row linear (kernels/csrc/amx_linear.cpp) against oneDNN and fp32, and its
use by kernels.linear.Linear."""

import gguf
import pytest
import torch
import torch.nn.functional as F

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.gguf import convert_gguf
from common.sampling_params import SamplingParams
from kernels.linear import FEW_ROWS, Linear, QuantizedBlocks, pack_weight_blocks
from kernels.native import NATIVE_TARGET, _cpu_flags, amx_available, isa_cap_flags
from tests.common.engine.gguf_files import TinyGguf

# (out, in): the tiny and small models' layer widths, Qwen2-0.5B's qkv, a vocab-wide head.
SHAPES = [(512, 256), (256, 768), (1152, 896), (256, 2048), (32000, 768)]


def cpu_has_amx() -> bool:
    """AMX on this CPU, and no instruction-set cap below it (kernels/native.py)."""
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(_cpu_flags().split()) and isa_cap_flags() == NATIVE_TARGET


@pytest.fixture(scope="module")
def amx(native_kernels):
    if not torch.ops.baton.amx_supported():
        if not cpu_has_amx():
            pytest.skip("no AMX here (or a cap below it): linears stay with oneDNN")
        # Packing needs no tile state: it fails only where the build left AMX out.
        torch.ops.baton.amx_pack_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16))
        pytest.skip("this CPU has AMX but the OS refuses tile state to the process (Linux < 5.16?)")
    return torch.ops.baton


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tensors(rows: int, out_features: int, in_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_up_to_32_rows_it_gives_onednn_bits(amx, rows, out_features, in_features, one_thread):
    """On one thread: with many (16 on an H200 host), oneDNN splits the sum over `in` across
    threads for narrow layers (256 x 2048 here), and its own bits change with the split."""
    x, weight, bias = tensors(rows, out_features, in_features, rows)
    packed = amx.amx_pack_linear_weight(weight)
    with torch.inference_mode():
        assert torch.equal(amx.amx_linear(x, packed, None), F.linear(x, weight))
        assert torch.equal(amx.amx_linear(x, packed, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [33, 64, 200])
@pytest.mark.parametrize("out_features,in_features", SHAPES[:4])
def test_more_rows_stay_within_bf16_rounding_of_fp32(amx, rows, out_features, in_features):
    x, weight, bias = tensors(rows, out_features, in_features, rows)
    got = amx.amx_linear(x, amx.amx_pack_linear_weight(weight), bias)
    exact = x.float() @ weight.float().T + bias.float()
    # One bf16 rounding of the fp32 sum (whose own error is far smaller): half a bf16 ulp.
    assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()


def test_a_row_gets_the_same_bits_whatever_batch_it_is_in(amx):
    x, weight, bias = tensors(57, 256, 768, 0)  # 57: a ragged last tile of rows
    packed = amx.amx_pack_linear_weight(weight)
    together = amx.amx_linear(x, packed, bias)
    for row in (0, 16, 31, 40, 56):
        assert torch.equal(amx.amx_linear(x[row:row + 1], packed, bias)[0], together[row])
    assert torch.equal(amx.amx_linear(x[20:45], packed, bias), together[20:45])


def test_strided_rows_and_columns_are_read_correctly(amx):
    x, weight, bias = tensors(40, 512, 256, 1)
    packed = amx.amx_pack_linear_weight(weight)
    expected = amx.amx_linear(x, packed, bias)
    wide = torch.zeros(40, 512, dtype=torch.bfloat16)
    wide[:, 128:384] = x  # rows with a stride of 512
    assert torch.equal(amx.amx_linear(wide[:, 128:384], packed, bias), expected)
    transposed = x.T.contiguous().T  # column stride 40
    assert torch.equal(amx.amx_linear(transposed, packed, bias), expected)
    assert amx.amx_linear(x[:0], packed, bias).shape == (0, 512)


def test_bad_input_is_refused_by_name(amx):
    x, weight, bias = tensors(4, 512, 256, 2)
    packed = amx.amx_pack_linear_weight(weight)
    with pytest.raises(RuntimeError, match="out features must be a positive multiple of 32, got 500"):
        amx.amx_pack_linear_weight(weight[:500])
    with pytest.raises(RuntimeError, match="in features must be a positive multiple of 32, got 250"):
        amx.amx_pack_linear_weight(weight[:, :250])
    with pytest.raises(RuntimeError, match="weight: expected a 2-D bf16"):
        amx.amx_pack_linear_weight(weight.float())
    with pytest.raises(RuntimeError, match=r"x: expected bf16 \[rows, 256\]"):
        amx.amx_linear(x[:, :128], packed, None)
    with pytest.raises(RuntimeError, match=r"x: expected bf16 \[rows, 256\]"):
        amx.amx_linear(x.float(), packed, None)
    with pytest.raises(RuntimeError, match=r"bias: expected bf16 \[512\]"):
        amx.amx_linear(x, packed, bias[:256])
    with pytest.raises(RuntimeError, match="packed: expected the output of amx_pack_linear_weight"):
        amx.amx_linear(x, weight, None)


@pytest.mark.parametrize("rows", [1, 32, FEW_ROWS, FEW_ROWS + 1, 300])
def test_linear_takes_amx_for_few_rows_and_onednn_beyond(amx, rows):
    x, weight, bias = tensors(rows, 512, 256, rows)
    linear = Linear(weight, bias, amx=True)
    assert linear.kernel == "amx"
    with torch.inference_mode():
        got = linear(x)
        if rows <= FEW_ROWS:
            assert torch.equal(got, amx.amx_linear(x, linear.amx_weight, bias))
        else:
            assert torch.equal(got, F.linear(x, weight, bias))  # the prepacked oneDNN path's bits


def test_linear_keeps_onednn_where_the_shape_does_not_fit_the_tiles(amx):
    x, weight, _ = tensors(8, 500, 256, 3)
    linear = Linear(weight, amx=True)
    assert linear.kernel == "onednn" and linear.amx_weight is None
    with torch.inference_mode():
        assert torch.equal(linear(x), F.linear(x, weight))


def test_amx_is_offered_for_bf16_on_the_cpu_only(amx):
    assert amx_available(torch.device("cpu"), torch.bfloat16)
    assert not amx_available(torch.device("cpu"), torch.float32)
    assert not amx_available(torch.device("meta"), torch.bfloat16)
    assert Linear(torch.randn(64, 64), amx=True).kernel == "torch"  # fp32 weights never take it


def test_a_bf16_engine_on_this_cpu_multiplies_few_rows_on_amx(amx, make_engine, test_device):
    if test_device != "cpu":
        pytest.skip("the AMX kernel is a CPU path")
    assert make_engine(dtype="bfloat16").model.linear_kernels() == "amx"
    assert make_engine(dtype="float32").model.linear_kernels() == "torch"


# ------------------------------------------------------------------ quantized blocks


def random_blocks(out_features: int, in_features: int, bits: int, seed: int) -> QuantizedBlocks:
    """Values of `bits` bits with random fp16 scales and minimums."""
    generator = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (out_features, in_features), generator=generator, dtype=torch.int8)
    per_block = (out_features, in_features // 32)
    scale = (torch.rand(per_block, generator=generator) * 0.02 / (in_features ** 0.5)).to(torch.float16)
    minimum = (torch.randn(per_block, generator=generator) * 0.05).to(torch.float16)
    return QuantizedBlocks(q, scale, minimum, bits)


def dequantized(blocks: QuantizedBlocks) -> torch.Tensor:
    """The weight the GGUF loader gives: float32 scale * q + minimum, rounded to bf16."""
    q = blocks.q.float().reshape(blocks.q.shape[0], -1, 32)
    value = blocks.scale.float()[..., None] * q + blocks.minimum.float()[..., None]
    return value.reshape(blocks.q.shape).to(torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 16, 32, 33, 64])
@pytest.mark.parametrize("out_features,in_features", [(512, 256), (960, 576), (64, 1536)])
def test_quantized_blocks_give_the_bits_of_their_bf16_weight(amx, bits, rows, out_features, in_features):
    blocks = random_blocks(out_features, in_features, bits, seed=rows * bits)
    x, _, bias = tensors(rows, out_features, in_features, seed=rows)
    dense = amx.amx_pack_linear_weight(dequantized(blocks))
    packed = pack_weight_blocks(blocks)
    assert packed.numel() * 8 == out_features * in_features * bits + out_features * in_features // 32 * 32
    for b in (None, bias):
        assert torch.equal(amx.amx_block_linear(x, packed, bits, b), amx.amx_linear(x, dense, b))


def test_a_linear_keeps_the_blocks_and_reports_them(amx):
    blocks = random_blocks(512, 256, 4, seed=3)
    weight = dequantized(blocks)
    linear = Linear(weight, amx=True, blocks=blocks)
    assert linear.kernel == "amx-q4" and linear.amx_weight.dtype == torch.uint8
    x = tensors(FEW_ROWS + 8, 512, 256, seed=4)[0]
    assert torch.equal(linear(x[:FEW_ROWS]), Linear(weight, amx=True)(x[:FEW_ROWS]))
    # More rows than FEW_ROWS go to oneDNN's bf16 copy, which the blocks leave in place.
    assert torch.equal(linear(x), Linear(weight, amx=True)(x))
    mismatched = random_blocks(256, 256, 4, seed=3)
    assert Linear(weight, amx=True, blocks=mismatched).kernel == "amx"


def test_block_linear_refuses_what_it_cannot_read(amx):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    packed = pack_weight_blocks(random_blocks(64, 256, 4, seed=0))
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        amx.amx_block_linear(x, packed, 5, None)
    with pytest.raises(RuntimeError, match="pack_weight_blocks for 8-bit"):
        amx.amx_block_linear(x, packed, 8, None)
    with pytest.raises(RuntimeError, match="expected bf16"):
        amx.amx_block_linear(torch.zeros(4, 128, dtype=torch.bfloat16), packed, 4, None)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_an_engine_on_a_quantized_gguf_gives_the_same_tokens_and_logprobs_from_its_blocks(amx, tmp_path, qtype):
    """The blocks replace the bf16 AMX copy of every linear, the LM head (tied: the
    embedding's blocks) included, and change no bit of what the engine computes."""
    spec = TinyGguf(qtype=gguf.GGMLQuantizationType[qtype], tied=True, seed=5)
    model_dir = convert_gguf(spec.write(tmp_path / "tiny.gguf"), tmp_path / "converted")
    prompts = [[3 + (7 * i + j) % 500 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for blocks in (True, False):
        engine = Engine(EngineConfig(model_dir=model_dir, dtype="bfloat16", weight_blocks=blocks, num_kv_blocks=256))
        expected_kernel = f"amx-q{4 if qtype == 'Q4_1' else 8}" if blocks else "amx"
        assert engine.model.linear_kernels() == expected_kernel
        results[blocks] = [(r.token_ids, r.logprobs) for r in engine.generate(prompts, params)]
    assert results[True] == results[False]
