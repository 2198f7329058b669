"""The DeepSeek-V3 decoder (Kimi K2 and K2.6 too): multi-head latent attention, and a feed-forward that is
a SwiGLU in the first `first_k_dense_replace` layers and a mixture of experts in the rest."""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.kv_cache import PagedKVCache
from engine.layers.mla import MLAttention
from engine.layers.mlp import SwiGLU
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.models.base import DecoderModel
from engine.spec import ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.ffn.layer_kinds[layer] == "moe":
            self.mlp: nn.Module = MoE(config.hidden_size, config.ffn)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.ffn.dense_intermediate)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(DecoderModel):
    def __init__(self, config: ModelSpec) -> None:
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_layers)])
