"""The float matmul every dense linear layer, expert and output head of the engine runs through.

On CPU, MKL multiplies a few fp32 rows by a wide weight (`x @ Wᵀ`, what `F.linear` asks for) poorly over
several threads, while the same product asked as `(W @ xᵀ)ᵀ` splits over the weight's rows. On a 2-core AMD
EPYC VM with two threads: Kimi's 4096 x 7168 expert at 16 rows 17.9 ms against 12.6 ms, at 64 rows 33.7 ms
against 28.6 ms, SmolLM2's 3072 x 576 at 16 rows 0.79 against 0.53 ms; past ~64 rows `F.linear` wins
(SmolLM2's layers at 256 rows 0.87-0.96x). With one thread the two orders run within +-10% of each other
either way, and bf16 runs 0.7-0.9x as `(W @ xᵀ)ᵀ`, so both keep `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]ᵀ → [..., out]."""
    flat = x.reshape(-1, weight.shape[1])
    if (x.device.type == "cpu" and x.dtype == torch.float32 and 1 < flat.shape[0] <= SKINNY_MAX_ROWS
            and torch.get_num_threads() > 1):
        return torch.mm(weight, flat.t()).t().contiguous().reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight as a float matrix, however it is stored (a quantized layer dequantizes its own):
    for code that multiplies by the matrix itself (MLA's absorbed decode folds kv_b_proj into the queries)."""
    dequantized = getattr(layer, "dense_weight", None)
    return dequantized(dtype) if dequantized is not None else layer.weight.to(dtype)


class Linear(nn.Linear):
    """A bias-free `nn.Linear` (the families served have no biases) that multiplies through `linear`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
