"""Pure-torch paged attention: reads K/V through block tables, never from a per-sequence cache.

A step's tokens are laid out flat, decodes first (one query row each), then the prefill chunks:

    rows:   [d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1]
             decodes    prefill chunk 0  prefill chunk 1

Decodes run as one batched attention over their padded block tables; each prefill chunk runs on its
own with a causal mask offset by the tokens it already has in the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.backend import use_triton
from engine.model.kv_cache import PagedKVCache


@dataclass(frozen=True)
class PrefillChunk:
    row_start: int                  # first row of the chunk in the flat batch
    num_tokens: int                 # query rows of the chunk
    context_len: int                # tokens in the cache after this step, the chunk's included
    block_table: torch.Tensor       # pages covering context_len, int64
    causal_mask: torch.Tensor | None  # [num_tokens, context_len]; None when the chunk is the whole context


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step by the runner and shared by all layers."""

    slot_mapping: torch.Tensor          # [T] flat cache slot of every new token
    num_decodes: int
    decode_block_tables: torch.Tensor   # [num_decodes, max_pages], padded with page 0
    decode_context_lens: torch.Tensor   # [num_decodes]
    decode_mask: torch.Tensor           # [num_decodes, 1, 1, max_pages * page_size]: slot < context length
    prefills: tuple[PrefillChunk, ...]


@dataclass(frozen=True)
class Selection:
    """DSA: the cached positions each query row attends to, chosen by a layer's indexer and reused by the layers
    that share it. [rows, k] positions in the sequence, -1 where a row has fewer than k; None where every row
    sees its whole context (none is longer than `index_topk`), which is then attended densely."""

    decodes: torch.Tensor | None
    prefills: tuple[torch.Tensor | None, ...]


def selection_mask(positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """[rows, k] selected positions → [rows, context_len] bool: True where a row attends."""
    mask = torch.zeros(positions.shape[0], context_len + 1, dtype=torch.bool, device=positions.device)
    mask.scatter_(1, torch.where(positions < 0, context_len, positions), True)
    return mask[:, :context_len]


def decode_mask(context_lens: torch.Tensor, max_pages: int, page_size: int) -> torch.Tensor:
    slots = torch.arange(max_pages * page_size, device=context_lens.device)
    return (slots[None, :] < context_lens[:, None])[:, None, None, :]


def chunk_causal_mask(num_tokens: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i of a chunk sits at position context_len - num_tokens + i and sees keys up to it."""
    if num_tokens == context_len:
        return None
    query_pos = torch.arange(context_len - num_tokens, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]


def paged_attention(q: torch.Tensor, kv_cache: PagedKVCache, layer: int,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, num_heads, head_dim] → [T, num_heads, head_dim], keys/values read from the cache.

    On CUDA the decodes run the Triton kernel, which reads (and dequantizes) pages in place.
    """
    out = torch.empty_like(q)
    if meta.num_decodes and use_triton(q):
        from engine.kernels.paged_attention import paged_decode_attention

        key_pages, value_pages = kv_cache.keys[layer], kv_cache.values[layer]
        k_scales, v_scales = kv_cache.layer_scales(layer)
        out[:meta.num_decodes] = paged_decode_attention(
            q[:meta.num_decodes], key_pages, value_pages, meta.decode_block_tables, meta.decode_context_lens,
            scale, k_scales, v_scales)
    elif meta.num_decodes:
        n = meta.num_decodes
        keys, values = kv_cache.gather(layer, meta.decode_block_tables, q.dtype)
        keys = keys.flatten(1, 2).transpose(1, 2)                                  # [n, kv_heads, L, D]
        values = values.flatten(1, 2).transpose(1, 2)
        out[:n] = F.scaled_dot_product_attention(
            q[:n].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True).squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
        keys, values = kv_cache.gather(layer, chunk.block_table, q.dtype)
        keys = keys.flatten(0, 1)[:chunk.context_len].transpose(0, 1)             # [kv_heads, ctx, D]
        values = values.flatten(0, 1)[:chunk.context_len].transpose(0, 1)
        query = q[rows].transpose(0, 1)                                          # [heads, n, D]
        # a leading batch of one: torch's CPU SDPA takes its flash kernel only for 4-D inputs; 3-D ones
        # run the math path, which materializes every score (4-8x slower at 512-1024 tokens)
        attended = F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=chunk.causal_mask,
                                                  is_causal=chunk.causal_mask is None, scale=scale,
                                                  enable_gqa=True)
        out[rows] = attended[0].transpose(0, 1)
    return out
