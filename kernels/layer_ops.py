"""The transformer layer's small ops: RMSNorm (alone, and after the residual add), SiLU
times up, and rotary embedding, in torch or through kernels/csrc/elementwise.cpp.

On the CPU each torch version is a chain of small ops (RMSNorm alone is eight), and at
decode sizes their dispatch costs more than their arithmetic; the C++ ones make one pass
each. The torch versions are the reference: they round where HF transformers' Llama does.
The C++ ones round at the same places; rotary gives the same bits, RMSNorm and SiLU may
differ by one unit in the last place now and then (see elementwise.cpp).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.engine.rope import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm normalised in fp32, rounded to the input dtype, then scaled, as the
    reference does. Spelled out rather than F.rms_norm: the same bits (tested), and on
    CPU ~1.3x faster on a 2,080-token prefill (torch's composite makes more passes)."""
    as_float = x.float()
    inverse_rms = torch.rsqrt(as_float.square().mean(-1, keepdim=True) + eps)
    return weight * (as_float * inverse_rms).to(x.dtype)


class TorchLayerOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its RMSNorm); the first may be `residual` updated in place."""
        residual = residual + delta
        return residual, rms_norm(residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [tokens, 2 * width] (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_inputs(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> tuple:
        """What `rotate` needs for this step's positions, made once for all layers."""
        return rotary.lookup(positions)

    def rotate(self, x: torch.Tensor, inputs: tuple) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated at the step's positions (may be x, in place)."""
        return apply_rotary(x, *inputs)

    def rotate_and_store(self, query_key: torch.Tensor, value: torch.Tensor, inputs: tuple,
                         kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(`rotate(query_key, inputs)`, whether the rotated keys (query_key's last kv_heads
        heads) and `value` were also written to their slots of `kv_layer` [2, slots, kv_heads,
        head_dim]); where not, the attention backend writes them."""
        return self.rotate(query_key, inputs), False


class NativeLayerOps(TorchLayerOps):
    name = "native"

    def __init__(self) -> None:
        # The overloads, looked up once: these run ~20 times a step.
        ops = torch.ops.baton
        self._rms_norm = ops.rms_norm.default
        self._add_rms_norm = ops.add_rms_norm.default
        self._silu_and_mul = ops.silu_and_mul.default
        self._rotary_embedding = ops.rotary_embedding.default
        self._rotary_embedding_to_cache = ops.rotary_embedding_to_cache.default

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(self, residual, delta, weight, eps):
        return residual, self._add_rms_norm(residual, delta, weight, eps)

    def silu_and_mul(self, gate_up):
        return self._silu_and_mul(gate_up)

    def rotary_inputs(self, rotary, positions):
        return positions, rotary.cos, rotary.signed_sin

    def rotate(self, x, inputs):
        self._rotary_embedding(x, *inputs)
        return x

    def rotate_and_store(self, query_key, value, inputs, kv_layer, slot_mapping):
        self._rotary_embedding_to_cache(query_key, value, *inputs, kv_layer, slot_mapping)
        return query_key, True


def select_layer_ops(device: torch.device, hidden_size: int, intermediate_size: int,
                     head_dim: int) -> TorchLayerOps:
    """The C++ ops on the CPU where they build and fit the model's widths; torch otherwise."""
    from kernels.native import load_native_ops

    fits = hidden_size % 16 == 0 and intermediate_size % 16 == 0 and head_dim % 32 == 0 and head_dim <= 512
    if device.type == "cpu" and fits and load_native_ops():
        return NativeLayerOps()
    return TorchLayerOps()
