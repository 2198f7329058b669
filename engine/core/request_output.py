"""What the engine answers for a finished (or aborted) request. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.handoff import KVHandoff


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_preemptions: int
    num_cached_tokens: int = 0          # prompt tokens a prefix-cache hit supplied (OpenAI's `cached_tokens`)
    handoff: KVHandoff | None = None    # a disaggregated prefill's: the prompt's KV pages and first token
