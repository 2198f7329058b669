"""Disaggregated serving between two engine servers: a prefill replica computes prompts, a decode replica decodes.

    client ── proxy (engine proxy) ── POST /v1/completions + kv_transfer_params ──► decode replica
                                                                                     │ POST /v1/prefill
                                                                 prefill replica ◄───┘ (the prompt's token ids)
                                                                      └── KV hand-off frame ──► decode replica

The decode replica tokenizes the request (chat template included) and pulls the prompt's KV from the prefill
replica it was told (`kv_transfer_params.prefill_url`, as vLLM names it): the prefill replica runs the prompt,
samples the first token, copies the pages out with a checksum per page, frees its own and answers the frame
(`engine.core.handoff`); the decode replica checks the pages when it admits the request into pages of its own.
A client gone away aborts the request on whichever replica holds it: neither keeps a page for it.
"""
from __future__ import annotations

from collections.abc import Callable

import httpx2
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.core.errors import RequestError
from engine.core.handoff import MEDIA_TYPE, KVHandoff
from engine.core.sequence import SamplingParams
from engine.server.async_engine import AsyncEngine, Draining, QueueFull, next_event

ROLES = ("single", "prefill", "decode")
PREFILL_TIMEOUT_S = 600.0       # a prompt queued behind others on a busy prefill replica


class PrefillRequest(BaseModel):
    """POST /v1/prefill, a decode replica's call: the prompt's token ids and how to sample the first token."""

    model_config = ConfigDict(extra="forbid")
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1)
    request_id: str = ""

    @classmethod
    def of(cls, token_ids: list[int], params: SamplingParams, cache_salt: str | None, request_id: str) -> PrefillRequest:
        return cls(prompt_token_ids=token_ids, max_tokens=params.max_tokens, temperature=params.temperature,
                   top_p=params.top_p, top_k=params.top_k, seed=params.seed, ignore_eos=params.ignore_eos,
                   cache_salt=cache_salt, request_id=request_id)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, ignore_eos=self.ignore_eos)


class PrefillFailed(Exception):
    """The prefill replica could not compute the prompt; the message says why (its own error, or the link's)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


async def pull_handoff(client: httpx2.AsyncClient, prefill_url: str, body: PrefillRequest,
                       authorization: str | None) -> KVHandoff:
    """The prompt computed on `prefill_url`, its pages in hand; PrefillFailed if that failed."""
    headers = {"Authorization": authorization} if authorization else {}
    try:
        response = await client.post(f"{prefill_url.rstrip('/')}/v1/prefill", json=body.model_dump(),
                                     headers=headers, timeout=PREFILL_TIMEOUT_S)
    except httpx2.HTTPError as error:
        raise PrefillFailed(f"the prefill replica {prefill_url} could not be reached: {error}") from None
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        status = response.status_code if response.status_code in (400, 429, 503) else 502
        raise PrefillFailed(f"the prefill replica {prefill_url} answered {response.status_code}: {message}", status)
    try:
        return KVHandoff.decode(response.content)
    except RequestError as error:
        raise PrefillFailed(f"the prefill replica {prefill_url} sent {error}") from None


Refuse = Callable[..., JSONResponse]


def add_prefill_route(app: FastAPI, engine: AsyncEngine, refuse: Refuse,
                      unavailable: Callable[[], JSONResponse]) -> None:
    """POST /v1/prefill: runs the prompt, answers the KV hand-off frame (or an OpenAI error object)."""

    @app.post("/v1/prefill")
    async def prefill(request: Request, body: PrefillRequest) -> Response:
        try:
            stream = engine.submit(body.prompt_token_ids, body.params, (), body.cache_salt, body.request_id,
                                   hands_off=True)
        except RequestError as error:
            return refuse(400, str(error))
        except QueueFull as error:
            return refuse(429, f"{error}; retry later", "rate_limit_error")
        except Draining:
            return unavailable()
        try:
            while True:
                event = await next_event(request, stream)
                if event is None:
                    return Response(status_code=499)
                if event.error is not None:
                    return refuse(500, event.error, event.error_type)
                if event.finish_reason is not None:
                    if event.handoff is None:
                        return refuse(500, f"the prefill ended ({event.finish_reason}) without its pages")
                    return Response(event.handoff.encode(), media_type=MEDIA_TYPE)
        finally:
            engine.abort(stream)

