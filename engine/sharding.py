"""What one rank of a tensor-parallel group holds, and its slice of every full-model weight.

A rank builds its modules from `rank_spec`: the same architecture with its share of the attention heads,
of the feed-forward width and of the vocabulary, so the modules themselves know nothing of parallelism.
Column-parallel matrices (Q/K/V, gate/up, the embedding and head's vocabulary) keep their rows of the rank's
heads or slice; row-parallel ones (the attention output, down) keep the matching columns and their partial
results are summed over ranks (`DecoderLayer`). GQA KV heads are split while there are at least as many as
ranks, otherwise each rank keeps the one its query heads read (replicated). Norms are replicated.
Quantization happens after slicing, so each shard has its own scales.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.errors import ConfigError
from engine.spec import ModelSpec

TENSOR_PARALLEL_FAMILIES = ("llama",)


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """A clear error, before any process starts, for a model this group size cannot split."""
    if size == 1:
        return
    if spec.family not in TENSOR_PARALLEL_FAMILIES:
        raise ConfigError(f"--tensor-parallel {size}: tensor parallelism runs the {', '.join(TENSOR_PARALLEL_FAMILIES)} "
                          f"family so far, not {spec.family!r}")
    attention = spec.attention
    checks = [("attention heads", attention.num_heads), ("feed-forward width", spec.ffn.dense_intermediate),
              ("vocabulary", spec.vocab_size)]
    for what, count in checks:
        if count % size:
            raise ConfigError(f"--tensor-parallel {size} does not divide the {count} {what} of {spec.name}")
    kv = attention.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(f"--tensor-parallel {size}: the {kv} KV heads of {spec.name} neither split over nor "
                          f"replicate evenly across {size} ranks")


def rank_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The architecture one rank builds: its heads, feed-forward width and vocabulary slice."""
    check_tensor_parallel(spec, size)
    attention = spec.attention
    return replace(spec, vocab_size=spec.vocab_size // size,
                   attention=replace(attention, num_heads=attention.num_heads // size,
                                     num_kv_heads=max(1, attention.num_kv_heads // size)),
                   ffn=replace(spec.ffn, dense_intermediate=spec.ffn.dense_intermediate // size))


def _kv_head_start(spec: ModelSpec, rank: int, size: int) -> int:
    """The first KV head rank `rank` keeps: its own slice, or the one its query heads read when replicated."""
    kv = spec.attention.num_kv_heads
    if kv >= size:
        return rank * (kv // size)
    return rank // (size // kv)


def shard_of(name: str, full: torch.Tensor, spec: ModelSpec, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of the full model's parameter `name`."""
    def rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
        return tensor[start:start + count]

    def chunk(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.chunk(size, dim=dim)[rank]

    attention, leaf = spec.attention, name.rsplit(".", 2)[-2]
    if leaf in ("embed_tokens", "lm_head"):
        return chunk(full, 0)
    if leaf == "qkv_proj":
        head_dim, heads, kv = attention.head_dim, attention.num_heads, attention.num_kv_heads
        q_size, kv_size = heads * head_dim, kv * head_dim
        local_heads, local_kv = heads // size, max(1, kv // size)
        kv_start = _kv_head_start(spec, rank, size) * head_dim
        q = rows(full, rank * local_heads * head_dim, local_heads * head_dim)
        k = rows(full, q_size + kv_start, local_kv * head_dim)
        v = rows(full, q_size + kv_size + kv_start, local_kv * head_dim)
        return torch.cat([q, k, v])
    if leaf == "gate_up_proj":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([chunk(gate, 0), chunk(up, 0)])
    if leaf in ("o_proj", "down_proj"):
        return chunk(full, 1)
    if name.endswith("norm.weight"):
        return full
    raise ConfigError(f"no tensor-parallel rule for parameter {name!r}")


def shard_model(full: nn.Module, size: int, rank: int) -> nn.Module:
    """A rank's model, its parameters cut from the full float model's (which the caller then drops)."""
    from engine.models import model_class

    spec = full.config
    local = rank_spec(spec, size)
    with torch.device("meta"):
        model = model_class(local)(local)
    parameter = next(full.parameters())
    model = model.to(parameter.dtype).to_empty(device=parameter.device)
    model.rotary = full.rotary
    full_parameters = dict(full.named_parameters())
    for name, param in model.named_parameters():
        part = shard_of(name, full_parameters[name].data, spec, rank, size)
        if part.shape != param.shape:
            raise ConfigError(f"shard of {name!r} has shape {tuple(part.shape)}, rank {rank} holds "
                              f"{tuple(param.shape)}")
        param.data.copy_(part)
    return model
