"""A Llama-family decoder written for paged attention: the KV lives in the shared page pool.

Q/K/V and gate/up projections are fused into one matrix each (fewer, larger matmuls); the loader
concatenates checkpoint tensors into them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig, RopeConfig
from engine.kv_cache import PagedKVCache


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, rescaled for long context as the config says (linear or Llama 3)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = ((rope.original_max_position_embeddings / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor))
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, indexed by each token's absolute position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim] of the step's positions, looked up once for all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim ** -0.5

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


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch of new tokens [T] → final hidden states [T, hidden]; K/V go to the cache."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
