"""What one rank of a tensor-parallel group holds, and its slice of every full-model weight.

A rank builds its modules from `rank_spec`: the same architecture with its share of the attention heads,
of the feed-forward width and of the vocabulary, so the modules themselves know nothing of parallelism.
Column-parallel matrices (Q/K/V, gate/up, MLA's query and KV up-projections, the embedding and head's
vocabulary) keep their rows of the rank's heads or slice; row-parallel ones (the attention output, down)
keep the matching columns and their partial results are summed over ranks (`DecoderLayer`). GQA KV heads
are split while there are at least as many as ranks, otherwise each rank keeps the one its query heads read
(replicated); MLA's latent has no heads, so its down-projection and cache are replicated. Routed experts are
cut like any SwiGLU (tensor parallel), or, with `expert_parallel`, dealt out whole: each rank holds
experts/N of them, every rank routes every token, and a rank's share of a token's experts goes into the same
all-reduce as the rest of the layer. Norms and routers are replicated. Quantization happens after slicing,
so each shard has its own scales.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.core.errors import ConfigError
from engine.core.spec import ModelSpec

TENSOR_PARALLEL_FAMILIES = ("llama", "deepseek_v3")


def check_tensor_parallel(spec: ModelSpec, size: int, expert_parallel: bool = False) -> None:
    """A clear error, before any process starts, for a model this group size cannot split."""
    if expert_parallel and (size == 1 or not spec.is_moe):
        raise ConfigError(f"--expert-parallel deals routed experts over the ranks of --tensor-parallel N > 1 of a "
                          f"mixture-of-experts model; {spec.name} at --tensor-parallel {size} has "
                          f"{'no routed experts' if not spec.is_moe else 'one rank'}")
    if size == 1:
        return
    if spec.family not in TENSOR_PARALLEL_FAMILIES:
        raise ConfigError(f"--tensor-parallel {size}: tensor parallelism runs the {', '.join(TENSOR_PARALLEL_FAMILIES)} "
                          f"families so far, not {spec.family!r}")
    attention, ffn = spec.attention, spec.ffn
    checks = [("attention heads", attention.num_heads), ("vocabulary", spec.vocab_size)]
    checks += [("dense feed-forward width", ffn.dense_intermediate)] if ffn.dense_layers else []
    checks += [("shared-expert width", ffn.shared_intermediate)] if ffn.shared_intermediate else []
    if ffn.moe_layers:
        checks += [("routed experts", ffn.num_experts) if expert_parallel else ("expert width", ffn.expert_intermediate)]
    for what, count in checks:
        if count % size:
            raise ConfigError(f"--tensor-parallel {size} does not divide the {count} {what} of {spec.name}")
    kv = attention.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(f"--tensor-parallel {size}: the {kv} KV heads of {spec.name} neither split over nor "
                          f"replicate evenly across {size} ranks")


def rank_spec(spec: ModelSpec, size: int, expert_parallel: bool = False) -> ModelSpec:
    """The architecture one rank builds: its heads, feed-forward widths and vocabulary slice. Under expert
    parallelism the routed experts keep their width and the spec its expert count (the router scores them
    all); `shard_model` gives the rank its share of them."""
    check_tensor_parallel(spec, size, expert_parallel)
    attention, ffn = spec.attention, spec.ffn
    return replace(spec, vocab_size=spec.vocab_size // size,
                   attention=replace(attention, num_heads=attention.num_heads // size,
                                     num_kv_heads=max(1, attention.num_kv_heads // size)),
                   ffn=replace(ffn, dense_intermediate=ffn.dense_intermediate // size,
                               shared_intermediate=ffn.shared_intermediate // size,
                               expert_intermediate=ffn.expert_intermediate // (1 if expert_parallel else size)))


def _kv_head_start(spec: ModelSpec, rank: int, size: int) -> int:
    """The first KV head rank `rank` keeps: its own slice, or the one its query heads read when replicated."""
    kv = spec.attention.num_kv_heads
    if kv >= size:
        return rank * (kv // size)
    return rank // (size // kv)


REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "gate")          # MLA's low-rank inputs, the routers
BY_ROWS = ("embed_tokens", "lm_head", "q_proj", "q_b_proj", "kv_b_proj")
BY_COLUMNS = ("o_proj", "down_proj")


def shard_of(name: str, full: torch.Tensor, spec: ModelSpec, rank: int, size: int,
             expert_parallel: bool = False) -> torch.Tensor:
    """Rank `rank`'s part of the full model's parameter `name`."""
    def chunk(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.chunk(size, dim=dim)[rank]

    def halves(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Gate and up fused: each half cut on its own."""
        gate, up = tensor.chunk(2, dim=dim)
        return torch.cat([chunk(gate, dim), chunk(up, dim)], dim=dim)

    parts = name.split(".")
    module, leaf = parts[-2], parts[-1]
    if module == "experts":                                 # stacked [experts, out, in]
        if expert_parallel:
            return chunk(full, 0)
        return halves(full, 1) if leaf == "gate_up_proj" else chunk(full, 2)
    if name.endswith("norm.weight") or module in REPLICATED:
        return full
    if module == "qkv_proj" and spec.attention.kind == "gqa":
        attention = spec.attention
        head_dim, heads, kv = attention.head_dim, attention.num_heads, attention.num_kv_heads
        local_heads, local_kv = heads // size, max(1, kv // size)
        q_rows, kv_start = heads * head_dim, _kv_head_start(spec, rank, size) * head_dim
        q = full[rank * local_heads * head_dim:(rank + 1) * local_heads * head_dim]
        k = full[q_rows + kv_start:q_rows + kv_start + local_kv * head_dim]
        v = full[q_rows + kv * head_dim + kv_start:q_rows + kv * head_dim + kv_start + local_kv * head_dim]
        return torch.cat([q, k, v])
    if module == "gate_up_proj":
        return halves(full, 0)
    if module in BY_ROWS:
        return chunk(full, 0)
    if module in BY_COLUMNS:
        return chunk(full, 1)
    raise ConfigError(f"no tensor-parallel rule for parameter {name!r}")


def shard_model(full: nn.Module, size: int, rank: int, expert_parallel: bool = False) -> nn.Module:
    """A rank's model, its parameters cut from the full float model's (which the caller then drops)."""
    from engine.model.architectures import model_class
    from engine.model.layers.moe import Experts, MoE

    spec = full.config
    local = rank_spec(spec, size, expert_parallel)
    with torch.device("meta"):
        model = model_class(local)(local)
        if expert_parallel:
            share = spec.ffn.num_experts // size
            for moe in (m for m in model.modules() if isinstance(m, MoE)):
                moe.experts = Experts(share, spec.hidden_size, spec.ffn.expert_intermediate)
                moe.experts.first_expert = rank * share
    parameter = next(full.parameters())
    model = model.to(parameter.dtype).to_empty(device=parameter.device)
    model.rotary = full.rotary
    full_parameters = dict(full.named_parameters())
    for name, param in model.named_parameters():
        part = shard_of(name, full_parameters[name].data, spec, rank, size, expert_parallel)
        if part.shape != param.shape:
            raise ConfigError(f"shard of {name!r} has shape {tuple(part.shape)}, rank {rank} holds "
                              f"{tuple(param.shape)}")
        param.data.copy_(part)
    return model
