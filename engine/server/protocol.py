"""The OpenAI API's request and response shapes, as the server accepts and writes them.

Requests are validated by pydantic with unknown fields forbidden: a misspelt parameter is a 400, never silently
ignored. `ignore_eos` and `top_k` are the extensions vLLM and SGLang accept too (the planner's load generator
needs `ignore_eos` to control output lengths); `return_token_ids` is vLLM's (the soak compares tokens, not
text); `n` must be 1 (one choice per request: a client wanting n sends n requests, which share the prompt's
pages through the prefix cache); `cache_salt` is vLLM's: requests share cached KV pages only with
requests of the same salt, so tenants that must not learn of each other's prompts (a cache hit shows in the
time to first token) never do.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class KVTransferParams(BaseModel):
    """vLLM's name for what a disaggregated proxy adds to a request for a decode replica: where its prompt is
    computed (`engine.server.disaggregation`)."""

    model_config = ConfigDict(extra="forbid")
    prefill_url: str = Field(min_length=1)


class SamplingFields(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="forbid")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    return_token_ids: bool = False      # vLLM's: each choice (and stream chunk) also carries its token ids
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)     # vLLM's: only requests of one salt share cached pages
    kv_transfer_params: KVTransferParams | None = None      # a decode replica's request: pull the prompt's KV

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > MAX_STOP_STRINGS or any(not s for s in stops)):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {value!r}")
        return stops

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"n must be 1, got {value}: this server returns one choice per request; send {value} "
                             f"requests instead (with prefix caching they share the prompt's KV pages)")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError(f"one prompt per request, got {len(value)}")
            return value[0]
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: the prompt tokens a prefix-cache hit supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseWriter:
    """The response objects of one request, completion or chat, whole or as stream chunks."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0, token_ids: list[int] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              token_ids: tuple[int, ...] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body
