"""Disaggregated serving in the simulator: a prefill pool and a decode pool, each replica the engine's scheduler.

    arrivals ──► prefill replica (least loaded) ── prompt + first token ──► hand-off link ──► decode replica
                 Scheduler + BlockManager, max_tokens 1                     bytes / bandwidth    admitted by free
                                                                            (queued per sender    pages (the same
                                                                            and per receiver)     Scheduler)

A request runs its prompt on a prefill replica, which samples its first token and frees its pages, as the
engine's prefill replica does (`engine.core.handoff`); its KV then crosses the link to the least-loaded decode
replica: every page the prompt touched (`engine.core.memory.handoff_bytes`), in the order transfers were ready,
one at a time out of each prefill replica and into each decode replica. Its first token reaches the client when
the pages have arrived, so TTFT includes the hand-off; the decode replica admits it when its pool holds the
prompt's pages (`Scheduler.add_computed`) and decodes the rest.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import simpy

from engine.core.config import SchedulerConfig
from engine.core.metrics import RequestTiming
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import SamplingParams, Sequence
from planner.errors import PlannerError
from planner.simulation.simulator import (
    Replica,
    SimulatedSequence,
    Simulation,
    SimulationResult,
    StepRecord,
    StepTime,
)
from planner.simulation.workload import RequestSpec


@dataclass(frozen=True)
class ByteCost:
    """Seconds for moving bytes: `latency_s` + bytes / `bytes_per_s`."""

    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise PlannerError(f"a bandwidth must be positive, got {self.bytes_per_s!r} bytes/s")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise PlannerError(f"a latency must be >= 0 s, got {self.latency_s!r}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class HandoffLink(ByteCost):
    """What a hand-off costs: `bytes_of(prompt_tokens)` over the link (one prefill replica to one decode
    replica). Where the engines copy pages out and in on their own step (`pack`: copied out and checksummed in the
    prefill step that ends the prompt; `unpack`: checked and copied in, in the decode step that admits it) those
    costs lengthen those steps; GPU serving engines move pages by DMA beside their steps (None)."""

    bytes_of: Callable[[int], int] = field(default=lambda tokens: 0)
    pack: ByteCost | None = None
    unpack: ByteCost | None = None


@dataclass
class HandoffStats:
    transfers: int = 0
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)      # each transfer, queueing included
    prefill_peak_pages: int = 0


class PrefillPool:
    """What the prefill replicas report to: their own request records (a prompt and one token each), their steps
    into the simulation's, and each finished prefill to the hand-off."""

    def __init__(self, sim: DisaggregatedSimulation) -> None:
        self.sim = sim
        self.timings: dict[int, RequestTiming] = {}

    def observe(self, timing: RequestTiming) -> None:
        """The prefill's own first token is not the client's: that one arrives with the hand-off."""

    def note_step(self, replica: int, start: float, duration: float, output: Any, pages: int, running: int) -> None:
        self.sim.note_prefill_step(replica, start, duration, output, pages, running)

    def note_pages(self, pages: int) -> None:
        self.sim.stats.prefill_peak_pages = max(self.sim.stats.prefill_peak_pages, pages)

    def finished(self, seq: Sequence) -> None:
        del self.timings[seq.seq_id]
        self.sim.env.process(self.sim.hand_off(seq))


