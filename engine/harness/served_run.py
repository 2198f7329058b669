"""A serving loop over the real engine: requests arrive at given times, each step is timed, and every
request is measured with the definitions of `engine.core.metrics` (the simulator's).

Two clocks: `wall` (requests wait in real time; what a user would see) and `virtual` (time advances by the
measured step durations only; the loop's own overhead costs nothing). Either way requests are admitted
at step boundaries, and a step's recorded duration runs from one boundary to the next, so a simulator
replaying those durations sees the same instants and must form exactly the same batches. On the virtual
clock, work done between steps (`between_steps`, e.g. timing reference steps on another engine so both see
the same machine) is outside the served timeline.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.metrics import RequestTiming
from engine.core.sequence import SamplingParams
from engine.llm import LLM


@dataclass(frozen=True)
class ServeRequest:
    """A request at `arrival_s`; or, when it `follows` an earlier one (a later turn of a conversation, by index),
    sent `think_s` after that one ends, its prompt that one's prompt and answer followed by `prompt_token_ids`."""

    arrival_s: float
    prompt_token_ids: list[int]
    output_tokens: int
    follows: int | None = None
    think_s: float = 0.0


@dataclass
class ServedStep:
    start_s: float
    duration_s: float
    batch: list[tuple[int, int, int]]       # (request index, start token, tokens scheduled) in schedule order
    pages_in_use: int
    running: int


@dataclass
class ServeResult:
    timings: list[RequestTiming]
    steps: list[ServedStep] = field(default_factory=list)
    preemptions: int = 0


def serve_requests(llm: LLM, requests: list[ServeRequest], clock: str = "wall",
          between_steps: Callable[[int], None] | None = None) -> ServeResult:
    """Runs the requests to completion, admitting each at its arrival time (outputs of exactly
    `output_tokens` tokens: end-of-sequence is ignored). `between_steps(steps so far)` runs after each step."""
    if clock not in ("wall", "virtual"):
        raise ValueError(f"clock must be 'wall' or 'virtual', got {clock!r}")
    if between_steps is not None and clock != "virtual":
        raise ValueError("work between steps would be counted as serving time on the wall clock: use 'virtual'")
    follower = {r.follows: i for i, r in enumerate(requests) if r.follows is not None}
    # (send time, order, index), a heap: turns sent at one instant go in the order their predecessors ended, as the
    # simulator sends them
    due = [(r.arrival_s, i, i) for i, r in enumerate(requests) if r.follows is None]
    heapq.heapify(due)
    order = itertools.count(len(requests))
    prompts = {i: r.prompt_token_ids for i, r in enumerate(requests) if r.follows is None}
    timings = [RequestTiming(i, r.arrival_s, len(r.prompt_token_ids)) for i, r in enumerate(requests)]
    index_of: dict[int, int] = {}
    steps: list[ServedStep] = []
    preemptions_before = llm.num_preemptions
    origin = time.perf_counter()
    now = 0.0               # step boundaries only: a simulator replaying the durations sees the same instants
    while due or llm.has_unfinished():
        while due and due[0][0] <= now:
            arrival, _, i = heapq.heappop(due)
            timings[i].arrival_s, timings[i].prompt_tokens = arrival, len(prompts[i])
            request_id = llm.add_request(prompts.pop(i),
                                         SamplingParams(max_tokens=requests[i].output_tokens, ignore_eos=True))
            index_of[request_id] = i
        if not llm.has_unfinished():
            now = due[0][0]
            if clock == "wall":
                time.sleep(max(0.0, origin + now - time.perf_counter()))
            continue
        step_start = now
        start = time.perf_counter()
        finished = llm.step()
        end = time.perf_counter()
        now = end - origin if clock == "wall" else now + (end - start)
        duration = now - step_start
        output, stats = llm.last_step, llm.stats()
        steps.append(ServedStep(step_start, duration,
                                [(index_of[item.seq.seq_id], item.start, item.scheduled_tokens) for item in output.scheduled],
                                stats.used_pages, stats.running))
        for item in output.scheduled:
            timing = timings[index_of[item.seq.seq_id]]
            if item.samples and timing.first_token_s is None:
                timing.first_token_s = now
        for result in finished:
            i = index_of[result.request_id]
            timing = timings[i]
            timing.finish_s = now
            timing.output_tokens = len(result.token_ids)
            timing.preemptions = result.num_preemptions
            timing.cached_tokens = result.num_cached_tokens
            if i in follower:
                after = follower[i]
                prompts[after] = result.prompt_token_ids + result.token_ids + requests[after].prompt_token_ids
                heapq.heappush(due, (now + requests[after].think_s, next(order), after))
        if between_steps is not None:
            between_steps(len(steps))
    return ServeResult(timings, steps, llm.num_preemptions - preemptions_before)
