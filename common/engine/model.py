"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2/2.5/3) over flattened batches.

A step's tokens from all sequences run as one [tokens, hidden] batch through the
projections; only attention knows about sequences, through the backend's per-step
metadata. Weights are loaded from Hugging Face names and fused (q/k/v into one
projection, gate/up into one) so each layer runs few, large matmuls, each through a
kernels.linear.Linear that holds its weight in the layout the device multiplies
fastest (for a GGUF checkpoint's quantized weights on AMX, its blocks as stored).
Arithmetic follows the reference implementation's order and dtypes so logits
match it; the layer's small ops go through kernels.layer_ops (C++ on the CPU), which
rounds where the reference rounds.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.config import ModelConfig
from common.engine.kv_cache import KVCache
from common.engine.rope import RotaryEmbedding
from kernels.attention import AttentionBackend
from kernels.layer_ops import NativeLayerOps, TorchLayerOps, rms_norm, select_layer_ops
from kernels.linear import FEW_ROWS, Linear, QuantizedBlocks
from kernels.native import amx_available
from kernels.sdpa_paged import NativeDecode, native_decode_group


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.q_size = config.num_heads * head_dim
        self.kv_size = config.num_kv_heads * head_dim
        self.config = config

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.input_norm = param(hidden)
        self.q_norm = param(head_dim) if config.qk_norm else None
        self.k_norm = param(head_dim) if config.qk_norm else None
        self.post_norm = param(hidden)
        # Set by CausalLM.load_hf_weights (Linear is no nn.Module: plain attributes); a
        # model runs only once loaded.
        self.qkv: Linear
        self.o_proj: Linear
        self.gate_up: Linear
        self.down: Linear
        self.decode_operands: tuple = ()  # set by fused_decode_fits, for forward_decode

    def forward(self, hidden: torch.Tensor, pending: torch.Tensor | None, rotary_inputs: tuple,
                kv_layer: torch.Tensor, slot_mapping: torch.Tensor, backend: AttentionBackend, metadata: object,
                ops: TorchLayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the residual stream, this layer's MLP output not yet added to it): the
        add is fused into the next layer's input norm. `pending` is the previous layer's."""
        config = self.config
        tokens = hidden.shape[0]
        if pending is None:
            normed = ops.rms_norm(hidden, self.input_norm, config.rms_norm_eps)
        else:
            hidden, normed = ops.add_rms_norm(hidden, pending, self.input_norm, config.rms_norm_eps)
        qkv = self.qkv(normed)
        query_key, value = qkv.split_with_sizes([self.q_size + self.kv_size, self.kv_size], dim=-1)
        query_key = query_key.view(tokens, config.num_heads + config.num_kv_heads, config.head_dim)
        value = value.view(tokens, config.num_kv_heads, config.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (config.qk_norm)
            query_key = torch.cat([
                rms_norm(query_key[:, :config.num_heads], self.q_norm, config.rms_norm_eps),
                rms_norm(query_key[:, config.num_heads:], self.k_norm, config.rms_norm_eps)], dim=1)
        # q and k rotate together: one op for both, which may also write K and V to the cache.
        rotated, kv_stored = ops.rotate_and_store(query_key, value, rotary_inputs, kv_layer, slot_mapping)
        query, key = rotated.split_with_sizes([config.num_heads, config.num_kv_heads], dim=1)
        attended = backend.forward(query, key, value, kv_layer, metadata, kv_stored)
        hidden, normed = ops.add_rms_norm(hidden, self.o_proj(attended.reshape(tokens, self.q_size)),
                                          self.post_norm, config.rms_norm_eps)
        return hidden, self.down(ops.silu_and_mul(self.gate_up(normed)))

    def fused_decode_fits(self) -> bool:
        """Whether `forward_decode` can run this layer: every linear on AMX or prepacked for
        oneDNN (Linear.layer_operand), no q/k norm. Where it can, keeps the linears'
        operands for it (`decode_operands`: weight, bits and bias of each in turn)."""
        linears = (self.qkv, self.o_proj, self.gate_up, self.down)
        operands = [linear.layer_operand for linear in linears]
        if self.q_norm is not None or any(operand is None for operand in operands):
            return False
        self.decode_operands = tuple(value for linear, operand in zip(linears, operands)
                                     for value in (*cast(tuple, operand), linear.bias))
        return True

    def forward_decode(self, hidden: torch.Tensor, pending: torch.Tensor | None, rotary_inputs: tuple,
                       kv_layer: torch.Tensor, slot_mapping: torch.Tensor, group: NativeDecode) -> torch.Tensor:
        """forward() for a step of single-token decode queries, as one C++ op
        (kernels/csrc/decode_layer.cpp: the same kernels in the same order): adds to
        `hidden` in place and returns this layer's MLP output."""
        config = self.config
        return torch.ops.baton.decode_layer.default(
            hidden, pending, self.input_norm, self.post_norm, config.rms_norm_eps, *self.decode_operands,
            config.num_heads, config.num_kv_heads, config.head_dim, *rotary_inputs, kv_layer, slot_mapping,
            group.block_table, group.query_starts, group.query_lens, group.context_lens, group.block_size,
            config.head_dim ** -0.5)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_positions: int):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype,
                                              device=device), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device),
                                       requires_grad=False)
        self.lm_head: Linear  # set by load_hf_weights; tied: a copy of embed
        self.rotary = RotaryEmbedding(config, max_positions, device, dtype)
        self.ops = select_layer_ops(device, config.hidden_size, config.intermediate_size, config.head_dim)
        self.amx_linears = amx_available(device, dtype)
        # Decode steps through one C++ op a layer (DecoderLayer.forward_decode); set once loaded.
        self.fused_decode = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                logits_rows: torch.Tensor | slice, kv_cache: KVCache, backend: AttentionBackend,
                metadata: object) -> torch.Tensor:
        """Runs the flat batch, writing its K/V into the cache at `slot_mapping` (one slot a
        token); returns the logits of the rows in `logits_rows` (row indices, or a slice
        such as every row) in the model's dtype: the sampler widens them where it needs to."""
        hidden = F.embedding(input_ids, self.embed)
        rotary_inputs = self.ops.rotary_inputs(self.rotary, positions)
        pending: torch.Tensor | None = None
        decode = native_decode_group(backend, metadata) if self.fused_decode else None
        if decode is not None and input_ids.shape[0] <= FEW_ROWS:
            for index, decoder in enumerate(self.decoder_layers()):
                pending = decoder.forward_decode(hidden, pending, rotary_inputs, kv_cache.layers[index], slot_mapping,
                                                 decode)
        else:
            for index, layer in enumerate(self.layers):
                hidden, pending = layer(hidden, pending, rotary_inputs, kv_cache.layers[index], slot_mapping,
                                        backend, metadata, self.ops)
        assert pending is not None  # a model has layers
        selected = hidden[logits_rows] + pending[logits_rows]  # the last layer's add, on the rows needed
        return self.lm_head(self.ops.rms_norm(selected, self.final_norm, self.config.rms_norm_eps))

    def decoder_layers(self) -> list[DecoderLayer]:
        """self.layers as what they are (iterating an nn.ModuleList gives plain Modules)."""
        return cast(list[DecoderLayer], list(self.layers))

    def layer_linears(self) -> list[Linear]:
        return [getattr(layer, name) for layer in self.decoder_layers()
                for name in ("qkv", "o_proj", "gate_up", "down")]

    def linear_kernels(self) -> str:
        """What multiplies few-row linears, e.g. 'amx', or 'amx+onednn' where some shapes
        do not fit the tiles (for the startup log and the benchmark's record)."""
        return "+".join(sorted({linear.kernel for linear in [self.lm_head, *self.layer_linears()]}))

    def warm_up_linears(self, max_rows: int) -> int:
        """Linear.warm_up for one decoder-layer linear of each `build_key` (the layers'
        calls take a row per token of a step, the LM head's one per sequence). The layers'
        linears of one shape share oneDNN's kernels, so warming each layer's own only
        multiplied zeros again and again (most of a 1-core worker's start,
        docs/performance.md §8.11). Returns the calls made."""
        by_key: dict[tuple, Linear] = {}
        for linear in self.layer_linears():
            by_key.setdefault(linear.build_key, linear)
        return sum(linear.warm_up(max_rows) for linear in by_key.values())

    @torch.no_grad()
    def load_hf_weights(self, state_dict: dict[str, torch.Tensor],
                        blocks: Mapping[str, QuantizedBlocks] | None = None) -> None:
        """Copy (and fuse) weights given under Hugging Face names. `blocks`: the quantized
        blocks some of them were dequantized from, by the same names, for the AMX copies
        of the linears (kernels.linear.Linear) that have blocks for every weight they fuse."""

        device = self.embed.device
        blocks = blocks or {}

        def blocks_of(*names: str) -> QuantizedBlocks | None:
            return QuantizedBlocks.stacked([blocks.get(name) for name in names])

        def get(name: str) -> torch.Tensor:
            return state_dict[name].to(device=device, dtype=self.dtype)

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([get(name) for name in names])

        self.embed.copy_(get("model.embed_tokens.weight"))
        self.final_norm.copy_(get("model.norm.weight"))
        amx = self.amx_linears
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = Linear(self.embed.clone() if self.config.tie_word_embeddings else get(head), amx=amx,
                              blocks=blocks_of(head))
        for index, layer in enumerate(self.decoder_layers()):
            prefix = f"model.layers.{index}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            layer.input_norm.copy_(get(prefix + "input_layernorm.weight"))
            layer.post_norm.copy_(get(prefix + "post_attention_layernorm.weight"))
            qkv_bias = None
            if self.config.attention_bias:
                qkv_bias = cat(*(attn + f"{p}_proj.bias" for p in "qkv"))
            qkv = [attn + f"{p}_proj.weight" for p in "qkv"]
            layer.qkv = Linear(cat(*qkv), qkv_bias, amx=amx, blocks=blocks_of(*qkv))
            if layer.q_norm is not None and layer.k_norm is not None:
                layer.q_norm.copy_(get(attn + "q_norm.weight"))
                layer.k_norm.copy_(get(attn + "k_norm.weight"))
            o_proj, down = attn + "o_proj.weight", mlp + "down_proj.weight"
            gate_up = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
            layer.o_proj = Linear(get(o_proj), amx=amx, blocks=blocks_of(o_proj))
            layer.gate_up = Linear(cat(*gate_up), amx=amx, blocks=blocks_of(*gate_up))
            layer.down = Linear(get(down), amx=amx, blocks=blocks_of(down))
        self.fused_decode = (isinstance(self.ops, NativeLayerOps) and self.dtype == torch.bfloat16
                             and all(layer.fused_decode_fits() for layer in self.decoder_layers()))
