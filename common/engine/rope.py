"""Rotary position embeddings with the scalings Llama-family configs use."""
from __future__ import annotations

import math

import torch

from common.engine.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair rotation frequencies (fp32), scaled as `scaling.rope_type` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling: unsupported rope_type {scaling.rope_type!r}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band
    between interpolated smoothly."""
    original = scaling.original_max_position_embeddings
    long_wavelen = original / scaling.low_freq_factor
    short_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > long_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to `max_positions`, gathered per step.

    Tables are kept in the model's dtype (rounded once, as the reference rounds them per
    call) and sin with the rotation's sign folded in: rotate_half(x) · sin equals
    swap_halves(x) · (−sin₁ ‖ sin₂) exactly, one negation fewer per layer."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = positions[:, None] * inv_freq[None, :]
        self.cos = torch.cat([angles, angles], dim=-1).cos().to(dtype=dtype, device=device)
        sin = angles.sin().to(dtype)
        self.signed_sin = torch.cat([-sin, sin], dim=-1).to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin as [tokens, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated in half-split (GPT-NeoX) layout."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # the halves swapped
    return x * cos + swapped * signed_sin
