"""A disaggregated serving loop over two real engines: a prefill engine and a decode engine, each on a clock of
its own, as if each had its machine.

Both clocks are virtual (`engine.harness.served_run`): an engine's time advances by its measured step durations
only, and the two are stepped in the order of their clocks, so each sees the instants it would see running beside
the other; on two cores they would fight over the CPU instead. A request arrives at the prefill engine, which
computes its prompt and first token and copies its pages out (`LLM.new_sequence(hands_off=True)`); the hand-off is
encoded into its wire frame and decoded again, which takes what it takes (the link of this loop: a copy through
memory), and reaches the decode engine that long after the prefill step ended (the hand-offs of one step cross one
after another, as over one link). Its first token reaches the client then; the decode engine admits it at its first step boundary after that.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.handoff import KVHandoff
from engine.core.metrics import RequestTiming
from engine.core.sequence import SamplingParams
from engine.harness.served_run import ServedStep, ServeRequest
from engine.llm import LLM


@dataclass(frozen=True)
class HandedOff:
    request: int
    num_bytes: int          # the pages' bytes, as the frame carries them
    ready_s: float          # the prefill step that ended it ended
    arrived_s: float        # the frame decoded at the decode engine


@dataclass
class PairResult:
    timings: list[RequestTiming]
    prefill_steps: list[ServedStep] = field(default_factory=list)
    decode_steps: list[ServedStep] = field(default_factory=list)
    handoffs: list[HandedOff] = field(default_factory=list)
    preemptions: int = 0                # on the decode engine
    order: list[str] = field(default_factory=list)      # "prefill" or "decode": which engine took each step, in turn

    def steps_in_order(self) -> list[ServedStep]:
        """Both engines' steps in the order they ran (one machine ran them, one after another)."""
        steps = {"prefill": iter(self.prefill_steps), "decode": iter(self.decode_steps)}
        return [next(steps[role]) for role in self.order]


def serve_pair(prefill: LLM, decode: LLM, requests: list[ServeRequest],
               between_steps: Callable[[int], None] | None = None) -> PairResult:
    """Runs the requests (first turns only) to completion through the pair (exactly `output_tokens` tokens each).
    `between_steps(steps of both engines so far)` runs after each step, off both clocks."""
    if any(request.follows is not None for request in requests):
        raise ValueError("the disaggregated loop serves independent requests, not conversations")
    timings = [RequestTiming(i, r.arrival_s, len(r.prompt_token_ids)) for i, r in enumerate(requests)]
    due = sorted((r.arrival_s, i) for i, r in enumerate(requests))
    transit: list[tuple[float, int, int, KVHandoff]] = []          # (arrival, order, request, hand-off), a heap
    order = itertools.count()
    index_of: dict[tuple[str, int], int] = {}
    result = PairResult(timings)
    clocks = {"prefill": 0.0, "decode": 0.0}
    preemptions = decode.num_preemptions
    while due or transit or prefill.has_unfinished() or decode.has_unfinished():
        next_prefill = clocks["prefill"] if prefill.has_unfinished() else (due[0][0] if due else math.inf)
        next_decode = clocks["decode"] if decode.has_unfinished() else (transit[0][0] if transit else math.inf)
        if next_prefill <= next_decode:
            clocks["prefill"] = now = max(clocks["prefill"], next_prefill)
            while due and due[0][0] <= now:
                _, i = due.pop(0)
                params = SamplingParams(max_tokens=requests[i].output_tokens, ignore_eos=True)
                index_of["prefill", prefill.add_request(requests[i].prompt_token_ids, params, hands_off=True)] = i
            finished, end = _step(prefill, now, result, index_of, "prefill", between_steps)
            clocks["prefill"] = link_free = end
            for output in finished:             # one link: the step's hand-offs cross one after another
                i = index_of.pop(("prefill", output.request_id))
                started = time.perf_counter()
                handoff = KVHandoff.decode(output.handoff.encode())          # the link: the frame, both ways
                link_free += time.perf_counter() - started
                heapq.heappush(transit, (link_free, next(order), i, handoff))
                result.handoffs.append(HandedOff(i, len(handoff.payload), end, link_free))
            continue
        clocks["decode"] = now = max(clocks["decode"], next_decode)
        while transit and transit[0][0] <= now:
            arrival, _, i, handoff = heapq.heappop(transit)
            index_of["decode", decode.add_handoff(handoff)] = i
            timings[i].first_token_s = arrival
        finished, clocks["decode"] = _step(decode, now, result, index_of, "decode", between_steps)
        for output in finished:
            i = index_of.pop(("decode", output.request_id))
            timings[i].finish_s = clocks["decode"]
            timings[i].output_tokens = len(output.token_ids)
            timings[i].preemptions = output.num_preemptions
    result.preemptions = decode.num_preemptions - preemptions
    return result


def _step(llm: LLM, now: float, result: PairResult, index_of: dict[tuple[str, int], int], role: str,
          between_steps: Callable[[int], None] | None) -> tuple[list, float]:
    """One timed step of `llm` (the `role` engine) from `now`; its finished requests and the instant it ended."""
    if not llm.has_unfinished():
        return [], now
    started = time.perf_counter()
    finished = llm.step()
    end = now + time.perf_counter() - started
    output, stats = llm.last_step, llm.stats()
    steps = result.prefill_steps if role == "prefill" else result.decode_steps
    steps.append(ServedStep(now, end - now, [(index_of.get((role, item.seq.seq_id), -1), item.start,
                                              item.scheduled_tokens) for item in output.scheduled],
                            stats.used_pages, stats.running))
    result.order.append(role)
    if between_steps is not None:
        between_steps(len(result.order))
    return finished, end
