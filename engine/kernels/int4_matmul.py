"""W4A16 GEMM in Triton: x [M, K] @ W^T with W stored as INT4, dequantized group-wise inside the loop.

Each program computes a [BLOCK_M, BLOCK_N] tile over its share of K; per K block it loads the packed bytes (each
byte serves two k), the group's scale and minimum, dequantizes in registers and feeds tl.dot in x's dtype,
accumulating in fp32. Only the packed bytes cross memory: that is the whole point at small M. A decode step has
one to a few rows, so the tiles of N alone are few programs (64 for N=4096, each streaming all of K: 207 us for
4096 x 4096 on an H200, 27 GB/s); K is then split over programs too (split-K), whose fp32 partials are summed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor
from engine.kernels.tuning import launch_config, rows_bucket

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _w4a16_kernel(x_ptr, packed_ptr, scales_ptr, minimums_ptr, out_ptr, M, N, K, k_per_split,
                  stride_xm, stride_pn, stride_sn, stride_om, stride_os,
                  GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, OFFSET: tl.constexpr):
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
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None], other=0.0)
        packed = tl.load(packed_ptr + cols[:, None] * stride_pn + (k[None, :] // 2), mask=col_ok[:, None], other=0)
        q = (packed >> ((k[None, :] % 2) * 4).to(tl.uint8)) & 0x0F                          # [BLOCK_N, BLOCK_K]
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + cols * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
        if OFFSET:                      # a symmetric grid: the minimum is -OFFSET x the scale
            minimum = -OFFSET * scale
        else:
            minimum = tl.load(minimums_ptr + cols * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale[:, None] + minimum[:, None]
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def split_k_for(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, target_programs: int) -> int:
    """How many programs share K: enough to reach `target_programs` with the tiles of M and N, each still a whole
    number of K blocks."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return max(1, min(target_programs // tiles, triton.cdiv(k, block_k)))


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                 group_size: int, block_m: int | None = None, block_n: int | None = None,
                 split_k: int | None = None, symmetric_offset: int = 0) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.w4a16_matmul`. K must be a multiple of the group size. A
    symmetric grid gives no `minimums` but its `symmetric_offset` (each minimum is -offset x its scale, made in
    registers rather than as a tensor every call). Tiles, warps and the programs split-K aims at come from
    `engine.kernels.tuning` unless given; `split_k`: programs sharing K (default `split_k_for`; their fp32 partials
    are summed)."""
    device = x.device
    check_tensor("x", x, 2, ACTIVATION_DTYPES, device)
    check_tensor("packed", packed, 2, (torch.uint8,), device)
    check_tensor("scales", scales, 2, SCALE_DTYPES, device)
    check((minimums is None) == bool(symmetric_offset), "give minimums, or a symmetric grid's offset (not both)")
    if minimums is not None:
        check_tensor("minimums", minimums, 2, SCALE_DTYPES, device)
        check(minimums.shape == scales.shape and scales.stride() == minimums.stride(),
              f"minimums {tuple(minimums.shape)} must match scales {tuple(scales.shape)}, strides too")
    m, k = x.shape
    n = packed.shape[0]
    check(packed.shape[1] * 2 == k, f"packed weight covers K={packed.shape[1] * 2}, x has K={k}")
    check(group_size in (32, 64, 128) and k % group_size == 0, f"group size {group_size} does not divide K={k}")
    check(tuple(scales.shape) == (n, k // group_size), f"scales must be {(n, k // group_size)}, got "
                                                       f"{tuple(scales.shape)}")
    config = launch_config("w4a16", rows_bucket(m), device)
    block_m, block_n = block_m or config["block_m"], block_n or config["block_n"]
    block_k = min(group_size, 64)
    blocks = k // block_k
    if split_k is None:
        split_k = split_k_for(m, n, k, block_m, block_n, block_k, config["target_programs"])
    check(isinstance(split_k, int) and 1 <= split_k <= blocks, f"split_k must be in 1..{blocks}, got {split_k!r}")
    k_per_split = triton.cdiv(blocks, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)           # the splits that have K left
    out = torch.empty((split_k, m, n), dtype=x.dtype if split_k == 1 else torch.float32, device=device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w4a16_kernel[grid](x, packed, scales, scales if minimums is None else minimums, out, m, n, k, k_per_split,
                        x.stride(0), packed.stride(0), scales.stride(0), out.stride(1), out.stride(0),
                        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        OFFSET=symmetric_offset, num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out[0] if split_k == 1 else out.sum(dim=0).to(x.dtype)
