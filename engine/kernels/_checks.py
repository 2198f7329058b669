"""Argument checks shared by the kernel wrappers: a wrong call fails here with a clear message, never
inside a kernel with a wrong answer."""
from __future__ import annotations

import torch


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_tensor(name: str, tensor: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...],
                 device: torch.device) -> None:
    check(tensor.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    check(tensor.dtype in dtypes, f"{name} must be one of {[str(d) for d in dtypes]}, got {tensor.dtype}")
    check(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")
    check(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dimension, strides {tensor.stride()}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
