"""Graceful shutdown: SIGTERM or SIGINT drains the engine before uvicorn stops.

uvicorn alone closes its listening socket at the first signal and waits for open responses, so a client gets
a refused connection and a long generation holds the process for as long as it runs. Here the first signal
starts a drain instead: new requests get 503 with Retry-After (a load balancer retries elsewhere), /health
says draining, the requests in flight run on for up to the drain timeout, the rest end with an error (a final
SSE error event for a stream), their pages are freed, and only then does uvicorn stop; the process exits 0.
A second signal ends the drain at once.
"""
from __future__ import annotations

import asyncio
import signal
import sys
from types import FrameType

import uvicorn

from engine.server.async_engine import AsyncEngine, DrainReport


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.report: DrainReport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._abort_now: asyncio.Event | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._abort_now = asyncio.Event()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal handler: only schedules work on the event loop (and records no signal to raise
        again after the shutdown, as uvicorn's own handler does: the process exits 0)."""
        if self._loop is None:              # a signal before the server started: stop at once
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self._drain is not None:
            assert self._abort_now is not None
            self._abort_now.set()
            print(f"engine: {name} again: aborting the requests still in flight", file=sys.stderr, flush=True)
            return
        print(f"engine: {name}: draining {self.engine.num_in_flight} requests in flight (up to "
              f"{self.drain_timeout_s:g} s); new requests get 503", file=sys.stderr, flush=True)
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        assert self._abort_now is not None
        try:
            self.report = report = await self.engine.drain(self.drain_timeout_s, self._abort_now)
            print(f"engine: drained: {report.completed} of {report.in_flight} requests completed, {report.aborted} "
                  f"aborted, {report.pages_in_use} KV pages in use"
                  f"{'' if report.settled else ' (the engine did not settle: a step still ran)'}", file=sys.stderr,
                  flush=True)
        finally:
            self.should_exit = True
