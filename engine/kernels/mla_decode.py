"""Paged MLA decode in Triton, absorbed form: every head attends over the same latent rows.

A cache row is [latent (kv_lora_rank) | rope key (qk_rope_head_dim)]; a head's query is [W_UKᵀ q_nope |
q_rope] of the same width, and the output is the softmax-weighted sum of the latents (W_UV is applied
after). One program per (sequence, block of heads, split of the context) walks its pages with an online
softmax: the page is read once for all the heads of the block, which is what makes MLA decode cheap (one row
of 576 elements per token for 64 or 128 heads); the splits' partials are merged as in
`engine.kernels.split_context` (flash-decoding), fewer of them than for GQA since each carries 512-wide rows
per head. FP8 pages are dequantized on load with the layer's two scales (latent, rope key), so no dequantized
copy of the cache is written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor, next_power_of_2
from engine.kernels.split_context import merge_splits, split_pages_for, store_result

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAGE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)
MIN_DOT = 16                # tl.dot needs every dimension >= 16
BLOCK_HEADS = 16
TARGET_PROGRAMS = 1024      # (sequence, head block, split) programs: each split's partial is a 512-wide row a head


@triton.jit
def _mla_decode_kernel(q_ptr, pages_ptr, tables_ptr, lens_ptr, out_ptr, part_max_ptr, part_sum_ptr, scales_ptr,
                       scale, split_pages, stride_qb, stride_qh, stride_page, stride_slot, stride_tb, stride_ob,
                       stride_oh, stride_pb, stride_ph,
                       NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LATENT: tl.constexpr,
                       BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_P: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    first = split * split_pages
    last = tl.minimum(first + split_pages, tl.cdiv(length, PAGE_SIZE))
    if first >= last:                   # past the context: nothing to do, the merge does not read it
        return
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    s = tl.arange(0, PAGE_SIZE)
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
    for index in range(first, last):
        page = tl.load(tables_ptr + seq * stride_tb + index).to(tl.int64)
        s_ok = index * PAGE_SIZE + s < length
        rows = pages_ptr + page * stride_page + s[:, None] * stride_slot
        latent = tl.load(rows + r[None, :], mask=s_ok[:, None] & r_ok[None, :], other=0.0)
        rope = tl.load(rows + LATENT + p[None, :], mask=s_ok[:, None] & p_ok[None, :], other=0.0)
        latent = (latent.to(tl.float32) * latent_scale).to(q_latent.dtype)
        rope = (rope.to(tl.float32) * rope_scale).to(q_rope.dtype)
        scores = (tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
                  + tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION))                   # [H, PAGE]
        scores = tl.where(s_ok[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights.to(latent.dtype), latent, input_precision=PRECISION)
        running_max = new_max
    store_result(out_ptr, part_max_ptr, part_sum_ptr, seq, heads, h_ok, split, r, r_ok, running_max, running_sum, acc,
                 stride_pb, stride_ph, stride_ob, stride_oh, LATENT, SPLIT)


def check_mla_call(q: torch.Tensor, latent_pages: torch.Tensor, latent_dim: int, scales: torch.Tensor | None,
                   per_sequence: dict[str, torch.Tensor]) -> bool:
    """The checks both MLA decode kernels make (the page size a power of two of at least 16); `per_sequence`
    names the tensors with one row per sequence. Returns whether the pages are FP8."""
    device = q.device
    check_tensor("q", q, 3, FLOAT_DTYPES, device)
    check_tensor("latent_pages", latent_pages, 3, PAGE_DTYPES, device)
    for name, tensor in per_sequence.items():
        check_tensor(name, tensor, tensor.dim(), (torch.int32, torch.int64), device)
    batch, _, width = q.shape
    _, page_size, row_width = latent_pages.shape
    check(row_width == width, f"query width ({width}) and cache rows ({row_width}) differ")
    check(0 < latent_dim < width, f"latent_dim must be in 1..{width - 1}, got {latent_dim}")
    check(page_size >= MIN_DOT and page_size & (page_size - 1) == 0,
          f"page size must be a power of two of at least {MIN_DOT}, got {page_size}")
    check(all(tensor.shape[0] == batch for tensor in per_sequence.values()),
          " and ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in per_sequence.items())
          + f" must cover the batch of {batch}")
    fp8 = latent_pages.dtype == torch.float8_e4m3fn
    check(fp8 == (scales is not None), "FP8 pages need their two scales (latent, rope key); float pages take none")
    if fp8:
        check_tensor("scales", scales, 1, (torch.float32,), device)
        check(scales.shape[0] == 2, f"scales needs 2 entries (latent, rope key), got {scales.shape[0]}")
    return fp8


def paged_mla_decode(q: torch.Tensor, latent_pages: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, latent_dim: int,
                     scales: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.paged_mla_decode`; every context length must be >= 1 and the
    page size a power of two of at least 16."""
    check_tensor("block_tables", block_tables, 2, (torch.int32, torch.int64), q.device)
    check_tensor("context_lens", context_lens, 1, (torch.int32, torch.int64), q.device)
    fp8 = check_mla_call(q, latent_pages, latent_dim, scales,
                         {"block_tables": block_tables, "context_lens": context_lens})
    batch, num_heads, width = q.shape
    page_size = latent_pages.shape[1]
    rope_dim = width - latent_dim
    out = torch.empty(batch, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    head_blocks = triton.cdiv(num_heads, BLOCK_HEADS)
    table_pages = max(block_tables.shape[1], 1)
    split_pages = split_pages_for(batch, head_blocks, table_pages, TARGET_PROGRAMS)
    splits = triton.cdiv(table_pages, split_pages)
    target = out
    part_max = part_sum = out
    if splits > 1:
        part_max = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        target = torch.empty(batch, num_heads, splits, latent_dim, dtype=torch.float32, device=q.device)
    _mla_decode_kernel[(batch, head_blocks, splits)](
        q, latent_pages, block_tables, context_lens, target, part_max, part_sum, scales if fp8 else out, scale,
        split_pages, q.stride(0), q.stride(1), latent_pages.stride(0), latent_pages.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), num_heads * splits, splits,
        NUM_HEADS=num_heads, BLOCK_H=BLOCK_HEADS, LATENT=latent_dim,
        BLOCK_R=max(MIN_DOT, next_power_of_2(latent_dim)), ROPE=rope_dim,
        BLOCK_P=max(MIN_DOT, next_power_of_2(rope_dim)), PAGE_SIZE=page_size, FP8=fp8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=splits > 1)   # fp32 queries: full precision
    if splits > 1:
        merge_splits(target, part_max, part_sum, context_lens, out, split_pages, page_size)
    return out
