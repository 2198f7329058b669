"""Paged decode attention in Triton: one query per sequence, K/V read through the block table.

The context is split across programs (flash-decoding): program (sequence, KV head, split) walks its share of the
sequence's pages with an online softmax, the query heads that share the KV head (GQA) together, and writes its
partial maximum, sum and weighted values; a second kernel merges the splits of each (sequence, head). A short
batch then still fills the device: at batch 1, 8 KV heads and 512 tokens, one program per KV head left 8 programs
streaming a page at a time (0.11 ms a layer on an H200, 19 GB/s). The grid depends on the batch and the block
table's width only, never on the context lengths, so a CUDA graph replays it for any lengths. FP8 pages are
dequantized on load with the KV head's scale, so no dequantized copy of the cache is ever written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor, next_power_of_2
from engine.kernels.split_context import merge_splits, split_pages_for, store_result
from engine.kernels.tuning import launch_config

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAGE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_max_ptr, part_sum_ptr,
                         k_scale_ptr, v_scale_ptr, scale, split_pages,
                         stride_qb, stride_qh, stride_page, stride_slot, stride_kvh, stride_tb,
                         stride_ob, stride_oh, stride_pb, stride_ph,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    first = split * split_pages
    last = tl.minimum(first + split_pages, tl.cdiv(length, PAGE_SIZE))
    if first < last:                    # splits past the context have nothing to do (the merge skips them)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        s = tl.arange(0, PAGE_SIZE)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if FP8:
            k_scale = tl.load(k_scale_ptr + kv_head)
            v_scale = tl.load(v_scale_ptr + kv_head)
        else:
            k_scale = 1.0
            v_scale = 1.0
        running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for p in range(first, last):
            page = tl.load(tables_ptr + seq * stride_tb + p).to(tl.int64)
            s_ok = p * PAGE_SIZE + s < length
            offsets = page * stride_page + s[:, None] * stride_slot + kv_head * stride_kvh + d[None, :]
            tile_mask = s_ok[:, None] & d_ok[None, :]
            keys = tl.load(k_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32) * k_scale
            scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale                  # [G, PAGE]
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(weights, axis=1)
            values = tl.load(v_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32) * v_scale
            acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
            running_max = new_max
        store_result(out_ptr, part_max_ptr, part_sum_ptr, seq, heads, g_ok, split, d, d_ok, running_max, running_sum,
                     acc, stride_pb, stride_ph, stride_ob, stride_oh, HEAD_DIM, SPLIT)


def paged_decode_attention(q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.paged_decode_attention`; every context length must be >= 1."""
    device = q.device
    check_tensor("q", q, 3, FLOAT_DTYPES, device)
    check_tensor("key_pages", key_pages, 4, PAGE_DTYPES, device)
    check_tensor("value_pages", value_pages, 4, PAGE_DTYPES, device)
    check_tensor("block_tables", block_tables, 2, (torch.int32, torch.int64), device)
    check_tensor("context_lens", context_lens, 1, (torch.int32, torch.int64), device)
    check(key_pages.shape == value_pages.shape and key_pages.stride() == value_pages.stride(),
          f"key and value pages differ: {tuple(key_pages.shape)} vs {tuple(value_pages.shape)}")
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, page_head_dim = key_pages.shape
    check(page_head_dim == head_dim, f"head_dim of q ({head_dim}) and pages ({page_head_dim}) differ")
    check(num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check(page_size & (page_size - 1) == 0, f"page size must be a power of two, got {page_size}")
    check(block_tables.shape[0] == batch and context_lens.shape[0] == batch,
          f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} must cover "
          f"the batch of {batch}")
    fp8 = key_pages.dtype == torch.float8_e4m3fn
    check(fp8 == (k_scales is not None) == (v_scales is not None),
          "FP8 pages need k_scales and v_scales; float pages take none")
    if fp8:
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            check_tensor(name, scales, 1, (torch.float32,), device)
            check(scales.shape[0] == num_kv_heads, f"{name} needs {num_kv_heads} entries, got {scales.shape[0]}")
    dummy = torch.ones(1, dtype=torch.float32, device=device)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    table_pages = max(block_tables.shape[1], 1)
    config = launch_config("paged_decode", "fp8" if fp8 else "float", device)
    split_pages = split_pages_for(batch, num_kv_heads, table_pages, config["target_programs"])
    splits = -(-table_pages // split_pages)
    constants = dict(HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), PAGE_SIZE=page_size)
    if splits > 1:
        part_max = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=device)
        target = part_acc
    else:
        part_max = part_sum = dummy
        target = out
    _paged_decode_kernel[(batch, num_kv_heads, splits)](
        q, key_pages, value_pages, block_tables, context_lens, target, part_max, part_sum,
        k_scales if fp8 else dummy, v_scales if fp8 else dummy, scale, split_pages,
        q.stride(0), q.stride(1), key_pages.stride(0), key_pages.stride(1), key_pages.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_heads * splits, splits,
        GROUP=group, BLOCK_G=next_power_of_2(group), FP8=fp8, SPLIT=splits > 1, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **constants)
    if splits > 1:
        merge_splits(part_acc, part_max, part_sum, context_lens, out, split_pages, page_size)
    return out
