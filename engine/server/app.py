"""OpenAI-compatible HTTP server over the engine's step API (`engine serve`).

    handlers ── validated sequence ──► AsyncEngine ──► step thread: queue new, abort gone, LLM.step()
       ▲                                   │
       └── SSE chunks / JSON ◄── per-request event queues, filled after every step (new text, end, error)

One asyncio task drives the engine. The step runs on one worker thread, so the event loop goes on accepting
and streaming while the model computes; only that thread touches the `LLM` (handlers validate, then hand over
sequences and aborts, applied between steps). A client that goes away has its request aborted and its pages
freed before the next step; an integrity violation ends its own request with an error, never the others.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.core.errors import ConfigError, RequestError
from engine.core.profile_format import batch_shape, regime_of
from engine.core.sequence import FinishReason, SamplingParams, Sequence
from engine.llm import LLM, RequestOutput
from engine.parallel.group import free_port
from engine.server.metrics import ServerMetrics
from engine.server.protocol import ChatRequest, CompletionRequest, ResponseWriter, SamplingFields, error_body
from engine.server.text_stream import TextStream

log = logging.getLogger("engine.server.app")
DISCONNECT_POLL_S = 0.25        # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 256          # requests queued beyond the running batch; more are refused with 429
    step_trace: str | None = None   # a file to append every step to, as JSON lines (diagnosis against the planner)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port!r}")
        if not isinstance(self.max_waiting, int) or self.max_waiting <= 0:
            raise ConfigError(f"max_waiting must be a positive integer, got {self.max_waiting!r}")


class QueueFull(Exception):
    """More requests wait than the server queues."""


@dataclass(frozen=True)
class Event:
    """What one step brought a request: new text and tokens, and its end (finish reason or error)."""

    text: str
    tokens: int
    finish_reason: str | None = None
    error: str | None = None
    error_type: str = "server_error"


class RequestStream:
    """A request in flight, as its handler sees it."""

    def __init__(self, seq: Sequence, text: TextStream) -> None:
        self.seq = seq
        self.text = text
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.sent_tokens = 0
        self.last_token_s: float | None = None
        self.done = False           # ended: finished, failed or aborted


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: ServerMetrics, max_waiting: int, step_trace: str | None = None) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._step_trace_path = step_trace
        self._step_trace: TextIO | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._streams: dict[int, RequestStream] = {}
        self._pending: list[RequestStream] = []
        self._aborts: list[int] = []
        self._hooks: list[Callable[[LLM], None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._preemptions = llm.num_preemptions
        self._prefix_counts = (llm.scheduler.prefix_queried_tokens, llm.scheduler.prefix_hit_tokens)

    async def start(self) -> None:
        if self._step_trace_path:
            self._step_trace = open(self._step_trace_path, "a")
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
        if self._step_trace is not None:
            self._step_trace.close()

    def decode(self, token_ids: list[int]) -> str:
        return self.llm.tokenizer.decode(token_ids) if self.llm.tokenizer is not None else ""

    def submit(self, prompt: str | list[int], params: SamplingParams, stop: tuple[str, ...],
               cache_salt: str | None = None) -> RequestStream:
        """Queues a request for the next step; RequestError if it is bad, QueueFull if too many wait."""
        if len(self._pending) + len(self.llm.scheduler.waiting) >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are already waiting")
        stream = RequestStream(self.llm.new_sequence(prompt, params, cache_salt), TextStream(self.decode, stop))
        self._pending.append(stream)
        self._streams[stream.seq.seq_id] = stream
        self.metrics.prompt_tokens.inc(stream.seq.num_prompt_tokens)
        self.metrics.waiting.inc()
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Ends a request its client no longer wants; its pages are freed before the next step."""
        if stream.done:
            return
        self._end(stream)
        self._aborts.append(stream.seq.seq_id)
        self.metrics.finished.labels(FinishReason.ABORT.value).inc()
        self._wake.set()

    def between_steps(self, hook: Callable[[LLM], None]) -> None:
        """Runs `hook(llm)` on the step thread before the next step (maintenance, fault injection in tests)."""
        self._hooks.append(hook)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._pending or self._aborts or self._hooks or self.llm.has_unfinished()):
                self._wake.clear()
                await self._wake.wait()
                continue
            new, self._pending = [stream.seq for stream in self._pending], []
            aborts, self._aborts = self._aborts, []
            hooks, self._hooks = self._hooks, []
            try:
                finished = await loop.run_in_executor(self._executor, self._step, new, aborts, hooks)
            except Exception as error:        # the engine itself failed: every request in flight learns why
                log.exception("engine step failed")
                for stream in list(self._streams.values()):
                    self._end(stream, Event("", 0, error=f"the engine failed: {error}"))
                    self._aborts.append(stream.seq.seq_id)
                continue
            self._deliver(finished)
            self._observe()

    def _step(self, new: list[Sequence], aborts: list[int], hooks: list[Callable[[LLM], None]]) -> list[RequestOutput]:
        """On the step thread: what handlers handed over, then one step."""
        for seq in new:
            self.llm.scheduler.add(seq)
        for seq_id in aborts:
            self.llm.abort(seq_id)
        for hook in hooks:
            hook(self.llm)
        if not self.llm.has_unfinished():
            return []
        started = time.perf_counter()
        finished = self.llm.step()
        self._time_step(started, time.perf_counter() - started)
        return finished

    def _time_step(self, started: float, seconds: float) -> None:
        """The step's duration by regime in /metrics; with a step trace, its batch, times and whether work is left
        for the next step, as a JSON line (perf_counter is the system's monotonic clock: a client on this machine
        can line its own times up with it)."""
        output = self.llm.last_output
        if output is None or output.is_empty:
            return
        shape = batch_shape(output, self.llm.model_config.attention.index_topk)
        self.metrics.step_seconds.labels(regime_of(shape)).observe(seconds)
        if self._step_trace is not None:
            self._step_trace.write(json.dumps({"start_s": round(started, 6), "duration_s": round(seconds, 6),
                                               "batch": shape, "more": self.llm.has_unfinished()}) + "\n")
            self._step_trace.flush()

    def _deliver(self, finished: list[RequestOutput]) -> None:
        now = time.perf_counter()
        reasons = {output.request_id: output.finish_reason for output in finished}
        for seq_id, stream in list(self._streams.items()):
            reason = reasons.get(seq_id)
            if reason == FinishReason.INTEGRITY_ERROR.value:
                self.metrics.integrity_aborts.inc()
                self.metrics.finished.labels(reason).inc()
                self._end(stream, Event("", 0, error="a KV-cache integrity check failed: the request was aborted "
                                                    "before it could answer", error_type="integrity_error"))
                continue
            token_ids = stream.seq.output_token_ids
            new = len(token_ids) - stream.sent_tokens
            if not new and reason is None:
                continue
            text = stream.text.update(token_ids, final=reason is not None)
            self._observe_tokens(stream, new, now)
            if stream.text.stopped and reason is None:        # a stop string: the engine need not go on
                reason = FinishReason.STOP.value
                self._aborts.append(seq_id)
            if reason is None:
                stream.events.put_nowait(Event(text, new))
                continue
            self.metrics.finished.labels(reason).inc()
            self._end(stream, Event(text, new, reason))

    def _observe_tokens(self, stream: RequestStream, new: int, now: float) -> None:
        if not new:
            return
        if stream.last_token_s is None:
            self.metrics.ttft.observe(now - stream.seq.arrival_time)
        else:
            for _ in range(new):
                self.metrics.itl.observe((now - stream.last_token_s) / new)
        stream.last_token_s = now
        stream.sent_tokens += new
        self.metrics.generation_tokens.inc(new)

    def _end(self, stream: RequestStream, event: Event | None = None) -> None:
        stream.done = True
        self._streams.pop(stream.seq.seq_id, None)
        if event is not None:
            stream.events.put_nowait(event)

    def _observe(self) -> None:
        llm, metrics = self.llm, self.metrics
        metrics.running.set(len(llm.scheduler.running))
        metrics.waiting.set(len(llm.scheduler.waiting) + len(self._pending))
        metrics.pages_used.set(llm.block_manager.num_used_pages)
        metrics.pages_free.set(llm.block_manager.num_free_pages)
        metrics.preemptions.inc(llm.num_preemptions - self._preemptions)
        self._preemptions = llm.num_preemptions
        scheduler = llm.scheduler
        metrics.prefix_queries.inc(scheduler.prefix_queried_tokens - self._prefix_counts[0])
        metrics.prefix_hits.inc(scheduler.prefix_hit_tokens - self._prefix_counts[1])
        self._prefix_counts = (scheduler.prefix_queried_tokens, scheduler.prefix_hit_tokens)
        metrics.pages_cached.set(llm.block_manager.num_cached_pages)


