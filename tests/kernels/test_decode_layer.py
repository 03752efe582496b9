"""A decode step's layers as one C++ op each (kernels/csrc/decode_layer.cpp, DecoderLayer.
forward_decode): the same kernels in the same order as the Python layer, so the same
bits; taken only where every row is a single-token decode and every linear is on AMX or
prepacked for oneDNN (a CPU with native bf16 but no AMX)."""
import gguf
import pytest
from torch.profiler import ProfilerActivity, profile

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.gguf import convert_gguf
from common.sampling_params import SamplingParams
from kernels.linear import onednn_bf16_native
from tests.common.engine.gguf_files import TinyGguf
from tests.kernels.test_amx_linear import amx  # noqa: F401  (the fixture)

PROMPTS = [[3 + (7 * i + j) % 500 for j in range(5 + 9 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)


def outputs(engine: Engine, fused: bool) -> list:
    """The greedy outputs and logprobs of PROMPTS, each prefilled cold: a prefix hit's
    prefill takes other kernels, whose last bits may differ."""
    engine.model.fused_decode = fused
    engine.block_manager.reset_prefix_cache()
    return [(r.token_ids, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]


def fused_calls(engine: Engine) -> int:
    """decode_layer calls over one prefill step and one decode step of two requests."""
    for index in range(2):
        engine.add_request(f"count-{index}", PROMPTS[index], SamplingParams(max_tokens=2, temperature=0.0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished():
            engine.step()
    return sum(event.count for event in prof.key_averages() if event.key == "baton::decode_layer")


def test_a_fused_decode_step_gives_the_python_layers_bits(native_kernels, make_engine, test_device):
    """On AMX linears where the CPU has them, else on bf16 weights prepacked for oneDNN."""
    if test_device != "cpu" or not onednn_bf16_native():
        pytest.skip("the fused layer is a CPU path for bf16 linears that AMX or oneDNN compute natively")
    engine = make_engine(dtype="bfloat16")
    assert engine.model.fused_decode
    assert engine.model.amx_linears or engine.model.linear_kernels() == "onednn"
    assert fused_calls(engine) == len(engine.model.layers)  # the decode step only, once a layer
    assert outputs(engine, fused=True) == outputs(engine, fused=False)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_fused_decode_step_on_gguf_blocks_gives_the_same_bits(amx, tmp_path, qtype):  # noqa: F811
    spec = TinyGguf(qtype=gguf.GGMLQuantizationType[qtype], tied=True, seed=5)
    model_dir = convert_gguf(spec.write(tmp_path / "tiny.gguf"), tmp_path / "converted")
    engine = Engine(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_kv_blocks=256))
    assert engine.model.fused_decode and engine.model.linear_kernels().startswith("amx-q")
    assert outputs(engine, fused=True) == outputs(engine, fused=False)


def test_fp32_and_torch_linears_keep_the_python_layers(make_engine, test_device):
    engine = make_engine(dtype="float32")
    assert not engine.model.fused_decode
    assert fused_calls(engine) == 0
