"""The drift probes' reference engine in a process of its own, for verifying a tensor-parallel profile.

A process belongs to one `torch.distributed` group, so the tensor-parallel engine under verification and a
second one that times the profile's steps again cannot share it. This process builds the reference engine
(and its own worker ranks) and answers `Profiler` questions over a pipe; the served engine's ranks wait in
their next broadcast meanwhile, as they would between requests.
"""
from __future__ import annotations

import multiprocessing
from typing import Any

from planner.errors import PlannerError

READY = "ready"
START_TIMEOUT_S = 600


def _serve_probes(connection: Any, fingerprint: dict[str, Any], kv_cache_gib: float, overrides: dict[str, Any]) -> None:
    """The child: builds the engine and its profiler, then answers ("can", sample) and ("time", sample)."""
    from engine.harness.profiler import Profiler, SweepPlan
    from planner.verification.engine_run import engine_of

    try:
        reference = engine_of(fingerprint, kv_cache_gib, **overrides)
    except Exception as error:  # noqa: BLE001 - reported to the parent as one line
        connection.send(f"{type(error).__name__}: {error}".splitlines()[0])
        return
    with reference:
        profiler = Profiler(reference, SweepPlan(warmup=1, repeats=1))
        connection.send(READY)
        while (message := connection.recv()) is not None:
            question, sample = message
            connection.send(profiler.can_remeasure(sample) if question == "can" else profiler.remeasure(sample))


class ProbeEngine:
    """`Profiler.can_remeasure` and `Profiler.remeasure` of an engine built as `engine_of(...)` in a child process."""

    def __init__(self, fingerprint: dict[str, Any], kv_cache_gib: float, **overrides: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        # not a daemon: its engine starts worker processes of its own
        self.process = context.Process(target=_serve_probes, args=(child, fingerprint, kv_cache_gib, overrides),
                                       name="verify-probe-engine")
        self.process.start()
        answer = self._receive(START_TIMEOUT_S)
        if answer != READY:
            self.close()
            raise PlannerError(f"the drift probes' engine did not start: {answer}")

    def _receive(self, timeout_s: float) -> Any:
        if not self.connection.poll(timeout_s):
            raise PlannerError(f"the drift probes' engine gave no answer within {timeout_s:.0f} s")
        try:
            return self.connection.recv()
        except EOFError:
            raise PlannerError("the drift probes' engine exited") from None

    def can_remeasure(self, sample: dict[str, Any]) -> bool:
        self.connection.send(("can", sample))
        return self._receive(START_TIMEOUT_S)

    def remeasure(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.connection.send(("time", sample))
        return self._receive(START_TIMEOUT_S)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.connection.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def __enter__(self) -> ProbeEngine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
