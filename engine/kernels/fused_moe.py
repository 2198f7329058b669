"""Routed experts as one grouped GEMM in Triton, instead of a loop over the experts a step touches.

A step's (token, slot) pairs are sorted by expert on the device and each expert's run padded to a multiple of
BLOCK_M (`align_pairs`, no host read: the grid is sized for the worst case and blocks past the used ones exit).
One program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows: it reads the block's expert, gathers its rows
of A (a token's hidden state, or a pair's own row for the down projection) and streams that expert's weights, float,
INT4 (dequantized group-wise in registers) or FP8 (scaled per channel, or per 128 x 128 block as DeepSeek ships
them), into tl.dot. Rows of pairs routed elsewhere (expert parallelism)
stay zero. Gate-up, activation, down, then each token's weighted sum: `fused_experts`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor
from engine.kernels.expert_weights import FP8_BLOCK, INT4, ExpertWeights
from engine.kernels.tuning import launch_config

BLOCK_M = 16
BLOCK_K = 32
def align_pairs(ids: torch.Tensor, first_expert: int, num_experts: int,
                block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, top_k] → (the pair indices t·top_k + slot sorted by expert, each expert's run padded with -1 to a
    multiple of `block_m`; and each block's expert, -1 past the used blocks). Pairs of experts outside
    [first_expert, first_expert + num_experts) are left out. Sized for the worst case, read nowhere on the host."""
    device = ids.device
    pairs = ids.numel()
    local = ids.flatten().long() - first_expert
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)       # elsewhere: bucket E
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key))               # not bincount: on CUDA it reads the largest key back first
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded                   # each expert's first padded row
    run_starts = torch.cumsum(counts, 0) - counts               # each expert's first row in the sorted order
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(pairs, device=device) - run_starts[sorted_key]
    capacity = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    local_pair = sorted_key < num_experts
    destination = torch.where(local_pair, starts[torch.clamp(sorted_key, max=num_experts - 1)] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), -1, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, destination, order)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(torch.cumsum(padded, 0), block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs[:capacity], block_experts


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, scales_ptr, minimums_ptr, c_ptr, pairs_ptr, experts_ptr, N, K, top_k,
                         stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm,
                         PER_PAIR: tl.constexpr, KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, OFFSET: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pairs >= 0
        pairs = tl.where(row_ok, pairs, 0)
        rows = pairs if PER_PAIR else pairs // top_k
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            weight_mask = col_ok[:, None] & k_ok[None, :]
            if KIND == 1:           # INT4
                packed = tl.load(b_ptr + expert * stride_be + cols[:, None] * stride_bn + k[None, :] // 2,
                                 mask=weight_mask, other=0)
                q = (packed >> ((k[None, :] % 2) * 4).to(tl.uint8)) & 0x0F
                group = k0 // GROUP_SIZE
                scale = tl.load(scales_ptr + expert * stride_se + cols * stride_sn + group, mask=col_ok,
                                other=0.0).to(tl.float32)
                if OFFSET:          # a symmetric grid: the minimum is -OFFSET x the scale
                    minimum = -OFFSET * scale
                else:
                    minimum = tl.load(minimums_ptr + expert * stride_se + cols * stride_sn + group, mask=col_ok,
                                      other=0.0).to(tl.float32)
                b = q.to(tl.float32) * scale[:, None] + minimum[:, None]
            elif KIND == 3:         # FP8, a scale per GROUP_SIZE x GROUP_SIZE block
                b = tl.load(b_ptr + expert * stride_be + cols[:, None] * stride_bn + k[None, :], mask=weight_mask,
                            other=0.0).to(tl.float32)
                scale = tl.load(scales_ptr + expert * stride_se + (cols // GROUP_SIZE) * stride_sn + k0 // GROUP_SIZE,
                                mask=col_ok, other=0.0).to(tl.float32)
                b = b * scale[:, None]
            else:                   # float, or FP8 with its channel scale applied once at the end
                b = tl.load(b_ptr + expert * stride_be + cols[:, None] * stride_bn + k[None, :], mask=weight_mask,
                            other=0.0).to(tl.float32)
            acc += tl.dot(a, tl.trans(b.to(a.dtype)))
        if KIND == 2:
            acc *= tl.load(scales_ptr + expert * stride_se + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm(a: torch.Tensor, stack: ExpertWeights, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
                 num_pairs: int, top_k: int, per_pair: bool) -> torch.Tensor:
    """C [num_pairs, N]: row p = A[p if per_pair else p // top_k] @ W[expert of p]ᵀ, for the pairs `align_pairs`
    sorted (others zero)."""
    device = a.device
    check_tensor("a", a, 2, (torch.float32, torch.float16, torch.bfloat16), device)
    weights, scales, kind = stack.weights, stack.scales, stack.kind
    check(a.stride(1) == 1 and weights.stride(2) == 1, "a and the weights must be row-major")
    n, k = weights.shape[1], a.shape[1]
    group = BLOCK_K
    if kind == INT4:
        group = stack.group_size
        check(weights.shape[2] * 2 == k, f"packed weights cover K={weights.shape[2] * 2}, a has K={k}")
        check(group % BLOCK_K == 0 and k % group == 0, f"group size {group} must divide K={k} and be a multiple of "
                                                       f"{BLOCK_K}")
        check((stack.minimums is None) == bool(stack.symmetric_offset),
              "INT4 experts need minimums, or a symmetric grid's offset (not both)")
        check(stack.minimums is None or scales.stride() == stack.minimums.stride(),
              "scales and minimums must share strides")
    else:
        check(weights.shape[2] == k, f"weights have K={weights.shape[2]}, a has K={k}")
    if kind == FP8_BLOCK:
        group = stack.block_size
        check(group % BLOCK_K == 0, f"FP8 block {group} must be a multiple of {BLOCK_K}")
    out = torch.zeros(num_pairs, n, dtype=a.dtype, device=device)
    config = launch_config("grouped_gemm", "int4" if kind == INT4 else "fp8" if weights.element_size() == 1 else
                           "float", device)
    grid = (block_experts.shape[0], triton.cdiv(n, config["block_n"]))
    _grouped_gemm_kernel[grid](
        a, weights, weights if scales is None else scales,
        stack.minimums if kind == INT4 and stack.minimums is not None else weights, out,
        sorted_pairs, block_experts, n, k, top_k, a.stride(0), weights.stride(0), weights.stride(1),
        0 if scales is None else scales.stride(0), 0 if scales is None or scales.dim() < 2 else scales.stride(1),
        out.stride(0), PER_PAIR=per_pair, KIND=kind, GROUP_SIZE=group,
        OFFSET=stack.symmetric_offset if kind == INT4 else 0, BLOCK_M=BLOCK_M, BLOCK_N=config["block_n"],
        BLOCK_K=BLOCK_K, num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first_expert: int, num_experts: int,
                  gate_up: ExpertWeights, down: ExpertWeights) -> torch.Tensor:
    """The weighted sum of each token's routed experts [T, hidden] (SwiGLU: gate and up fused), as
    `engine.model.layers.moe.GroupedExperts.forward`."""
    tokens, top_k = ids.shape
    sorted_pairs, block_experts = align_pairs(ids, first_expert, num_experts)
    pairs = tokens * top_k

    def gemm(a: torch.Tensor, stack: ExpertWeights, per_pair: bool) -> torch.Tensor:
        return grouped_gemm(a, stack, sorted_pairs, block_experts, pairs, top_k, per_pair)

    gate, up = gemm(x, gate_up, per_pair=False).chunk(2, dim=-1)
    out = gemm(torch.nn.functional.silu(gate) * up, down, per_pair=True)
    local = ids.long() - first_expert
    mine = ((local >= 0) & (local < num_experts)).to(x.dtype)
    return (out.view(tokens, top_k, -1) * (weights.to(x.dtype) * mine)[..., None]).sum(dim=1)
