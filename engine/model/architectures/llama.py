"""The Llama-family decoder (grouped-query attention, SwiGLU) over the paged KV pool.

Q/K/V and gate/up projections are fused into one matrix each (fewer, larger matmuls); the loader
concatenates checkpoint tensors into them.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.core.spec import ModelSpec
from engine.model.architectures.base import DecoderLayer, DecoderModel
from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.kv_cache import PagedKVCache
from engine.model.layers.linear import Linear
from engine.model.layers.mlp import SwiGLU
from engine.model.layers.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ModelSpec, layer: int) -> None:
        super().__init__()
        attention = config.attention
        self.layer = layer
        self.num_heads = attention.num_heads
        self.num_kv_heads = attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.q_size = attention.num_heads * attention.head_dim
        self.kv_size = attention.num_kv_heads * attention.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.scale = attention.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        kv_cache.write(self.layer, meta.slot_mapping, k, v)
        attended = paged_attention(q, kv_cache, self.layer, meta, self.scale)
        return self.o_proj(attended.reshape(tokens, self.q_size))


class LlamaModel(DecoderModel):
    def __init__(self, config: ModelSpec) -> None:
        super().__init__(config, [DecoderLayer(config, Attention(config, i),
                                               SwiGLU(config.hidden_size, config.ffn.dense_intermediate))
                                  for i in range(config.num_layers)])
