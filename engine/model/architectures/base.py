"""What every family shares: embeddings, a stack of decoder layers over the paged cache, the final norm,
the rotary tables (computed once per step for all layers) and the output head.

Under tensor parallelism (`use_group`) each rank's modules hold its shard (`engine.model.sharding`): the layers sum
their row-parallel outputs over the group, the embedding holds one slice of the vocabulary (a token outside
it embeds to zeros, and the sum over ranks is the full lookup), and the head's logits are gathered."""
from __future__ import annotations

import torch
from torch import nn

from engine.core.spec import ModelSpec
from engine.model.attention import AttentionMetadata
from engine.model.kv_cache import PagedKVCache
from engine.model.layers.linear import Linear, linear
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding
from engine.parallel.group import SINGLE, TensorGroup


class DecoderLayer(nn.Module):
    """A pre-norm residual block: attention, then the feed-forward (each family brings its own two)."""

    def __init__(self, config: ModelSpec, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.group = SINGLE

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.group.all_reduce(self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta))
        return x + self.group.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelSpec, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = self.rotary_embedding(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.group = SINGLE
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    def use_group(self, group: TensorGroup) -> None:
        """This model is rank `group.rank`'s shard of a tensor-parallel model."""
        self.group = group
        for layer in self.layers:
            layer.group = group

    @staticmethod
    def rotary_embedding(config: ModelSpec) -> RotaryEmbedding:
        return RotaryEmbedding(config.attention.rotary_dim, config.max_position_embeddings, config.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch of new tokens [T] → final hidden states [T, hidden]; the cache rows go to the pool."""
        x = self.embed(input_ids)
        x = self.run_layers(x, self.rotary(positions, x.dtype), kv_cache, meta)
        if self.keep_hidden:                # an MTP draft reads the hidden states before the final norm
            self.last_hidden = x
        return self.norm(x)

    def run_layers(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], kv_cache: PagedKVCache,
                   meta: AttentionMetadata) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, rotary, kv_cache, meta)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.embed_tokens(input_ids)
        rows = self.embed_tokens.num_embeddings
        local = input_ids - self.group.rank * rows
        inside = (local >= 0) & (local < rows)
        x = self.embed_tokens(local.clamp(0, rows - 1)) * inside[:, None].to(self.embed_tokens.weight.dtype)
        return self.group.all_reduce(x)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head's matrix: the embeddings' when tied (this rank's vocabulary slice)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits (all of them on one device)."""
        return linear(hidden, self.head_weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last_dim(self.local_logits(hidden)).float()
