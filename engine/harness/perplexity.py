"""Perplexity of the engine on a fixed real English text that ships with Python (`pydoc_data.topics`).

The text is every topic in sorted order, tokenized once and cut into consecutive windows of
`window` tokens; each window is scored on its own through the paged cache, so the figure depends
only on the model, its weights and its KV dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.core.errors import RequestError
from engine.core.reference_text import reference_text
from engine.llm import LLM

DEFAULT_WINDOW = 512
DEFAULT_WINDOWS = 8


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    tokens: int            # tokens predicted (each window's first token has no context)


def evaluation_tokens(llm: LLM, window: int, windows: int) -> list[list[int]]:
    if llm.tokenizer is None:
        raise RequestError(f"model {llm.config.model!r} has no tokenizer to read the evaluation text")
    ids = llm.tokenizer.encode(reference_text(separator="\n\n"))
    if window < 2 or windows < 1 or window * windows > len(ids):
        raise RequestError(f"{windows} windows of {window} tokens do not fit the {len(ids)}-token text")
    return [ids[i * window:(i + 1) * window] for i in range(windows)]


def perplexity(llm: LLM, window: int = DEFAULT_WINDOW, windows: int = DEFAULT_WINDOWS) -> Perplexity:
    total_nll, total_tokens = 0.0, 0
    for ids in evaluation_tokens(llm, window, windows):
        logits = llm.score(ids)
        targets = torch.tensor(ids[1:], device=logits.device)
        total_nll += F.cross_entropy(logits[:-1], targets, reduction="sum").item()
        total_tokens += len(ids) - 1
    return Perplexity(math.exp(total_nll / total_tokens), total_tokens)
