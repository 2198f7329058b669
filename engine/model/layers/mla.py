"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a paged latent cache.

Each token caches one row per layer: its RMS-normalized KV latent (`kv_lora_rank`) and its rotated rope key
(`qk_rope_head_dim`), shared by all heads. Per head, keys and values are up-projections of the latent:

    k_h = [W_UK_h · latent ; k_rope]      v_h = W_UV_h · latent      (W_UK, W_UV: the rows of kv_b_proj)

Prefill computes that expanded form (per-head K and V for the chunk's whole context: matmul-heavy, as
prefill is anyway). Decode uses the absorbed form, reading only the latent pages (the Triton kernel
`engine.kernels.mla_decode` on CUDA):

    q_h · k_h = (W_UK_hᵀ q_nope_h) · latent + q_rope_h · k_rope      out_h = W_UV_h · (softmax · latents)

so one query row per head of `kv_lora_rank + qk_rope_head_dim` attends over rows shared by every head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.spec import ModelSpec
from engine.kernels.backend import use_triton
from engine.model.attention import AttentionMetadata, PrefillChunk, Selection, selection_mask
from engine.model.kv_cache import PagedKVCache
from engine.model.layers.linear import Linear, dense_weight
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import apply_rotary, rotate_interleaved, softmax_scale

MIN_DOT = 16                # the Triton decode's tl.dot needs pages of at least 16 tokens
LATENT_NORM_EPS = 1e-6      # DeepSeek's q_a_layernorm and kv_a_layernorm keep the default, whatever rms_norm_eps says


class MLAttention(nn.Module):
    def __init__(self, config: ModelSpec, layer: int) -> None:
        super().__init__()
        attention, hidden = config.attention, config.hidden_size
        self.layer = layer
        self.num_heads = attention.num_heads
        self.nope_dim, self.rope_dim = attention.qk_nope_head_dim, attention.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = attention.v_head_dim, attention.kv_lora_rank
        qk_size = self.num_heads * (self.nope_dim + self.rope_dim)
        self.compressed_queries = bool(attention.q_lora_rank)
        if self.compressed_queries:
            self.q_a_proj = Linear(hidden, attention.q_lora_rank)
            self.q_a_layernorm = RMSNorm(attention.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(attention.q_lora_rank, qk_size)
        else:
            self.q_proj = Linear(hidden, qk_size)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden)
        self.scale = softmax_scale(self.nope_dim + self.rope_dim, config.rope)
        self.rotate = rotate_interleaved if config.rope.interleaved else apply_rotary

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """The normalized query latent (DSA's indexer reads it too); x itself when queries are not compressed."""
        return self.q_a_layernorm(self.q_a_proj(x)) if self.compressed_queries else x

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(x, self.query_latent(x), rotary, kv_cache, meta, None)

    def attend(self, x: torch.Tensor, q_latent: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
               kv_cache: PagedKVCache, meta: AttentionMetadata, selection: Selection | None) -> torch.Tensor:
        """Writes the new tokens' cache rows and attends: over every cached token, or over the selected ones."""
        tokens = x.shape[0]
        queries = self.q_b_proj(q_latent) if self.compressed_queries else self.q_proj(q_latent)
        q_nope, q_rope = queries.view(tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope = self.rotate(q_rope, *rotary)
        k_rope = self.rotate(k_rope[:, None], *rotary)[:, 0]
        kv_cache.write_latent(self.layer, meta.slot_mapping, torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1))
        out = x.new_empty(tokens, self.num_heads, self.v_dim)
        if meta.num_decodes:
            n = meta.num_decodes
            positions = None if selection is None else selection.decodes
            out[:n] = self.absorbed_decode(q_nope[:n], q_rope[:n], kv_cache, meta, positions)
        for index, chunk in enumerate(meta.prefills):
            rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
            positions = None if selection is None else selection.prefills[index]
            mask = chunk.causal_mask if positions is None else selection_mask(positions, chunk.context_len)
            out[rows] = self.expanded_prefill(q_nope[rows], q_rope[rows], kv_cache, chunk, mask)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))

    def _up_projections(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, rank] and W_UV [heads, v, rank] from kv_b_proj (dequantized when it is stored so)."""
        weight = dense_weight(self.kv_b_proj, dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return weight[:, :self.nope_dim], weight[:, self.nope_dim:]

    def absorbed_decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: PagedKVCache,
                        meta: AttentionMetadata, positions: torch.Tensor | None = None) -> torch.Tensor:
        """[n, heads, nope] and [n, heads, rope] → [n, heads, v], attending in the latent space: over each
        sequence's whole context, or over its selected `positions` ([n, k], -1 pads) only."""
        w_uk, w_uv = self._up_projections(q_nope.dtype)
        query = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_rope], dim=-1)
        fp8_scales = kv_cache.scales[0][self.layer] if kv_cache.is_fp8 else None
        if use_triton(query) and kv_cache.page_size >= MIN_DOT:
            if positions is None:
                from engine.kernels.mla_decode import paged_mla_decode

                attended = paged_mla_decode(query, kv_cache.latents[self.layer], meta.decode_block_tables,
                                            meta.decode_context_lens, self.scale, self.kv_lora_rank, fp8_scales)
            else:
                from engine.kernels.sparse_mla_decode import sparse_mla_decode

                attended = sparse_mla_decode(query, kv_cache.latents[self.layer], meta.decode_block_tables,
                                             positions, self.scale, self.kv_lora_rank, fp8_scales)
        else:       # every head reads the same rows: batched matmuls, not an attention that copies them per head
            if positions is None:
                rows = kv_cache.gather_latent(self.layer, meta.decode_block_tables, q_nope.dtype).flatten(1, 2)
                attends = meta.decode_mask[:, 0]                                           # [n, 1, L]
            else:
                page_size = kv_cache.page_size
                chosen = positions.clamp(min=0)
                slots = meta.decode_block_tables.gather(1, chosen // page_size) * page_size + chosen % page_size
                rows = kv_cache.gather_latent_rows(self.layer, slots, q_nope.dtype)         # [n, k, width]
                attends = (positions >= 0)[:, None]
            scores = torch.bmm(query, rows.transpose(1, 2)) * self.scale                       # [n, heads, L]
            scores = scores.masked_fill(~attends, float("-inf"))
            attended = torch.bmm(scores.softmax(dim=-1), rows[..., :self.kv_lora_rank])
        return torch.einsum("nhr,hvr->nhv", attended, w_uv)

    def expanded_prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: PagedKVCache,
                         chunk: PrefillChunk, mask: torch.Tensor | None) -> torch.Tensor:
        """One prefill chunk: per-head keys and values up-projected from the latents of its whole context;
        `mask` [tokens, context] says what each row attends (None: causally everything, the chunk being the
        whole context)."""
        rows = kv_cache.gather_latent(self.layer, chunk.block_table, q_nope.dtype).flatten(0, 1)[:chunk.context_len]
        latent, k_rope = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, values = self.kv_b_proj(latent).view(-1, self.num_heads, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_rope[:, None].expand(-1, self.num_heads, -1)], dim=-1)
        query = torch.cat([q_nope, q_rope], dim=-1)
        attended = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return attended[0].transpose(0, 1)
