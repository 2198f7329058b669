"""Rotary position embeddings: frequencies (plain, linear, Llama 3, YaRN), tables, and their application."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.core.spec import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """What YaRN multiplies cos and sin by (1 for the other types)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def softmax_scale(head_dim: int, rope: RopeConfig) -> float:
    """1/sqrt(head_dim), times DeepSeek's correction for a YaRN-stretched context (mscale_all_dim squared)."""
    scale = head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def _yarn_inverse_frequencies(dim: int, rope: RopeConfig) -> torch.Tensor:
    """Long wavelengths interpolated by `factor`, short ones kept, a linear ramp between (by rotations
    over the original context: `beta_fast` and `beta_slow`)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def rope_inverse_frequencies(dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, rescaled for long context as the config says."""
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(dim, rope)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = ((rope.original_max_position_embeddings / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor))
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables (YaRN's attention factor folded in), indexed by absolute position."""

    def __init__(self, dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(dim, rope)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        factor = rope_attention_factor(rope)
        self.register_buffer("cos", angles.cos() * factor, persistent=False)
        self.register_buffer("sin", angles.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, dim] of the step's positions, looked up once for all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotation of (x0, x1), (x2, x3)... pairs; the result comes out as [rotated evens | rotated odds], the
    layout DeepSeek's checkpoints assume. Queries and keys get the same order, so their products are those of
    the pairs."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
