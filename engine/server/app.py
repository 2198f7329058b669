"""OpenAI-compatible HTTP server over the engine's step API (`engine serve`).

    request ─► ApiKeyGuard ─► BodyLimit ─► handler: validate ─► AsyncEngine (step thread) ─► SSE chunks / JSON

The guards answer 401 and 413 before a body is parsed; handlers validate (400 naming the bad value, 404 for
another model, 429 when the queue is full, 503 while draining) and hand a sequence to the `AsyncEngine`, whose
events become stream chunks or one response. `run_server` serves until SIGTERM or SIGINT, then drains
(`engine.server.shutdown`).
"""
from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from engine.core.errors import ConfigError, RequestError
from engine.core.sequence import SamplingParams
from engine.llm import LLM
from engine.server.async_engine import AsyncEngine, Draining, QueueFull, RequestStream, next_event
from engine.server.disaggregation import ROLES, PrefillFailed, PrefillRequest, add_prefill_route, pull_handoff
from engine.server.guards import ApiKeyGuard, BodyLimit
from engine.server.metrics import ServerMetrics
from engine.server.protocol import ChatRequest, CompletionRequest, ResponseWriter, SamplingFields, error_body
from engine.server.shutdown import DrainingServer

RETRY_AFTER_S = 1
DEFAULT_MAX_BODY_BYTES = 4 << 20    # a 128k-token prompt as text or as token ids is well under 1 MiB
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ERROR_STATUS = {"shutdown": 503}    # a request ended by an error: its status (500 unless named here)
FaultInjector = Callable[[LLM, str, random.Random], object]   # fault_campaign.inject: a Fault with victims, or None


