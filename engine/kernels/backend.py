"""Which implementation runs a kernel: Triton on CUDA; on CPU torch, unless the Triton kernels are asked
for (KVPLAN_KERNELS=triton, with TRITON_INTERPRET=1), which lets CPU tests run the engine's GPU path."""
from __future__ import annotations

import os

import torch

ENV_VARIABLE = "KVPLAN_KERNELS"


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or os.environ.get(ENV_VARIABLE) == "triton"
