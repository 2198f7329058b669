"""Paged MLA decode over DSA-selected tokens in Triton: as `engine.kernels.mla_decode`, every head of a block attends
over the same latent rows, but the rows are the sequence's selected positions (at most `index_topk`, gathered
through its block table) rather than its whole context, so the cost stops growing with the context.

One program per (sequence, block of heads, split of the selection) walks its share of the selection in blocks of
16 positions with an online softmax; -1 pads are masked; the splits' partials are merged as in
`engine.kernels.split_context` (flash-decoding over the 2048 selected tokens, not 16 programs a batch-1 layer).
FP8 rows are dequantized on load with the layer's two scales (latent, rope key).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check_tensor, next_power_of_2
from engine.kernels.mla_decode import BLOCK_HEADS, MIN_DOT, TARGET_PROGRAMS, check_mla_call
from engine.kernels.split_context import merge_splits, store_result

BLOCK_SELECTED = 16


@triton.jit
def _sparse_mla_decode_kernel(q_ptr, pages_ptr, tables_ptr, positions_ptr, out_ptr, part_max_ptr, part_sum_ptr,
                              scales_ptr, scale, num_selected, split_size,
                              stride_qb, stride_qh, stride_page, stride_slot, stride_tb, stride_pb, stride_ob,
                              stride_oh, stride_xb, stride_xh,
                              NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LATENT: tl.constexpr,
                              BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_P: tl.constexpr,
                              BLOCK_K: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr,
                              PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    k = tl.arange(0, BLOCK_K)
    h_ok = heads < NUM_HEADS
    r_ok = r < LATENT
    p_ok = p < ROPE
    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    q_latent = tl.load(q_rows + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_rope = tl.load(q_rows + LATENT + p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    if FP8:
        latent_scale = tl.load(scales_ptr)
        rope_scale = tl.load(scales_ptr + 1)
    else:
        latent_scale = 1.0
        rope_scale = 1.0
    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(split * split_size, tl.minimum((split + 1) * split_size, num_selected), BLOCK_K):
        position = tl.load(positions_ptr + seq * stride_pb + start + k, mask=start + k < num_selected, other=-1)
        k_ok = position >= 0
        position = tl.where(k_ok, position, 0)
        page = tl.load(tables_ptr + seq * stride_tb + position // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        rows = pages_ptr + page[:, None] * stride_page + (position % PAGE_SIZE)[:, None] * stride_slot
        latent = tl.load(rows + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        rope = tl.load(rows + LATENT + p[None, :], mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        latent = (latent.to(tl.float32) * latent_scale).to(q_latent.dtype)
        rope = (rope.to(tl.float32) * rope_scale).to(q_rope.dtype)
        scores = (tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
                  + tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION))                     # [H, BLOCK_K]
        scores = tl.where(k_ok[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)      # a block of pads only: nothing to add
        correction = tl.exp(running_max - shift)
        weights = tl.exp(scores - shift[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights.to(latent.dtype), latent, input_precision=PRECISION)
        running_max = new_max
    # a split of pads only leaves a partial of maximum -inf and sum 0, which the merge weighs as nothing
    store_result(out_ptr, part_max_ptr, part_sum_ptr, seq, heads, h_ok, split, r, r_ok, running_max, running_sum, acc,
                 stride_xb, stride_xh, stride_ob, stride_oh, LATENT, SPLIT)


def sparse_mla_decode(q: torch.Tensor, latent_pages: torch.Tensor, block_tables: torch.Tensor,
                      positions: torch.Tensor, scale: float, latent_dim: int,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.sparse_mla_decode`; the page size a power of two of at least 16."""
    check_tensor("block_tables", block_tables, 2, (torch.int32, torch.int64), q.device)
    check_tensor("positions", positions, 2, (torch.int32, torch.int64), q.device)
    fp8 = check_mla_call(q, latent_pages, latent_dim, scales, {"block_tables": block_tables, "positions": positions})
    batch, num_heads, width = q.shape
    page_size = latent_pages.shape[1]
    rope_dim = width - latent_dim
    out = torch.empty(batch, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    head_blocks = triton.cdiv(num_heads, BLOCK_HEADS)
    num_selected = positions.shape[1]
    blocks = max(triton.cdiv(num_selected, BLOCK_SELECTED), 1)
    splits = max(1, min(blocks, TARGET_PROGRAMS // (batch * head_blocks)))
    split_size = triton.cdiv(blocks, splits) * BLOCK_SELECTED
    splits = max(1, triton.cdiv(num_selected, split_size))
    target = part_max = part_sum = out
    if splits > 1:
        part_max = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        target = torch.empty(batch, num_heads, splits, latent_dim, dtype=torch.float32, device=q.device)
    _sparse_mla_decode_kernel[(batch, head_blocks, splits)](
        q, latent_pages, block_tables, positions, target, part_max, part_sum, scales if fp8 else out, scale,
        num_selected, split_size, q.stride(0), q.stride(1), latent_pages.stride(0), latent_pages.stride(1),
        block_tables.stride(0), positions.stride(0), out.stride(0), out.stride(1), num_heads * splits, splits,
        NUM_HEADS=num_heads, BLOCK_H=BLOCK_HEADS, LATENT=latent_dim,
        BLOCK_R=max(MIN_DOT, next_power_of_2(latent_dim)), ROPE=rope_dim,
        BLOCK_P=max(MIN_DOT, next_power_of_2(rope_dim)), BLOCK_K=BLOCK_SELECTED, PAGE_SIZE=page_size, FP8=fp8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=splits > 1)   # fp32 queries: full precision
    if splits > 1:
        merge_splits(target, part_max, part_sum, None, out)
    return out