def _check_key(name: str, key: str | None) -> None:
    if key is not None and (not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key)):
        raise ConfigError(f"{name} must be a non-empty string of printable ASCII without spaces")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 256          # requests queued beyond the running batch; more are refused with 429
    step_trace: str | None = None   # a file to append every step to, as JSON lines (diagnosis against the planner)
    api_key: str | None = None      # required as `Authorization: Bearer KEY` on /v1/* (and /debug/*)
    metrics_api_key: str | None = None      # required on /metrics when set
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0   # SIGTERM: how long requests in flight may run on before they are aborted
    role: str = "single"            # disaggregated serving: "prefill" answers /v1/prefill, "decode" pulls from one

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port!r}")
        if not isinstance(self.max_waiting, int) or self.max_waiting <= 0:
            raise ConfigError(f"max_waiting must be a positive integer, got {self.max_waiting!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be an integer of at least 1024, got {self.max_body_bytes!r}")
        if not (isinstance(self.drain_timeout_s, (int, float)) and math.isfinite(self.drain_timeout_s)
                and self.drain_timeout_s >= 0):
            raise ConfigError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s!r}")
        _check_key("the API key", self.api_key)
        _check_key("the metrics API key", self.metrics_api_key)
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")

    @property
    def loopback_only(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")

    def startup_notice(self, capacity_tokens: int) -> str:
        """What `engine serve` says when it starts: where, how much, and who may use it."""
        role = f" as a {self.role} replica" if self.role != "single" else ""
        where = (f"engine: serving {self.model_name!r}{role} on http://{self.host}:{self.port} ({capacity_tokens} KV "
                 f"token slots)")
        if self.api_key is not None:
            return f"{where}; /v1 requires the API key"
        if self.loopback_only:
            return f"{where}; no API key: listening on loopback only (--api-key KEY or KVPLAN_API_KEY to require one)"
        return (f"{where}; WARNING: no API key and --host {self.host}: anyone who reaches this port can use the model "
                f"(--api-key KEY or KVPLAN_API_KEY)")


class FaultRequest(BaseModel):
    """POST /debug/faults (servers started with --fault-injection): one integrity fault between two steps."""

    model_config = ConfigDict(extra="forbid")
    kind: str
    seed: int = 0


def build_app(llm: LLM, config: ServerConfig, fault_injector: FaultInjector | None = None) -> FastAPI:
    """The server's app; `fault_injector` (tests and soaks only) adds POST /debug/faults."""
    scheduler = llm.scheduler_config
    metrics = ServerMetrics({"num_pages": scheduler.num_pages, "page_size": scheduler.page_size,
                             "max_num_seqs": scheduler.max_num_seqs,
                             "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                             "max_model_len": scheduler.max_model_len, "kv_dtype": llm.kv_layout.dtype,
                             "weights": llm.config.weights})
    engine = AsyncEngine(llm, metrics, config.max_waiting, config.step_trace)
    metrics.pages_free.set(llm.stats().free_pages)
    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        async with httpx2.AsyncClient() as client:       # a decode replica's link to its prefill replicas
            app.state.prefill_client = client
            yield
        await engine.stop()

    app = FastAPI(title="kvplan engine", lifespan=lifespan)
    app.state.engine = engine

    def refuse(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.rejected.labels(str(status)).inc()
        return JSONResponse(error_body(message, kind, code=code), status_code=status, headers=headers or None)

    app.add_middleware(BodyLimit, refuse=refuse, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyGuard, refuse=refuse, api_key=config.api_key, metrics_api_key=config.metrics_api_key)

    def unavailable() -> JSONResponse:
        return refuse(503, "the server is shutting down; retry on another replica or later", "service_unavailable",
                      headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return refuse(400, f"{where}: {message}" if where else message)

    @app.get("/health")
    async def health() -> Response:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvplan", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def respond(request: Request, body: SamplingFields, prompt: str | list[int], limit: int | None,
                      chat: bool) -> Response:
        if engine.draining:
            return unavailable()
        if body.model != config.model_name:
            return refuse(404, f"the model {body.model!r} does not exist (this server serves "
                               f"{config.model_name!r})", "not_found_error", "model_not_found")
        client_id = request.headers.get("x-request-id")
        if client_id is not None and not REQUEST_ID.fullmatch(client_id):
            return refuse(400, f"X-Request-Id {client_id[:40]!r} must be 1-128 letters, digits or ._:-")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{client_id if client_id is not None else next(ids)}"
        transfer = body.kv_transfer_params
        if transfer is not None and config.role != "decode":
            return refuse(400, f"kv_transfer_params: this server's role is {config.role}, not decode "
                               f"(engine serve --role decode)")
        try:
            token_ids = llm.encode_prompt(prompt)
            if limit is None:           # as much as the context and the pool leave
                limit = max(1, min(llm.max_model_len, llm.capacity_tokens) - len(token_ids))
            params = SamplingParams(max_tokens=limit, temperature=body.temperature, top_p=body.top_p,
                                    top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos)
            if transfer is None:
                stream = engine.submit(token_ids, params, body.stop_strings, body.cache_salt, request_id)
            else:
                arrived = llm.new_sequence(token_ids, params, body.cache_salt).arrival_time     # a bad one: 400 now
                handoff = await pull_handoff(app.state.prefill_client, transfer.prefill_url,
                                             PrefillRequest.of(token_ids, params, body.cache_salt, request_id),
                                             request.headers.get("authorization"))
                stream = engine.submit_handoff(handoff, params, body.stop_strings, request_id, arrived)
        except PrefillFailed as error:
            return refuse(error.status, str(error), "prefill_error")
        except RequestError as error:
            return refuse(400, str(error))
        except QueueFull as error:
            return refuse(429, f"{error}; retry later", "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        except Draining:
            return unavailable()
        writer = ResponseWriter(request_id, config.model_name, chat)
        headers = {"X-Request-Id": client_id} if client_id is not None else None
        if body.stream:
            return StreamingResponse(sse(engine, stream, writer, len(token_ids), body), headers=headers,
                                     media_type="text/event-stream")
        return await whole(engine, request, stream, writer, len(token_ids), body.return_token_ids, headers)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await respond(request, body, body.prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        tokenizer = llm.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            return refuse(400, f"model {config.model_name!r} has no chat template; use /v1/completions")
        prompt = tokenizer.apply_chat_template([message.model_dump() for message in body.messages])
        return await respond(request, body, prompt, body.token_limit, chat=True)

    if config.role == "prefill":
        add_prefill_route(app, engine, refuse, unavailable)

    if fault_injector is not None:
        @app.post("/debug/faults")
        async def inject_fault(body: FaultRequest) -> Response:
            """One integrity fault into requests in flight: answers the victims' response ids (409: none could
            take it now)."""
            def strike(target: LLM) -> tuple[object, list[str]]:
                fault = fault_injector(target, body.kind, random.Random(body.seed))
                return fault, engine.request_ids(getattr(fault, "victims", ()))

            try:
                fault, victims = await engine.on_step_thread(strike)
            except ValueError as error:
                return refuse(400, str(error))
            if fault is None:
                return refuse(409, f"no request in flight can take a {body.kind} fault now", "conflict")
            return JSONResponse({"kind": body.kind, "victims": victims, "page": getattr(fault, "page", None)})

    return app


def _data(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse(engine: AsyncEngine, stream: RequestStream, writer: ResponseWriter, prompt_tokens: int,
              body: SamplingFields) -> AsyncIterator[str]:
    """Server-sent events: a chunk per step that brought the request tokens (its text may be empty while a
    character or a possible stop string is incomplete), then the finish reason, usage if asked, [DONE]; an
    error (integrity, shutdown) as a last event carrying OpenAI's error object."""
    completion_tokens = 0
    try:
        if writer.chat:
            yield _data(writer.chunk("", first=True))
        while True:
            event = await stream.events.get()
            if event.error is not None:
                yield _data(error_body(event.error, event.error_type))
                break
            completion_tokens += event.tokens
            if event.tokens or event.text:
                yield _data(writer.chunk(event.text, token_ids=event.token_ids if body.return_token_ids else None))
            if event.finish_reason is not None:
                yield _data(writer.chunk(None, event.finish_reason))
                if body.include_usage:
                    yield _data(writer.usage_chunk(prompt_tokens, completion_tokens, stream.seq.num_cached_tokens or 0))
                break
        yield _data("[DONE]")
    finally:
        engine.abort(stream)            # a no-op once it ended; else the client went away mid-stream


async def whole(engine: AsyncEngine, request: Request, stream: RequestStream, writer: ResponseWriter,
                prompt_tokens: int, return_token_ids: bool, headers: dict[str, str] | None) -> Response:
    pieces: list[str] = []
    token_ids: list[int] = []
    try:
        while True:
            event = await next_event(request, stream)
            if event is None:
                return Response(status_code=499)
            if event.error is not None:
                return JSONResponse(error_body(event.error, event.error_type), headers=headers,
                                    status_code=ERROR_STATUS.get(event.error_type, 500))
            pieces.append(event.text)
            token_ids.extend(event.token_ids)
            if event.finish_reason is not None:
                return JSONResponse(writer.whole("".join(pieces), event.finish_reason, prompt_tokens, len(token_ids),
                                                 stream.seq.num_cached_tokens or 0,
                                                 token_ids if return_token_ids else None), headers=headers)
    finally:
        engine.abort(stream)


def run_server(llm: LLM, config: ServerConfig, fault_injector: FaultInjector | None = None) -> None:
    """Serves until SIGTERM or SIGINT, then drains (`engine.server.shutdown`); ConfigError if it cannot listen."""
    app = build_app(llm, config, fault_injector)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=10), app.state.engine, config.drain_timeout_s)
    server.run()
    if not server.started:
        raise ConfigError(f"could not listen on {config.host}:{config.port} (is the port in use?)")
