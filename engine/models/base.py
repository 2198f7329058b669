"""What every family shares: embeddings, a stack of decoder layers over the paged cache, the final norm,
the rotary tables (computed once per step for all layers) and the output head."""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.kv_cache import PagedKVCache
from engine.layers.linear import Linear, linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.spec import ModelSpec


class DecoderLayer(nn.Module):
    """A pre-norm residual block: attention, then the feed-forward (each family brings its own two)."""

    def __init__(self, config: ModelSpec, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelSpec, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = self.rotary_embedding(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    @staticmethod
    def rotary_embedding(config: ModelSpec) -> RotaryEmbedding:
        return RotaryEmbedding(config.attention.rotary_dim, config.max_position_embeddings, config.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch of new tokens [T] → final hidden states [T, hidden]; the cache rows go to the pool."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()
