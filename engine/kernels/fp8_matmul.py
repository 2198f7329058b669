"""W8A16 GEMM in Triton: x [M, K] @ W^T with W stored as e4m3 and one scale per output channel.

The weight tile is widened to x's dtype in registers; the channel scale multiplies the fp32
accumulator once at the end, so the loop moves one byte per weight. For decode's few rows K is split over
programs too (split-K, as `engine.kernels.int4_matmul`), their fp32 partials summed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor
from engine.kernels.int4_matmul import ACTIVATION_DTYPES, split_k_for
from engine.kernels.tuning import launch_config, rows_bucket


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scales_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
                  stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    scale = tl.load(scales_ptr + cols, mask=col_ok, other=0.0)
    acc = acc * scale[None, :]
    tl.store(out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def w8a16_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.w8a16_matmul`. Tiles and warps from `engine.kernels.tuning`;
    `split_k`: programs sharing K (default `split_k_for`)."""
    device = x.device
    check_tensor("x", x, 2, ACTIVATION_DTYPES, device)
    check_tensor("values", values, 2, (torch.float8_e4m3fn,), device)
    check_tensor("scales", scales, 1, (torch.float32,), device)
    m, k = x.shape
    n = values.shape[0]
    check(values.shape[1] == k, f"weight has K={values.shape[1]}, x has K={k}")
    check(scales.shape[0] == n, f"{scales.shape[0]} scales for {n} output channels")
    config = launch_config("w8a16", rows_bucket(m), device)
    block_m, block_n, block_k = config["block_m"], config["block_n"], config["block_k"]
    blocks = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = split_k_for(m, n, k, block_m, block_n, block_k, config["target_programs"])
    check(isinstance(split_k, int) and 1 <= split_k <= blocks, f"split_k must be in 1..{blocks}, got {split_k!r}")
    k_per_split = triton.cdiv(blocks, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty((split_k, m, n), dtype=x.dtype if split_k == 1 else torch.float32, device=device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w8a16_kernel[grid](x, values, scales, out, m, n, k, k_per_split, x.stride(0), values.stride(0), out.stride(1),
                        out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out[0] if split_k == 1 else out.sum(dim=0).to(x.dtype)
