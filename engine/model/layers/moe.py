"""Mixture of experts: a router, routed experts stored stacked per layer, and shared experts.

The routed experts run grouped by expert: a step's (token, expert) pairs are sorted by expert once, and
each expert the batch touches multiplies its rows in one matmul; untouched experts cost nothing. The
loop is over experts, never over tokens. Where Triton runs, float and INT4 experts run as one grouped GEMM per
projection instead (`engine.kernels.fused_moe`: no loop, nothing read back to the host); the loop is its
reference.

    pairs (token, slot) ──sort by expert──► [e0 e0 e0 | e3 | e5 e5 | ...] ──per expert: SwiGLU──► weighted
    sum back into each token's row (index_add)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.spec import FeedForward, Routing
from engine.kernels.backend import use_triton
from engine.kernels.expert_weights import ExpertWeights
from engine.model.layers.linear import linear
from engine.model.layers.mlp import SwiGLU

NORM_EPS = 1e-20            # added to the sum of the chosen weights before renormalizing (as DeepSeek does)


def route(logits: torch.Tensor, routing: Routing, top_k: int,
          correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, experts] (fp32) → each token's expert weights and ids [T, top_k].

    The correction bias steers which experts are chosen (it balances their load) but the weights are the
    unbiased scores; groups are ranked by the sum of their two best biased scores."""
    scores = logits.sigmoid() if routing.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, routing.n_group, experts // routing.n_group)
        best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(routing.topk_group, dim=-1).indices
        keep = torch.zeros(tokens, routing.n_group, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // routing.n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * routing.routed_scaling_factor, ids


class Router(nn.Module):
    """Scores in fp32 whatever the activations' dtype: the choice of experts is sensitive to rounding."""

    def __init__(self, hidden_size: int, num_experts: int, routing: Routing, top_k: int) -> None:
        super().__init__()
        self.routing, self.top_k = routing, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
                                        if routing.correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x.float(), self.weight.float())
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return route(logits, self.routing, self.top_k, bias)


class GroupedExperts(nn.Module):
    """Runs a layer's routed experts grouped by expert; subclasses store them and say how one expert
    multiplies its rows (`expert`). Under expert parallelism a rank holds `num_experts` of them from
    `first_expert` on and leaves the pairs routed to the others to their ranks (the layer's all-reduce adds
    them up)."""

    num_experts: int
    intermediate_size: int
    first_expert: int = 0

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fused_stacks(self) -> tuple[ExpertWeights, ExpertWeights] | None:
        """The gate-up and down stacks the grouped GEMM reads; None where it does not serve these experts."""
        return None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights and ids [T, top_k] → the weighted sum of each token's experts [T, hidden]."""
        stacks = self.fused_stacks() if use_triton(x) else None
        if stacks is not None:
            from engine.kernels.fused_moe import fused_experts

            return fused_experts(x.contiguous(), weights, ids, self.first_expert, self.num_experts, *stacks)
        return self.grouped(x, weights, ids)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The loop over the experts the step touches: the reference of the grouped GEMM."""
        top_k = ids.shape[1]
        local = ids.flatten() - self.first_expert
        pairs = ((local >= 0) & (local < self.num_experts)).nonzero().squeeze(1)
        order = pairs[local[pairs].argsort(stable=True)]
        counts = torch.bincount(local[pairs], minlength=self.num_experts).tolist()
        pair_weights = weights.flatten()[order].to(x.dtype)
        tokens = order // top_k
        out = torch.zeros_like(x)
        start = 0
        for index, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                out.index_add_(0, rows, self.expert(index, x[rows]) * pair_weights[start:start + count, None])
                start += count
        return out


class Experts(GroupedExperts):
    """All routed experts of a layer in a float dtype: gate and up fused, stacked [experts, 2 x intermediate,
    hidden]; down stacked [experts, hidden, intermediate]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj[index]).split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj[index])

    def fused_stacks(self) -> tuple[ExpertWeights, ExpertWeights] | None:
        return ExpertWeights(self.gate_up_proj), ExpertWeights(self.down_proj)


class MoE(nn.Module):
    def __init__(self, hidden_size: int, ffn: FeedForward) -> None:
        super().__init__()
        self.gate = Router(hidden_size, ffn.num_experts, ffn.routing, ffn.experts_per_token)
        self.experts = Experts(ffn.num_experts, hidden_size, ffn.expert_intermediate)
        self.shared_experts = SwiGLU(hidden_size, ffn.shared_intermediate) if ffn.shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)
