"""Quantized linear layers and the swap that puts them into a model (primitives live in engine.quant).

Embeddings, norms and the (tied) output head stay in the compute dtype: they are a small part of the
bytes of big models and the most sensitive to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernel_backend import use_triton
from engine.memory import WeightFormat
from engine.quant import (SYMMETRIC_OFFSET, Fp8Weight, Int4Weight, dequantize_fp8_weight, dequantize_int4,
                          quantize_fp8_weight, quantize_int4, unpack_int4)

CPU_INT4_INNER_K_TILES = 2
CPU_INT4_ROW_MULTIPLE = 16     # torch's CPU int4 kernel packs output rows in blocks of 16
CPU_INT4_KERNEL_MAX_ROWS = 32  # beyond this (prefill) the step is compute-bound: dequantize, float matmul
CPU_INT4_ACTIVATIONS = torch.bfloat16   # the CPU kernel is vectorised for bf16 activations only (~30x fp32)
TRITON_MAX_ROWS = 64           # on CUDA, the fused-dequantization GEMMs serve memory-bound (decode) steps


class Int4Linear(nn.Module):
    """W4A16: INT4 weights, activations in the compute dtype.

    On CPU, memory-bound steps (few rows: decode) run torch's int4 kernel (`_weight_int4pack_mm_for_cpu`)
    on bf16 activations; its grid is w = (q - 8) * scale + zero, i.e. zero = minimum + 8 * scale.
    On CUDA, decode steps run the Triton W4A16 kernel. Compute-bound steps (prefill) dequantize to the
    compute dtype and run a float matmul.
    """

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("minimums", weight.minimums)       # None for a symmetric grid
        self._cpu_kernel: tuple[torch.Tensor, torch.Tensor] | None = None   # torch's repacking, made once

    @property
    def weight_int4(self) -> Int4Weight:
        return Int4Weight(self.packed, self.scales, self.minimums, self.group_size)

    def _cpu_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cpu_kernel is None:
            q = unpack_int4(self.packed).to(torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(q, CPU_INT4_INNER_K_TILES)
            zeros = self.weight_int4.group_minimums().float() + SYMMETRIC_OFFSET * self.scales.float()
            scales_and_zeros = torch.stack([self.scales.float(), zeros], dim=-1).transpose(0, 1).contiguous()
            self._cpu_kernel = (packed, scales_and_zeros.to(CPU_INT4_ACTIVATIONS))
        return self._cpu_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if use_triton(x) and flat.shape[0] <= TRITON_MAX_ROWS:
            from kernels.int4_matmul import w4a16_matmul

            weight = self.weight_int4
            out = w4a16_matmul(flat.contiguous(), weight.packed, weight.scales, weight.group_minimums(),
                               self.group_size)
            return out.reshape(*x.shape[:-1], self.out_features)
        if (x.device.type == "cpu" and flat.shape[0] <= CPU_INT4_KERNEL_MAX_ROWS
                and self.out_features % CPU_INT4_ROW_MULTIPLE == 0):
            packed, scales_and_zeros = self._cpu_operands()
            out = torch._weight_int4pack_mm_for_cpu(flat.to(CPU_INT4_ACTIVATIONS), packed, self.group_size,
                                                     scales_and_zeros)
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, dequantize_int4(self.weight_int4, x.dtype))


class Fp8Linear(nn.Module):
    """W8A16: e4m3 weights with a scale per output channel, activations in the compute dtype.

    On CUDA, decode steps run the Triton W8A16 kernel; otherwise the weight is widened for a float matmul.
    """

    def __init__(self, weight: Fp8Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.values.shape
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if use_triton(x) and flat.shape[0] <= TRITON_MAX_ROWS:
            from kernels.fp8_matmul import w8a16_matmul

            out = w8a16_matmul(flat.contiguous(), self.values, self.scales.float())
            return out.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, dequantize_fp8_weight(Fp8Weight(self.values, self.scales), x.dtype))


def fused_rows_limit(weights: str, device_type: str) -> int | None:
    """The most rows a quantized linear serves without widening its weight to the compute dtype; None for
    float weights (never widened). Beyond it each step dequantizes every weight: the profiler counts that
    traffic, since it is what the step really moves."""
    if weights not in ("int4", "fp8", "native"):
        return None
    if device_type == "cuda":
        return TRITON_MAX_ROWS
    return CPU_INT4_KERNEL_MAX_ROWS if weights in ("int4", "native") else 0


def quantize_linear(linear: nn.Linear, fmt: WeightFormat, search: bool = False) -> nn.Module:
    if linear.bias is not None:
        raise ValueError("quantized layers here have no bias; Llama-family linears have none")
    if fmt.dtype == "int4":
        return Int4Linear(quantize_int4(linear.weight.data, fmt, search))
    if fmt.dtype == "fp8":
        return Fp8Linear(quantize_fp8_weight(linear.weight.data))
    raise ValueError(f"{fmt.dtype!r} is not a quantized format")


def quantize_linears(model: nn.Module, fmt: WeightFormat, search: bool = False) -> nn.Module:
    """Replaces every nn.Linear of the decoder layers in place; returns the model. `search` turns on the
    INT4 clipping search (see engine.quant.quantize_int4)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(module, name, quantize_linear(child, fmt, search))
    return model


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's linear weights occupy as stored (packed values, scales, minimums)."""
    total = 0
    for module in model.modules():
        if isinstance(module, (Int4Linear, Fp8Linear)):
            total += sum(b.nbytes for b in module.buffers(recurse=False))
        elif isinstance(module, nn.Linear):
            total += module.weight.nbytes
    return total
