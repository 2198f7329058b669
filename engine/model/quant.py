"""Pure quantization primitives: FP8 e4m3 with scales, group-wise INT4, per-channel or block FP8 weights.

No modules here; `engine.model.quantized_linear` swaps layers. Conventions:
- FP8: x ≈ q * scale, q in e4m3 (|q| <= 448), scale = amax / 448.
- INT4: w ≈ q * scale + minimum per group of `group_size` inputs, q in 0..15, two per byte (even index
  in the low nibble). Symmetric grids store no minimum: it is -8 * scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.errors import ConfigError
from engine.core.memory import FP8_WEIGHT_SCALE_DTYPE, WeightFormat
from engine.model.dtypes import TORCH_DTYPES

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
INT4_LEVELS = 15
SYMMETRIC_OFFSET = 8
CLIP_SEARCH = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.8, 0.75)


def require_fp8() -> torch.dtype:
    if FP8_DTYPE is None:
        raise ConfigError(f"this torch build ({torch.__version__}) has no float8_e4m3fn; FP8 needs torch >= 2.1")
    return FP8_DTYPE


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating: values beyond the calibrated range clip to ±448 instead of becoming NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(require_fp8())


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def fp8_per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    return fp8_scale(x.abs().amax())


def fp8_per_head_scale(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] → one scale per head."""
    return fp8_scale(x.abs().amax(dim=(0, 2)))


@dataclass
class Fp8Weight:
    values: torch.Tensor      # [out, in] float8_e4m3fn
    scales: torch.Tensor      # [out] one per output channel, or [ceil(out / block), ceil(in / block)]
    block_size: int | None = None

    def scale_grid(self) -> torch.Tensor:
        """One fp32 scale per weight element: the row's, or its block's (DeepSeek's 128 x 128 blocks)."""
        if self.block_size is None:
            return self.scales.float()[:, None]
        rows, columns = self.values.shape
        grid = self.scales.float().repeat_interleave(self.block_size, 0).repeat_interleave(self.block_size, 1)
        return grid[:rows, :columns]


def quantize_fp8_weight(weight: torch.Tensor, block_size: int | None = None) -> Fp8Weight:
    """Per output channel, or per `block_size` x `block_size` block (edge blocks partial)."""
    scale_dtype = TORCH_DTYPES[FP8_WEIGHT_SCALE_DTYPE]
    if block_size is None:
        scales = fp8_scale(weight.abs().amax(dim=1))
        return Fp8Weight(quantize_fp8(weight, scales[:, None]), scales.to(scale_dtype))
    rows, columns = weight.shape
    padded = torch.zeros(-(-rows // block_size) * block_size, -(-columns // block_size) * block_size,
                         dtype=torch.float32, device=weight.device)
    padded[:rows, :columns] = weight.abs()
    blocks = padded.view(padded.shape[0] // block_size, block_size, padded.shape[1] // block_size, block_size)
    scales = fp8_scale(blocks.amax(dim=(1, 3)))
    quantized = Fp8Weight(weight, scales.to(scale_dtype), block_size)
    return Fp8Weight(quantize_fp8(weight, quantized.scale_grid()), quantized.scales, block_size)


def dequantize_fp8_weight(weight: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_fp8(weight.values, weight.scale_grid(), dtype)


@dataclass
class Int4Weight:
    packed: torch.Tensor             # [out, in // 2] uint8
    scales: torch.Tensor             # [out, in // group_size]
    minimums: torch.Tensor | None    # [out, in // group_size]; None for a symmetric grid
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def group_minimums(self) -> torch.Tensor:
        if self.minimums is not None:
            return self.minimums
        return -SYMMETRIC_OFFSET * self.scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 → [out, in // 2] bytes, even index in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _round_to_grid(groups: torch.Tensor, symmetric: bool, clip: float) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest on a grid whose range is clipped by `clip`; returns q, scale, minimum."""
    if symmetric:
        scale = (groups.abs().amax(dim=-1, keepdim=True) * clip / (INT4_LEVELS - SYMMETRIC_OFFSET)).clamp(min=1e-10)
        minimum = -SYMMETRIC_OFFSET * scale
    else:
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        middle = (low + high) / 2
        low, high = middle + (low - middle) * clip, middle + (high - middle) * clip
        scale = ((high - low) / INT4_LEVELS).clamp(min=1e-10)
        minimum = low
    q = ((groups - minimum) / scale).round().clamp(0, INT4_LEVELS)
    return q, scale, minimum


def quantize_int4(weight: torch.Tensor, fmt: WeightFormat, search: bool = False) -> Int4Weight:
    """Group-wise INT4, round-to-nearest. With `search`, each group picks the clipping of its range that
    minimises its squared weight error among `CLIP_SEARCH` (clip 1.0, plain rounding, is a candidate).
    Off by default: on SmolLM2 g64 the smaller weight error gave a worse perplexity (bench/quant.py)."""
    out_features, in_features = weight.shape
    fmt.check_shape(out_features, in_features)
    groups = weight.float().reshape(out_features, in_features // fmt.group_size, fmt.group_size)
    best = None
    for clip in CLIP_SEARCH if search else (1.0,):
        q, scale, minimum = _round_to_grid(groups, fmt.symmetric, clip)
        error = ((q * scale + minimum - groups) ** 2).sum(dim=-1, keepdim=True)
        if best is None:
            best = [q, scale, minimum, error]
            continue
        better = error < best[3]
        best = [torch.where(better, new, old) for new, old in zip((q, scale, minimum, error), best)]
    q, scale, minimum, _ = best
    scale_dtype = TORCH_DTYPES[fmt.scale_dtype]
    return Int4Weight(pack_int4(q.reshape(out_features, in_features)), scale.squeeze(-1).to(scale_dtype),
                      None if fmt.symmetric else minimum.squeeze(-1).to(scale_dtype), fmt.group_size)


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out_features, in_features = weight.shape
    q = unpack_int4(weight.packed).float().reshape(out_features, -1, weight.group_size)
    values = q * weight.scales.float()[..., None] + weight.group_minimums().float()[..., None]
    return values.reshape(out_features, in_features).to(dtype)


GGUF_Q4_1_BLOCK = 32
GGUF_Q4_1_BYTES = 20   # fp16 scale, fp16 minimum, 16 bytes of nibbles


def int4_from_gguf_q4_1(raw: torch.Tensor, out_features: int, in_features: int) -> Int4Weight:
    """GGUF Q4_1 blocks → the engine's g32 asymmetric INT4, moving bits only (no float round trip).

    A Q4_1 block stores element j in the low nibble of byte j and element j + 16 in its high nibble.
    """
    blocks = raw.reshape(out_features, in_features // GGUF_Q4_1_BLOCK, GGUF_Q4_1_BYTES)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    minimums = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(out_features, in_features)
    return Int4Weight(pack_int4(q), scales, minimums, GGUF_Q4_1_BLOCK)
