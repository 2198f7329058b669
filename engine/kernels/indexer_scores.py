"""DSA's lightning indexer in Triton, for decodes: every cached token's score for one query row per sequence,

    score(t) = Σ_h w_h · relu(q_h · k_t · scale)

over keys paged like the latents (one per token), FP8 ones dequantized on load with their per-token scale. One
program per (sequence, page): the page's keys are read once for all heads (a [heads, dim] x [dim, page] dot),
and the heads are summed with their weights in registers, so only one float per token is written; the top-k
selection runs on that (`torch.topk`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor, next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAGE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)
MIN_DOT = 16                # tl.dot needs every dimension >= 16


@triton.jit
def _indexer_scores_kernel(q_ptr, weights_ptr, pages_ptr, scales_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                           stride_qb, stride_qh, stride_wb, stride_page, stride_slot, stride_scale_page,
                           stride_tb, stride_ob,
                           NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    index = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, PAGE_SIZE)
    h_ok = h < NUM_HEADS
    d_ok = d < DIM
    length = tl.load(lens_ptr + seq)
    positions = index * PAGE_SIZE + s
    s_ok = positions < length
    q = tl.load(q_ptr + seq * stride_qb + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0)
    head_weights = tl.load(weights_ptr + seq * stride_wb + h, mask=h_ok, other=0.0)
    page = tl.load(tables_ptr + seq * stride_tb + index, mask=index * PAGE_SIZE < length, other=0).to(tl.int64)
    keys = tl.load(pages_ptr + page * stride_page + s[:, None] * stride_slot + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    if FP8:
        keys = keys * tl.load(scales_ptr + page * stride_scale_page + s, mask=s_ok, other=0.0)[:, None]
    scores = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision=PRECISION) * scale                 # [H, PAGE]
    total = tl.sum(tl.maximum(scores, 0.0) * head_weights[:, None], axis=0)
    tl.store(out_ptr + seq * stride_ob + positions, tl.where(s_ok, total, float("-inf")))


def paged_indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, key_pages: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.paged_indexer_scores`; the page size must be a power of two of at
    least 16."""
    device = q.device
    check_tensor("q", q, 3, FLOAT_DTYPES, device)
    check_tensor("head_weights", head_weights, 2, (torch.float32,), device)
    check_tensor("key_pages", key_pages, 3, PAGE_DTYPES, device)
    check_tensor("block_tables", block_tables, 2, (torch.int32, torch.int64), device)
    check_tensor("context_lens", context_lens, 1, (torch.int32, torch.int64), device)
    batch, num_heads, dim = q.shape
    _, page_size, key_dim = key_pages.shape
    check(key_dim == dim, f"query dim ({dim}) and key dim ({key_dim}) differ")
    check(tuple(head_weights.shape) == (batch, num_heads),
          f"head_weights must be [{batch}, {num_heads}], got {tuple(head_weights.shape)}")
    check(page_size >= MIN_DOT and page_size & (page_size - 1) == 0,
          f"page size must be a power of two of at least {MIN_DOT}, got {page_size}")
    check(block_tables.shape[0] == batch and context_lens.shape[0] == batch,
          f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} must cover "
          f"the batch of {batch}")
    fp8 = key_pages.dtype == torch.float8_e4m3fn
    check(fp8 == (key_scales is not None), "FP8 key pages need their per-token scales; float pages take none")
    if fp8:
        check_tensor("key_scales", key_scales, 2, (torch.float32,), device)
        check(tuple(key_scales.shape) == tuple(key_pages.shape[:2]),
              f"key_scales must be [{key_pages.shape[0]}, {page_size}], got {tuple(key_scales.shape)}")
    max_pages = block_tables.shape[1]
    out = torch.empty(batch, max_pages * page_size, dtype=torch.float32, device=device)
    _indexer_scores_kernel[(batch, max_pages)](
        q, head_weights, key_pages, key_scales if fp8 else out, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), head_weights.stride(0), key_pages.stride(0), key_pages.stride(1),
        key_scales.stride(0) if fp8 else 0, block_tables.stride(0), out.stride(0),
        NUM_HEADS=num_heads, BLOCK_H=max(MIN_DOT, next_power_of_2(num_heads)), DIM=dim,
        BLOCK_D=max(MIN_DOT, next_power_of_2(dim)), PAGE_SIZE=page_size, FP8=fp8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")      # fp32 queries keep full precision
    return out
