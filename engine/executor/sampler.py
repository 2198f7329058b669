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
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, vocab] float32 → one token id per row, left on the logits' device: the step reads them (and the
    integrity flags beside them) in one copy."""
    tokens = logits.argmax(dim=-1)
    for row, (row_params, generator) in enumerate(zip(params, generators)):
        if row_params.greedy:
            continue
        probs = filter_logits(logits[row], row_params).softmax(-1)
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens


def verify_drafts(logits: torch.Tensor, drafts: tuple[int, ...], params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[int, int]:
    """logits [K + 1, vocab] at a sequence's last token and its K drafts -> (drafts that stand, the token after
    them). Greedy: a draft stands while it is the target's argmax, so the tokens are those of plain decoding.
    Sampled: rejection sampling against the deterministic draft (Leviathan et al. 2023 with q a point mass):
    draft d stands with probability p(d); a rejected one is replaced by a sample of p without d, renormalized;
    after K standing drafts the next token is sampled from p. Each token then follows the target's p exactly."""
    if params.greedy:
        targets = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        return accepted, targets[accepted]
    for position, draft in enumerate(drafts):
        probs = filter_logits(logits[position], params).softmax(-1)
        chance = torch.rand((), generator=generator, device=probs.device)
        if chance < probs[draft]:
            continue
        probs[draft] = 0.0
        return position, int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())
    probs = filter_logits(logits[len(drafts)], params).softmax(-1)
    return len(drafts), int(torch.multinomial(probs, 1, generator=generator).item())
