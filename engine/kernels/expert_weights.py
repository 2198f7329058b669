"""How a layer's routed experts are stacked for the grouped GEMM (`engine.kernels.fused_moe`); Triton-free, so that
the model's layers can describe their experts without loading the compiler."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT, INT4, FP8_CHANNEL, FP8_BLOCK = 0, 1, 2, 3


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of a layer's routed experts, stacked [experts, N, ...]: float [experts, N, K]; INT4 packed
    [experts, N, K / 2] with `scales` and `minimums` [experts, N, K / group_size], or for a symmetric grid no minimums
    but `symmetric_offset` (each group's minimum is -offset x its scale, made in registers: a stack of them would
    cost as much memory as the scales, and making it every step as much work); FP8 [experts, N, K] with `scales` per
    channel [experts, N] or, with `block_size`, per block [experts, N / block, K / block]."""

    weights: torch.Tensor
    scales: torch.Tensor | None = None
    minimums: torch.Tensor | None = None
    group_size: int = 0
    block_size: int = 0
    symmetric_offset: int = 0

    @property
    def kind(self) -> int:
        if self.scales is None:
            return FLOAT
        if self.weights.dtype == torch.uint8:
            return INT4
        return FP8_BLOCK if self.block_size else FP8_CHANNEL
