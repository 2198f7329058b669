"""The server's driver of the engine: one asyncio task, one step thread, a queue of events per request.

    handlers ── validated sequence ──► AsyncEngine ──► step thread: queue new, abort gone, hooks, LLM.step()
       ▲                                   │
       └── events (text, tokens, end) ◄────┘ after every step

Only the step thread touches the `LLM`: handlers validate, then hand over sequences and aborts, applied between
steps. A client that goes away has its request aborted and its pages freed before the next step; an integrity
violation ends its own request with an error, never the others. `drain` is the graceful shutdown: no new
requests, those in flight finish up to a deadline, the rest end with an error and give their pages back.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO, TypeVar

from engine.core.handoff import KVHandoff
from engine.core.sequence import FinishReason, SamplingParams, Sequence
from engine.core.step_shape import batch_shape, regime_of
from engine.llm import LLM, RequestOutput
from engine.server.metrics import ServerMetrics
from engine.server.text_stream import TextStream

if TYPE_CHECKING:
    from starlette.requests import Request

log = logging.getLogger("engine.server.async_engine")
SETTLE_TIMEOUT_S = 60.0     # a drain waits this long at most for the step in progress to apply its aborts
DISCONNECT_POLL_S = 0.25    # how often a handler waiting on a stream checks that its client is still there
Result = TypeVar("Result")


class QueueFull(Exception):
    """More requests wait than the server queues."""


class Draining(Exception):
    """The server is shutting down and admits no new request."""


@dataclass(frozen=True)
class Event:
    """What one step brought a request: new text and tokens, and its end (finish reason or error)."""

    text: str
    tokens: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    error_type: str = "server_error"
    handoff: KVHandoff | None = None     # a disaggregated prefill's end: the prompt's pages for its decode replica


@dataclass(frozen=True)
class DrainReport:
    """How a graceful shutdown went."""

    in_flight: int          # requests running or queued when it began
    completed: int          # of those, ended on their own before the deadline
    aborted: int            # ended by the deadline, with an error
    pages_in_use: int       # KV pages requests still held once the engine settled (0 unless something leaked)
    settled: bool           # the engine applied every abort before the settle timeout


class RequestStream:
    """A request in flight, as its handler sees it."""

    def __init__(self, seq: Sequence, text: TextStream, request_id: str, handoff: KVHandoff | None = None) -> None:
        self.seq = seq
        self.text = text
        self.request_id = request_id
        self.handoff = handoff          # an arrival from a prefill replica: its pages, until the engine takes them
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.sent_tokens = 0
        self.last_token_s: float | None = None
        self.done = False           # ended: finished, failed or aborted


async def next_event(request: Request, stream: RequestStream) -> Event | None:
    """The stream's next event for a handler that answers once (not streamed); None once its client went away."""
    while True:
        try:
            return await asyncio.wait_for(stream.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: ServerMetrics, max_waiting: int, step_trace: str | None = None) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.draining = False
        self._step_trace_path = step_trace
        self._step_trace: TextIO | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._streams: dict[int, RequestStream] = {}
        self._pending: list[RequestStream] = []
        self._aborts: list[int] = []
        self._hooks: list[Callable[[LLM], None]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()        # set after a step cycle that left nothing to do
        self._task: asyncio.Task | None = None
        self._counted = llm.stats()        # the counters as of the last export to /metrics

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

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def decode(self, token_ids: list[int]) -> str:
        return self.llm.tokenizer.decode(token_ids) if self.llm.tokenizer is not None else ""

    def submit(self, prompt: str | list[int], params: SamplingParams, stop: tuple[str, ...],
               cache_salt: str | None = None, request_id: str = "", hands_off: bool = False) -> RequestStream:
        """Queues a request for the next step; RequestError if it is bad, QueueFull if too many wait, Draining
        once a shutdown began. One that `hands_off` (a prefill replica's) ends with its pages in its last event."""
        self._admissible()
        seq = self.llm.new_sequence(prompt, params, cache_salt, hands_off)
        return self._queue(RequestStream(seq, TextStream(self.decode, stop), request_id))

    def submit_handoff(self, handoff: KVHandoff, params: SamplingParams, stop: tuple[str, ...],
                       request_id: str = "", arrival_time: float | None = None) -> RequestStream:
        """Queues an arrival from a prefill replica (a decode replica's request): its first token is the stream's
        first event at once, the rest follow as it decodes here. `arrival_time` (perf_counter): when the request
        reached this server, before its prefill, so that its TTFT here counts the prefill and the hand-off."""
        self._admissible()
        seq = self.llm.new_handoff(handoff, params)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        stream = self._queue(RequestStream(seq, TextStream(self.decode, stop), request_id, handoff))
        self._deliver_tokens(stream, None, time.perf_counter())
        return stream

    def _admissible(self) -> None:
        if self.draining:
            raise Draining("the server is shutting down")
        waiting = len(self._pending) + self.llm.stats().waiting
        if waiting >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are already waiting")

    def _queue(self, stream: RequestStream) -> RequestStream:
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

    async def on_step_thread(self, work: Callable[[LLM], Result]) -> Result:
        """`work(llm)` run between two steps; its result (or its exception) once it ran."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Result] = loop.create_future()

        def hook(llm: LLM) -> None:
            try:
                result = work(llm)
            except Exception as error:      # handed to the awaiting handler, which reports it
                loop.call_soon_threadsafe(done.set_exception, error)
            else:
                loop.call_soon_threadsafe(done.set_result, result)

        self.between_steps(hook)
        return await done

    def request_ids(self, seq_ids: tuple[int, ...]) -> list[str]:
        """The response ids of the engine's requests that clients wait on (callable from the step thread: one
        atomic dict lookup each, never a KeyError when a handler ends a stream meanwhile)."""
        streams = [self._streams.get(seq_id) for seq_id in seq_ids]
        return [stream.request_id for stream in streams if stream is not None]

    async def drain(self, timeout_s: float, abort_now: asyncio.Event) -> DrainReport:
        """Admits nothing more, lets the requests in flight finish for up to `timeout_s` (or until `abort_now`),
        then ends the rest with an error and waits for the engine to free their pages."""
        self.draining = True
        in_flight = self.num_in_flight
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline and not abort_now.is_set():
            await asyncio.sleep(0.05)
        remaining = list(self._streams.values())
        for stream in remaining:
            self._end(stream, Event("", 0, error=f"the server is shutting down: the request did not finish within "
                                                 f"the drain timeout of {timeout_s:g} s", error_type="shutdown"))
            self._aborts.append(stream.seq.seq_id)
            self.metrics.finished.labels(FinishReason.ABORT.value).inc()
        settled = await self._settle(SETTLE_TIMEOUT_S)
        return DrainReport(in_flight, in_flight - len(remaining), len(remaining), self.pages_held, settled)

    async def _settle(self, timeout_s: float) -> bool:
        """Waits for a step cycle that leaves nothing to do (every abort applied, nothing running)."""
        self._idle.clear()
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    @property
    def pages_held(self) -> int:
        """KV pages requests hold: used pages less the quarantined ones, which no request holds."""
        return self.llm.stats().held_pages

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._pending or self._aborts or self._hooks or self.llm.has_unfinished()):
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            new, self._pending = [(stream.seq, stream.handoff) for stream in self._pending], []
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
    def _step(self, new: list[tuple[Sequence, KVHandoff | None]], aborts: list[int],
              hooks: list[Callable[[LLM], None]]) -> list[RequestOutput]:
        """On the step thread: what handlers handed over, then one step."""
        for seq, handoff in new:
            if handoff is None:
                self.llm.submit(seq)
            else:
                self.llm.queue_handoff(seq, handoff)
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
        output = self.llm.last_step
        if output is None or output.is_empty:
            return
        shape = batch_shape(output, self.llm.model_config.attention.index_topk)
        self.metrics.step_seconds.labels(regime_of(shape)).observe(seconds)
        if self._step_trace is not None:
            line = {"start_s": round(started, 6), "duration_s": round(seconds, 6), "batch": shape,
                    "more": self.llm.has_unfinished()}
            verified = [item for item in output.chunks if item.drafts]
            if verified:            # speculative decoding: drafts verified in the step, and those that stood
                line |= {"drafts": sum(len(item.drafts) for item in verified),
                         "accepted": sum(item.num_accepted for item in verified)}
            self._step_trace.write(json.dumps(line) + "\n")
            self._step_trace.flush()

    def _deliver(self, finished: list[RequestOutput]) -> None:
        now = time.perf_counter()
        ended = {output.request_id: output for output in finished}
        for seq_id, stream in list(self._streams.items()):
            output = ended.get(seq_id)
            if output is not None and output.finish_reason == FinishReason.INTEGRITY_ERROR.value:
                self.metrics.integrity_aborts.inc()
                self.metrics.finished.labels(output.finish_reason).inc()
                self._end(stream, Event("", 0, error="a KV-cache integrity check failed: the request was aborted "
                                                    "before it could answer", error_type="integrity_error"))
                continue
            self._deliver_tokens(stream, output, now)

    def _deliver_tokens(self, stream: RequestStream, output: RequestOutput | None, now: float) -> None:
        """The tokens a stream has not sent yet, and its end if `output` (its finished request) is given."""
        reason = None if output is None else output.finish_reason
        token_ids = stream.seq.output_token_ids
        new = len(token_ids) - stream.sent_tokens
        if not new and reason is None:
            return
        text = stream.text.update(token_ids, final=reason is not None)
        new_ids = tuple(token_ids[stream.sent_tokens:])
        self._observe_tokens(stream, new, now)
        if stream.text.stopped and reason is None:        # a stop string: the engine need not go on
            reason = FinishReason.STOP.value
            self._aborts.append(stream.seq.seq_id)
        if reason is None:
            stream.events.put_nowait(Event(text, new, new_ids))
            return
        self.metrics.finished.labels(reason).inc()
        self._end(stream, Event(text, new, new_ids, reason, handoff=None if output is None else output.handoff))

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
        stats, before, metrics = self.llm.stats(), self._counted, self.metrics
        metrics.running.set(stats.running)
        metrics.waiting.set(stats.waiting + len(self._pending))
        metrics.pages_used.set(stats.held_pages)
        metrics.pages_quarantined.set(stats.quarantined_pages)
        metrics.pages_free.set(stats.free_pages)
        metrics.pages_cached.set(stats.cached_pages)
        metrics.preemptions.inc(stats.preemptions - before.preemptions)
        metrics.prefix_queries.inc(stats.prefix_queried_tokens - before.prefix_queried_tokens)
        metrics.prefix_hits.inc(stats.prefix_hit_tokens - before.prefix_hit_tokens)
        metrics.draft_tokens.inc(stats.draft_tokens - before.draft_tokens)
        metrics.accepted_tokens.inc(stats.accepted_tokens - before.accepted_tokens)
        self._counted = stats


