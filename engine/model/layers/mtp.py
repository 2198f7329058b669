"""DeepSeek-V3's multi-token-prediction module, used as a speculative draft (`--speculative mtp:1`).

At position i it joins the main model's hidden state h_i (before the final norm) with the embedding of the next
token t_{i+1}, runs one more decoder block over the paged cache (its own layer of the pool, after the main
layers) and the shared output head, predicting t_{i+2}:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]);  x = block(x);  logits = head(norm(x))

(DeepSeek-V3 technical report, section 2.2; the checkpoint's `model.layers.{num_hidden_layers}.*`.) Each step
runs it over the positions the step computed and kept, so its cache always covers what the main layers cover.
More drafts chain it: its own output at position i stands in for h_i of the next pass (as SGLang and vLLM
chain DeepSeek's single module).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.core.spec import ModelSpec
from engine.model.attention import AttentionMetadata
from engine.model.kv_cache import PagedKVCache
from engine.model.layers.linear import Linear
from engine.model.layers.norm import RMSNorm


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: ModelSpec, block: nn.Module) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.block = block
        self.norm = RMSNorm(hidden, config.rms_norm_eps)        # the checkpoint's shared_head.norm

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Embeddings of the next tokens and hidden states, [T, hidden] each -> the block's output [T, hidden],
        before `norm` (a chained pass takes it as its hidden state; the head reads it normed)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(x, rotary, kv_cache, meta)