class DisaggregatedSimulation(Simulation):
    """Requests of a workload through `prefill_replicas` prefill engines and `replicas` decode engines."""

    def __init__(self, prefill_config: SchedulerConfig, prefill_step_time: StepTime, prefill_replicas: int,
                 config: SchedulerConfig, step_time: StepTime, replicas: int, link: HandoffLink,
                 prefill_receive_interval: int = 1, **options: Any) -> None:
        """`prefill_receive_interval`: the prefill replicas' `receive_interval`; the decode replicas' is among the
        `Simulation` options."""
        if options.get("speculation") is not None:
            raise PlannerError("speculative decoding with disaggregated pools is not simulated yet")
        if not isinstance(prefill_replicas, int) or prefill_replicas <= 0:
            raise PlannerError(f"the prefill replicas must be a positive integer, got {prefill_replicas!r}")
        if prefill_config.page_size != config.page_size:
            raise PlannerError(f"the pools' pages differ ({prefill_config.page_size} and {config.page_size} tokens): "
                               f"a hand-off moves whole pages")
        super().__init__(config, step_time, replicas, **options)
        self.link = link
        self.stats = HandoffStats()
        self.prefill_config = prefill_config
        self._pool = PrefillPool(self)
        self.prefill = [Replica(self.env, replicas + index, prefill_config, prefill_step_time, self._pool,
                                options.get("fast_forward", True) and not self.record_steps,
                                receive_interval=prefill_receive_interval)
                        for index in range(prefill_replicas)]
        if link.pack is not None:
            for replica in self.prefill:
                replica.step_extra = self._packing
        if link.unpack is not None:
            for replica in self.replicas:
                replica.step_extra = self._unpacking
        self._senders = [simpy.Resource(self.env) for _ in self.prefill]
        self._receivers = [simpy.Resource(self.env) for _ in self.replicas]
        self._outputs: dict[int, int] = {}
        self._unique: dict[int, bool] = {}
        self._sent_by: dict[int, int] = {}

    def _packing(self, output: SchedulerOutput) -> float:
        """The pages copied out in a prefill step: of every prompt whose first token it samples."""
        return sum(self.link.pack.seconds(self.link.bytes_of(item.seq.num_prompt_tokens))
                   for item in output.chunks if item.samples)

    def _unpacking(self, output: SchedulerOutput) -> float:
        """The pages checked and copied in, in a decode step: of every hand-off it admits."""
        return sum(self.link.unpack.seconds(self.link.bytes_of(seq.num_prompt_tokens)) for seq in output.arrived)

    def submit(self, request: RequestSpec) -> None:
        for name, config in (("prefill", self.prefill_config), ("decode", self.config)):
            total = request.prompt_tokens + (1 if name == "prefill" else request.output_tokens)
            if total > config.max_model_len or total > config.capacity_tokens:
                raise PlannerError(f"request {request.request_id}: {total} tokens exceed the {name} replicas' "
                                   f"context ({config.max_model_len}) or KV pool ({config.capacity_tokens})")
        unique = request.prompt_ids is None and request.follows is None
        seq = SimulatedSequence(self._prompt(request), SamplingParams(max_tokens=1, ignore_eos=True),
                                seq_id=request.request_id, unique=unique)
        self.timings[request.request_id] = RequestTiming(request.request_id, self.env.now, seq.num_prompt_tokens)
        self._pool.timings[request.request_id] = RequestTiming(request.request_id, self.env.now,
                                                               seq.num_prompt_tokens)
        self._outputs[request.request_id] = request.output_tokens
        self._unique[request.request_id] = unique
        if self.request_overhead_s:
            self.env.process(self._admit_later(seq))
        else:
            self._route_prefill(seq)

    def _admit_later(self, seq: Sequence):
        yield self.env.timeout(self.request_overhead_s)
        self._route_prefill(seq)

    def _route_prefill(self, seq: Sequence) -> None:
        replica = min(self.prefill, key=lambda candidate: candidate.unfinished)
        self._sent_by[seq.seq_id] = self.prefill.index(replica)
        replica.submit(seq)

    def hand_off(self, seq: Sequence):
        """A finished prefill's pages to the least-loaded decode replica, then its first token to the client."""
        ready = self.env.now
        target = min(range(len(self.replicas)), key=lambda index: self.replicas[index].unfinished)
        self.replicas[target].unfinished += 1            # on its way there: the router counts it
        num_bytes = self.link.bytes_of(seq.num_prompt_tokens)
        with self._senders[self._sent_by.pop(seq.seq_id)].request() as sending:
            yield sending
            with self._receivers[target].request() as receiving:
                yield receiving
                yield self.env.timeout(self.link.seconds(num_bytes))
        self.replicas[target].unfinished -= 1
        self.stats.transfers += 1
        self.stats.bytes += num_bytes
        self.stats.seconds.append(self.env.now - ready)
        arrival = SimulatedSequence(seq.prompt_token_ids, SamplingParams(max_tokens=self._outputs.pop(seq.seq_id),
                                                                         ignore_eos=True),
                                    seq_id=seq.seq_id, unique=self._unique.pop(seq.seq_id))
        arrival.num_computed_tokens = seq.num_prompt_tokens
        timing = self.timings[seq.seq_id]
        timing.first_token_s = self.env.now
        self.observe(timing)
        if arrival.append_token(0, self.config.max_model_len):       # one output token: done with the first
            timing.finish_s, timing.output_tokens = self.env.now, 1
            self.observe(timing)
            self.finished(arrival)
            return
        self.replicas[target].receive(arrival)

    def note_prefill_step(self, replica: int, start: float, duration: float, output: Any, pages: int,
                          running: int) -> None:
        self.step_count += 1
        self.stats.prefill_peak_pages = max(self.stats.prefill_peak_pages, pages)
        if self.record_steps and output is not None:
            self.steps.append(StepRecord(replica, start, duration, [(item.seq.seq_id, item.start, item.num_new_tokens)
                                                                    for item in output.scheduled], pages, running))

    def run(self, *args: Any, **kwargs: Any) -> SimulationResult:
        result = super().run(*args, **kwargs)
        result.preemptions += sum(replica.scheduler.num_preemptions for replica in self.prefill)
        return result
