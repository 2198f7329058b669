"""GLM 5.2 (`glm_moe_dsa`): the DeepSeek-V3 decoder with DeepSeek Sparse Attention, each layer attending to the
tokens its own indexer, or the last full layer's, selected (`engine.model.layers.dsa`)."""
from __future__ import annotations

import torch

from engine.core.spec import ModelSpec
from engine.model.architectures.base import DecoderLayer, DecoderModel
from engine.model.architectures.deepseek_v3 import feed_forward
from engine.model.attention import AttentionMetadata, Selection
from engine.model.kv_cache import PagedKVCache
from engine.model.layers.dsa import SparseMLAttention


class SparseDecoderLayer(DecoderLayer):
    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], kv_cache: PagedKVCache,
                meta: AttentionMetadata, selection: Selection | None = None) -> tuple[torch.Tensor, Selection]:
        attended, selection = self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta, selection)
        x = x + self.group.all_reduce(attended)
        return x + self.group.all_reduce(self.mlp(self.post_attention_layernorm(x))), selection


class GlmMoeDsaModel(DecoderModel):
    def __init__(self, config: ModelSpec) -> None:
        super().__init__(config, [SparseDecoderLayer(config, SparseMLAttention(config, i), feed_forward(config, i))
                                  for i in range(config.num_layers)])

    def run_layers(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], kv_cache: PagedKVCache,
                   meta: AttentionMetadata) -> torch.Tensor:
        selection = None
        for layer in self.layers:
            x, selection = layer(x, rotary, kv_cache, meta, selection)
        return x