def build_app(llm: LLM, config: ServerConfig) -> FastAPI:
    scheduler = llm.scheduler_config
    metrics = ServerMetrics({"num_pages": scheduler.num_pages, "page_size": scheduler.page_size,
                             "max_num_seqs": scheduler.max_num_seqs,
                             "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                             "max_model_len": scheduler.max_model_len, "kv_dtype": llm.kv_layout.dtype,
                             "weights": llm.config.weights})
    engine = AsyncEngine(llm, metrics, config.max_waiting, config.step_trace)
    metrics.pages_free.set(llm.block_manager.num_free_pages)
    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="kvplan engine", lifespan=lifespan)
    app.state.engine = engine

    def refuse(status: int, message: str, kind: str = "invalid_request_error", **headers: str) -> JSONResponse:
        metrics.rejected.labels(str(status)).inc()
        return JSONResponse(error_body(message, kind), status_code=status, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return refuse(400, f"{where}: {first.get('msg', 'invalid request')}" if where else
                      str(first.get("msg", "invalid request")))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvplan", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def respond(request: Request, body: SamplingFields, prompt: str | list[int], limit: int | None,
                      chat: bool) -> Response:
        if body.model != config.model_name:
            return refuse(404, f"the model {body.model!r} does not exist (this server serves "
                               f"{config.model_name!r})", "not_found_error")
        try:
            token_ids = llm.encode_prompt(prompt)
            if limit is None:           # as much as the context and the pool leave
                limit = max(1, min(llm.max_model_len, llm.capacity_tokens) - len(token_ids))
            params = SamplingParams(max_tokens=limit, temperature=body.temperature, top_p=body.top_p,
                                    top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos)
            stream = engine.submit(token_ids, params, body.stop_strings, body.cache_salt)
        except RequestError as error:
            return refuse(400, str(error))
        except QueueFull as error:
            return refuse(429, f"{error}; retry later", "rate_limit_error", **{"Retry-After": str(RETRY_AFTER_S)})
        writer = ResponseWriter(f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}", config.model_name, chat)
        prompt_tokens = len(token_ids)
        if body.stream:
            return StreamingResponse(sse(engine, stream, writer, prompt_tokens, body.include_usage),
                                     media_type="text/event-stream")
        return await whole(engine, request, stream, writer, prompt_tokens)

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

    return app


