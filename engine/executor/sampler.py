"""Next-token choice: greedy rows in one argmax, sampled rows each with their request's own generator.

A request's generator is seeded once, so its samples do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from engine.core.sequence import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of logits."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p   # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, vocab] float32 → one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (row_params, generator) in enumerate(zip(params, generators)):
        if row_params.greedy:
            continue
        probs = filter_logits(logits[row], row_params).softmax(-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
