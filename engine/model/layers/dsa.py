"""DeepSeek Sparse Attention as GLM 5.2 (`glm_moe_dsa`) runs it: MLA that attends to `index_topk` cached tokens.

A lightning indexer scores every cached token for every query row with a few small heads,

    score(t) = Σ_h w_h · relu(q_h · k_t / sqrt(d))       q_h from the query latent, k_t one key per token,
                                                         w_h per head from the hidden state

and the attention then reads only the top `index_topk` tokens (all of them while the context is no longer).
The indexer's keys (LayerNorm'd, the first `qk_rope_head_dim` dims rotated in interleaved pairs) are cached
per token under the same pages as the latents. Layers whose `indexer_types` entry is "full" run their own
indexer; "shared" layers reuse the selection of the last full layer before them.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.core.spec import ModelSpec
from engine.kernels.backend import use_triton
from engine.model.attention import AttentionMetadata, PrefillChunk, Selection
from engine.model.kv_cache import PagedKVCache
from engine.model.layers.linear import Linear
from engine.model.layers.mla import MIN_DOT, MLAttention
from engine.model.layers.rotary import rotate_interleaved

INDEXER_NORM_EPS = 1e-6     # the indexer's key LayerNorm keeps torch's default, whatever the config says


def top_positions(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """[rows, L] index scores and which positions each row may see → [rows, min(topk, L)] the best visible
    positions, -1 where a row sees fewer."""
    scores = scores.masked_fill(~visible, float("-inf"))
    chosen = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices
    return torch.where(visible.gather(1, chosen), chosen, -1)


def weighted_relu_scores(queries: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Σ_h w_h relu(q_h · k · scale). queries [rows, heads, dim], head_weights [rows, heads], keys [L, dim]
    shared by the rows or [rows, L, dim] per row → [rows, L], in float32."""
    scores = (torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scale).relu()     # [rows, heads, L]
    return torch.matmul(head_weights.float()[:, None, :], scores)[:, 0]


class Indexer(nn.Module):
    def __init__(self, config: ModelSpec, slot: int) -> None:
        super().__init__()
        attention = config.attention
        self.slot = slot                            # this indexer's row of the cache's indexer pool
        self.num_heads, self.head_dim = attention.indexer_heads, attention.indexer_head_dim
        self.rope_dim, self.topk = attention.qk_rope_head_dim, attention.index_topk
        self.wq_b = Linear(attention.q_lora_rank or config.hidden_size, self.num_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = Linear(config.hidden_size, self.num_heads)
        self.scale = self.head_dim ** -0.5

    def _rotate(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rope, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([rotate_interleaved(rope, *rotary), rest], dim=-1)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> Selection:
        """Caches the new tokens' indexer keys and selects, for every row of the step, what it attends."""
        tokens = x.shape[0]
        queries = self._rotate(self.wq_b(q_latent).view(tokens, self.num_heads, self.head_dim), rotary)
        keys = self._rotate(self.k_norm(self.wk(x))[:, None], rotary)[:, 0]
        kv_cache.write_index_keys(self.slot, meta.slot_mapping, keys)
        head_weights = self.weights_proj(x).float() * self.num_heads ** -0.5
        decodes = None
        if meta.num_decodes and int(meta.decode_context_lens.max()) > self.topk:
            n = meta.num_decodes
            decodes = self._decode_selection(queries[:n], head_weights[:n], kv_cache, meta)
        prefills = tuple(self._chunk_selection(queries, head_weights, kv_cache, chunk) for chunk in meta.prefills)
        return Selection(decodes, prefills)

    def _decode_selection(self, queries: torch.Tensor, head_weights: torch.Tensor, kv_cache: PagedKVCache,
                          meta: AttentionMetadata) -> torch.Tensor:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if use_triton(queries) and kv_cache.page_size >= MIN_DOT:
            from engine.kernels.indexer_scores import paged_indexer_scores

            scores = paged_indexer_scores(queries, head_weights, kv_cache.index_keys[self.slot], tables, lens,
                                          self.scale, None if kv_cache.index_key_scales is None
                                          else kv_cache.index_key_scales[self.slot])
        else:
            keys = kv_cache.gather_index_keys(self.slot, tables, torch.float32).flatten(1, 2)      # [n, L, dim]
            scores = weighted_relu_scores(queries, head_weights, keys, self.scale)
        visible = torch.arange(scores.shape[1], device=scores.device)[None, :] < lens[:, None]
        return top_positions(scores, visible, self.topk)

    def _chunk_selection(self, queries: torch.Tensor, head_weights: torch.Tensor, kv_cache: PagedKVCache,
                         chunk: PrefillChunk) -> torch.Tensor | None:
        """A prefill chunk's rows score its whole context (the keys gathered once); row i sits at position
        context_len - num_tokens + i and sees the positions up to it."""
        if chunk.context_len <= self.topk:
            return None
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
        keys = kv_cache.gather_index_keys(self.slot, chunk.block_table, torch.float32).flatten(0, 1)
        scores = weighted_relu_scores(queries[rows], head_weights[rows], keys[:chunk.context_len], self.scale)
        device = scores.device
        query_positions = torch.arange(chunk.context_len - chunk.num_tokens, chunk.context_len, device=device)
        visible = torch.arange(chunk.context_len, device=device)[None, :] <= query_positions[:, None]
        return top_positions(scores, visible, self.topk)


class SparseMLAttention(MLAttention):
    """MLA over the tokens the indexer selects: its own indexer's selection in a "full" layer, the one handed
    down from the last full layer in a "shared" one."""

    def __init__(self, config: ModelSpec, layer: int) -> None:
        super().__init__(config, layer)
        slot = config.attention.indexer_slots[layer]
        self.indexer = None if slot is None else Indexer(config, slot)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], kv_cache: PagedKVCache,
                meta: AttentionMetadata, selection: Selection | None = None) -> tuple[torch.Tensor, Selection]:
        q_latent = self.query_latent(x)
        if self.indexer is not None:
            selection = self.indexer(x, q_latent, rotary, kv_cache, meta)
        if selection is None:
            raise ValueError(f"layer {self.layer} shares the selection of a previous full indexer layer; none ran")
        return self.attend(x, q_latent, rotary, kv_cache, meta, selection), selection