def _data(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse(engine: AsyncEngine, stream: RequestStream, writer: ResponseWriter, prompt_tokens: int,
              include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per step that brought the request tokens (its text may be empty while a
    character or a possible stop string is incomplete), then the finish reason, usage if asked, [DONE]."""
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
                yield _data(writer.chunk(event.text))
            if event.finish_reason is not None:
                yield _data(writer.chunk(None, event.finish_reason))
                if include_usage:
                    yield _data(writer.usage_chunk(prompt_tokens, completion_tokens, stream.seq.num_cached_tokens or 0))
                break
        yield _data("[DONE]")
    finally:
        engine.abort(stream)            # a no-op once it ended; else the client went away mid-stream


async def whole(engine: AsyncEngine, request: Request, stream: RequestStream, writer: ResponseWriter,
                prompt_tokens: int) -> Response:
    pieces, completion_tokens = [], 0
    try:
        while True:
            try:
                event = await asyncio.wait_for(stream.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if event.error is not None:
                return JSONResponse(error_body(event.error, event.error_type), status_code=500)
            pieces.append(event.text)
            completion_tokens += event.tokens
            if event.finish_reason is not None:
                return JSONResponse(writer.whole("".join(pieces), event.finish_reason, prompt_tokens,
                                                 completion_tokens, stream.seq.num_cached_tokens or 0))
    finally:
        engine.abort(stream)


def run_server(llm: LLM, config: ServerConfig) -> None:
    """Serves until interrupted."""
    uvicorn.run(build_app(llm, config), host=config.host, port=config.port, log_level="warning")


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> Iterator[str]:
    """An app from `build_app` served on a background thread of this process (tests, benchmarks); yields its base
    URL (port 0: a free one)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="engine-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ConfigError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


@contextmanager
def serve_subprocess(flags: list[str], timeout_s: float = 300.0) -> Iterator[str]:
    """`engine serve FLAGS` as a process of its own on a free port of 127.0.0.1 (tests, benchmarks: its steps then
    share nothing with the caller's interpreter); yields its base URL once /health answers, stops it after."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *flags, "--port", str(port)],
                                  cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2):
                        break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise ConfigError(f"engine serve {' '.join(flags)} did not come up: "
                                          f"{log.read().strip()[-500:]!r}") from None
                    time.sleep(0.2)
            yield url
        finally:
            server.terminate()
            server.wait(30)
