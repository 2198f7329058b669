"""Discrete-event simulation of serving: SimPy processes around the engine's own scheduler.

    arrivals ──► router ──► replica 0: Scheduler + BlockManager ──► step ──► step ──► ...
                        └─► replica 1: ...

Each replica process does what `engine.llm.LLM.step` does, with a simulated clock: `schedule()` forms the
batch (the same `engine.core.scheduler.Scheduler` and `engine.core.block_manager.BlockManager` the engine runs,
preemptions included), the step lasts what the step-time model says for exactly that batch, then
`update()` takes the sampled tokens. Requests are sequences whose output length is enforced
(`ignore_eos`, `max_tokens`), so only lengths matter, and the identities of tokens, never their values.

With prefix caching (`SchedulerConfig.enable_prefix_caching`) a prompt's tokens say what it shares: a request
with `prompt_ids` has those (after its predecessor's prompt and answer, for a later turn of a session); one without
shares no page with any other, so that it hits only its own pages (after a preemption), as in the engine.

A replica may take new requests in only every so many decode steps, as SGLang's scheduler does with
`--scheduler-recv-interval N` (`sglang/srt/managers/scheduler_recv_skipper.py`): its loop polls the tokenizer for
requests once the steps since the last poll weigh N, a decode step (or a verification) weighing 1 and any step that
computed a prompt chunk weighing N, so it polls right after a prefill and while idle. Requests that arrive between
polls wait in the replica's inbox; their TTFT includes that wait.

A replica may also hold new prompts back to batch them, as TensorRT-LLM's executor does with
`batch_wait_timeout_iters` and `batch_wait_max_tokens_ratio` (`PyExecutor._waiting_requests`, `BatchWait`): while
requests decode, prompts that arrived wait until, with the decodes, they fill a share of the step's token budget,
or until they have been put off for so many steps; with nothing decoding they start at once.

With speculative decoding (`planner.simulation.speculation`) a decoding sequence proposes drafts before each
`schedule()` and, after the step, as many stand as the acceptance draws (seeded per replica); the scheduler and
the block manager verify and roll back as the engine does.

Metrics follow `engine.core.metrics`: a token exists at the end of the step that sampled it.
"""
from __future__ import annotations

import bisect
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import simpy

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.metrics import RequestTiming, summarize
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import SamplingParams, Sequence
from engine.core.step_shape import batch_shape
from planner.cost.step_model import BatchShape
from planner.errors import PlannerError
from planner.simulation.speculation import Speculation
from planner.simulation.workload import RequestSpec, Workload

ROUTERS = ("round-robin", "least-loaded")
MIN_WINDOW = 4              # decode steps worth fast-forwarding (fewer: the usual path is as quick)

StepTime = Callable[[SchedulerOutput], float]


@dataclass(frozen=True)
class BatchWait:
    """TensorRT-LLM's batch waiting (`batch_wait_timeout_iters`, `batch_wait_max_tokens_ratio`): while requests
    decode, new prompts are put off step after step until the decodes and the prompts the step could take fill
    `token_ratio` of its token budget, or until they were put off `steps` times. Both must be set: TensorRT-LLM
    waits for neither alone (a ratio of 0 is always met, a timeout of 0 always reached)."""

    steps: int
    token_ratio: float

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise PlannerError(f"batch waiting's steps must be a positive integer, got {self.steps!r}")
        if not (isinstance(self.token_ratio, (int, float)) and 0 < self.token_ratio <= 1):
            raise PlannerError(f"batch waiting's token ratio must be in (0, 1], got {self.token_ratio!r}")

    @classmethod
    def parse(cls, text: str) -> BatchWait:
        """`STEPS:RATIO`, as `--batch-wait 20:0.9`."""
        steps, _, ratio = text.partition(":")
        try:
            return cls(int(steps), float(ratio))
        except ValueError:
            raise PlannerError(f"batch waiting is STEPS:RATIO (e.g. 20:0.9), got {text!r}") from None


class SimulatedSequence(Sequence):
    """A simulated request. Its pages are named by Python's hash of (parent, tokens), not SHA-256: the simulator's
    tokens are its own synthetic identities, with no tenant to protect, and naming pages is on its hot path. A
    request that shares no token with any other (`unique`) names its pages (its id, page number) outright, and
    publishes them only when preempted (`Sequence.publishes_eagerly`): the engine publishes them as they fill, but
    nobody else can hit them, and the pages free either way are the same in number."""

    def __init__(self, *args: Any, unique: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unique = unique
        self.publishes_eagerly = not unique

    def page_names(self, count: int, page_size: int) -> tuple[list, list]:
        hashes, keys = self.page_hashes, self.page_keys
        if self.unique:
            if len(hashes) < count:
                hashes.extend((self.seq_id, index) for index in range(len(hashes), count))
            return hashes, hashes
        parent = hashes[-1] if hashes else 0
        for index in range(len(hashes), count):
            key = tuple(self.token_ids_between(index * page_size, (index + 1) * page_size))
            parent = hash((parent, key))
            keys.append(key)
            hashes.append(parent)
        return hashes, keys


def delay_to(now: float, then: float) -> float:
    """The delay SimPy adds to `now` to land on `then` float for float (`then - now` can miss it by an ulp)."""
    delay = then - now
    while now + delay < then:
        delay = math.nextafter(delay, math.inf)
    while now + delay > then:
        delay = math.nextafter(delay, -math.inf)
    return delay


class ModelStepTime:
    """A step-time function of the scheduler's batch, from one of a `BatchShape` (of a model whose sparse
    attention reads `index_topk` tokens per query; 0: dense). It also prices a step of decodes given by its sums,
    as the simulator's fast-forward needs: the same shape `batch_shape` makes of such a step, so the same time."""

    def __init__(self, step_seconds: Callable[[BatchShape], float], index_topk: int = 0) -> None:
        self.step_seconds = step_seconds
        self.index_topk = index_topk

    def __call__(self, output: SchedulerOutput) -> float:
        return self.step_seconds(BatchShape(**batch_shape(output, self.index_topk)))

    def decodes(self, count: int, context_tokens: int, max_context: int, selected_tokens: int) -> float:
        sparse = {"decode_selected_tokens": selected_tokens, "prefill_selected_pairs": 0} if self.index_topk else {}
        return self.step_seconds(BatchShape(count, context_tokens, max_context, **sparse))

    def for_replica(self, index: int, clock: Callable[[], float]) -> ModelStepTime:
        """What replica `index` calls (at simulated time `clock()`): this one for all; a recorder keeps one each."""
        return self


def model_step_time(step_seconds: Callable[[BatchShape], float], index_topk: int = 0) -> ModelStepTime:
    return ModelStepTime(step_seconds, index_topk)


def replayed_step_time(durations: list[float]) -> StepTime:
    """Measured step durations, in order: the simulator then keeps the engine's own clock."""
    remaining: Iterator[float] = iter(durations)

    def seconds(_output: SchedulerOutput) -> float:
        try:
            return next(remaining)
        except StopIteration:
            raise PlannerError(f"the simulation ran more steps than the {len(durations)} replayed") from None
    return seconds


@dataclass
class StepRecord:
    replica: int
    start_s: float
    duration_s: float
    batch: list[tuple[int, int, int]]       # (request id, start token, new tokens) in schedule order
    pages_in_use: int
    running: int


@dataclass
class SimulationResult:
    timings: list[RequestTiming]
    steps: list[StepRecord]             # empty unless steps were recorded
    num_steps: int
    peak_running: int                   # the most requests running at once on one replica
    kv_utilization_peak: float          # the fullest any replica's pool got
    replicas: int
    wall_s: float
    preemptions: int
    abandoned: bool = False             # stopped early by its `give_up` hook: the report covers what finished

    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0

    def report(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
        out = summarize(self.timings, slo_ttft_s, slo_tpot_s)
        out.update({
            "prefix_cache_hit_rate": self.prefix_hit_tokens / self.prefix_queried_tokens
            if self.prefix_queried_tokens else 0.0,
            "cached_tokens_per_request": sum(t.cached_tokens for t in self.timings) / max(1, len(self.timings)),
            "prefix_cache_evictions": self.evictions,
            "max_concurrency_reached": self.peak_running,
            "preemptions": self.preemptions,
            "kv_utilization_peak": self.kv_utilization_peak,
            "steps": self.num_steps,
            "sim_wall_s": self.wall_s,
        })
        return out


class Replica:
    """One engine: its scheduler and allocator, and the process that steps them."""

    def __init__(self, env: simpy.Environment, index: int, config: SchedulerConfig, step_time: StepTime,
                 sim: Simulation, fast_forward: bool = False, speculation: Speculation | None = None,
                 receive_interval: int = 1, batch_wait: BatchWait | None = None) -> None:
        if not isinstance(receive_interval, int) or receive_interval < 1:
            raise PlannerError(f"the scheduler's receive interval must be a positive integer of steps, got "
                               f"{receive_interval!r}")
        self.env = env
        self.index = index
        self.receive_interval = receive_interval
        self.batch_wait = batch_wait
        self.inbox: list[Sequence] = []     # submitted, not yet taken in (`receive_interval` above 1, `batch_wait`)
        self._since_poll = receive_interval     # the weight of the steps since the last poll
        self._put_off = 0                   # polls that left the inbox waiting for a fuller batch (`batch_wait`)
        self.speculation = speculation
        self.rng = random.Random(index)     # speculative drafts and their acceptance, seeded per replica
        fast_forward = fast_forward and speculation is None     # a window's decodes would carry drafts
        self.scheduler = Scheduler(config, BlockManager(config.num_pages, config.page_size,
                                                        config.enable_prefix_caching))
        self.sim = sim
        self.fast_forward = fast_forward and isinstance(step_time, ModelStepTime)
        self._window_step_start: float | None = None     # inside a window's shared timeout: its step's start
        self.step_time = (step_time.for_replica(index, self.step_start) if isinstance(step_time, ModelStepTime)
                          else step_time)
        self.steps = 0                  # steps this replica ran
        self.step_extra: Callable[[SchedulerOutput], float] | None = None      # work a step does beside the model
        self._no_window_until = 0       # the step before which no decode window can be long enough
        self.wakeup = env.event()
        self.unfinished = 0
        env.process(self.run())

    def step_start(self) -> float:
        """When the step being priced starts: the clock, or inside a decode window's shared timeout, the start of
        that step (a step recorder keeps it)."""
        return self.env.now if self._window_step_start is None else self._window_step_start

    def submit(self, seq: Sequence) -> None:
        if self.receive_interval > 1 or self.batch_wait is not None:
            self.inbox.append(seq)
        else:
            self.scheduler.add(seq)
        self._wake()

    def _poll(self) -> None:
        """Hands the inbox to the scheduler where the loop polls now (enough steps' weight since the last poll:
        found empty or not, a poll starts the count again) and batch waiting lets it, or where there is nothing to
        step (an idle loop polls at once and waits for nothing)."""
        if not self.scheduler.has_unfinished():
            self._take_inbox()
        elif self._since_poll >= self.receive_interval:
            self._since_poll = 0
            if self._batch_ready():
                self._take_inbox()
            else:
                self._put_off += 1

    def _take_inbox(self) -> None:
        for seq in self.inbox:
            self.scheduler.add(seq)
        self.inbox.clear()
        self._since_poll = 0
        self._put_off = 0

    def _batch_ready(self) -> bool:
        """Whether batch waiting lets the inbox's prompts start (an empty inbox: nothing to wait for). As
        TensorRT-LLM counts them: one token per decoding request, and each prompt whole, those the step's token
        budget takes in arrival order; with nothing running, no wait."""
        wait = self.batch_wait
        if wait is None or not self.inbox or not self.scheduler.running or self._put_off >= wait.steps:
            return True
        budget = self.scheduler.config.max_num_batched_tokens
        tokens = len(self.scheduler.running)
        for seq in self.inbox:
            if tokens + seq.num_prompt_tokens > budget:
                break
            tokens += seq.num_prompt_tokens
        return tokens >= wait.token_ratio * budget

    def _weigh(self, output: SchedulerOutput) -> None:
        """A decode step (verifications included) weighs 1 toward the next poll; a step with a prompt chunk, all."""
        extends = any(not item.is_decode and not item.drafts for item in output.chunks)
        self._since_poll += self.receive_interval if extends else 1

    def receive(self, seq: Sequence) -> None:
        """A request whose prompt a prefill replica computed and handed over (disaggregated serving)."""
        self.scheduler.add_computed(seq)
        self._wake()

    def _wake(self) -> None:
        self.unfinished += 1
        if not self.wakeup.triggered:
            self.wakeup.succeed()

    def run(self):
        """Steps while there is work; sleeps until a request arrives when there is none."""
        scheduler, env, sim = self.scheduler, self.env, self.sim
        timings = sim.timings
        while True:
            self._poll()
            if not scheduler.has_unfinished():
                yield self.wakeup
                self.wakeup = env.event()
                continue
            if self.fast_forward and (yield from self.decode_window()):
                continue
            if self.speculation is not None:
                scheduler.set_drafts(self.draw_drafts)
            output = scheduler.schedule()
            if output.is_empty:
                raise PlannerError("the scheduler formed an empty batch with requests waiting: a request "
                                   "larger than the KV pool")
            start = env.now
            duration = self.step_time(output)
            if self.step_extra is not None:
                duration += self.step_extra(output)
            if self.speculation is not None and self.speculation.draft_step_share:
                duration += self.draft_seconds(output)
            self.steps += 1
            yield env.timeout(duration)
            self._weigh(output)
            sim.note_step(self.index, start, duration, output, scheduler.block_manager.num_used_pages,
                          len(scheduler.running))
            now = env.now
            if self.speculation is not None:
                for item in output.chunks:
                    if item.drafts:
                        drafting = self.speculation.of_request(item.seq.seq_id)
                        item.accept(drafting.draw_accepted(self.rng, len(item.drafts)))
            # a decode samples its request's first token only when the prompt's last chunk left one token
            first_tokens = [seq for seq in output.decodes if not seq.output_token_ids]
            for seq in first_tokens + [item.seq for item in output.chunks if item.samples]:
                timing = timings[seq.seq_id]
                if timing.first_token_s is None:
                    timing.first_token_s = now
                    sim.observe(timing)
            for seq in scheduler.update(output, None):
                timing = timings[seq.seq_id]
                if timing.finish_s is not None:
                    raise PlannerError(f"request {seq.seq_id} finished twice")
                timing.finish_s = now
                timing.output_tokens = len(seq.output_token_ids)
                timing.preemptions = seq.num_preemptions
                timing.cached_tokens = seq.num_cached_tokens or 0
                self.unfinished -= 1
                sim.observe(timing)
                sim.finished(seq)

    def draw_drafts(self, seq: Sequence, room: int) -> list[int]:
        """Placeholder drafts, as many as the request's speculation draws and `room` allows."""
        return [0] * self.speculation.of_request(seq.seq_id).draw_drafts(self.rng, room)

    def draft_seconds(self, output: SchedulerOutput) -> float:
        """The drafts' own cost in a step: one draft pass per position over the sequences that proposed, each a
        share of a decode step of those sequences."""
        drafting = [item for item in output.chunks if item.drafts]
        if not drafting or not isinstance(self.step_time, ModelStepTime):
            return 0.0
        contexts = [item.start + 1 for item in drafting]
        topk = self.step_time.index_topk
        selected = sum(min(context, topk) for context in contexts) if topk else 0
        one_pass = self.step_time.decodes(len(drafting), sum(contexts), max(contexts), selected)
        return self.speculation.draft_step_share * max(len(item.drafts) for item in drafting) * one_pass

    def decode_window(self):
        """Fast-forwards through steps in which nothing can happen but decoding: every running sequence decodes,
        none finishes, none could be admitted, the pool takes every page they grow into, and nothing arrives
        (an arrival ends the window after the step it came in, or after the step the loop would poll it in). Each
        step is priced from the shape the scheduler would have given it and its time added as SimPy adds a
        timeout's, so the clock is the step-by-step one, float for float; the steps that end before any other
        process's next event share one timeout, and the per-sequence bookkeeping is done once for the whole window.
        Returns the steps taken (0: none could)."""
        scheduler = self.scheduler
        manager, running, config = scheduler.block_manager, scheduler.running, scheduler.config
        count = len(running)
        if (self.steps < self._no_window_until or not count or scheduler.arrivals
                or scheduler.admissible(config.max_num_batched_tokens - count) is not None
                or running[-1].num_uncomputed_tokens != 1       # the newest, the likeliest to be in prefill
                or not all(seq.output_token_ids for seq in running)     # one prompt token left is no decode yet
                or scheduler.decode_prefix(config.max_num_batched_tokens) < count):     # all decode, in budget
            return 0
        # the step a sequence finishes in runs the usual way, and none is long enough until that one has finished
        window = min(min(seq.params.max_tokens - len(seq.output_token_ids) for seq in running),
                     config.max_model_len - max(seq.num_tokens for seq in running)) - 1
        if window < MIN_WINDOW:
            self._no_window_until = self.steps + window + 1
            return 0
        ids = [seq.seq_id for seq in running]
        free = manager.num_free_pages
        if manager.pages_for_more(ids, window) > free:
            low, high = 0, window                           # the longest window the free pages take
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if manager.pages_for_more(ids, middle) <= free else (low, middle)
            window = low
        if window < MIN_WINDOW:
            return 0
        contexts = sorted(seq.num_computed_tokens for seq in running)   # a decode's context in step j: c + j
        prefix = list(itertools.accumulate(contexts, initial=0))
        total, longest, topk = prefix[-1], contexts[-1], self.step_time.index_topk
        env, sim, used = self.env, self.sim, manager.num_used_pages
        waiting = len(scheduler.waiting) + len(scheduler.arrivals)
        steps = 0
        while steps < window:
            # the steps that end before any other process's next event run under one timeout: nothing can happen
            # between them, so each is polled at once; the last one, after whatever came while it ran
            horizon, start = env.peek(), env.now
            clock, polled_out = start, False
            while not polled_out:
                steps += 1
                below = bisect.bisect_left(contexts, topk - steps) if topk else 0    # contexts still under index_topk
                selected = prefix[below] + steps * below + topk * (count - below)
                self._window_step_start = clock
                duration = self.step_time.decodes(count, total + count * steps, longest + steps, selected)
                sim.note_step(self.index, clock, duration, None, used, count)
                self.steps += 1
                clock += duration               # as SimPy's clock adds each step's timeout
                if steps == window or clock >= horizon:
                    break
                polled_out = self._poll_ends_window()
            self._window_step_start = None
            yield env.timeout(delay_to(start, clock))
            if polled_out or self._poll_ends_window():
                break
            if len(scheduler.waiting) + len(scheduler.arrivals) != waiting:
                break
        scheduler.advance_decodes(steps)
        sim.note_pages(manager.num_used_pages)
        return steps

    def _poll_ends_window(self) -> bool:
        """After a window's decode step: whether the loop's poll would take a batch from the inbox now."""
        self._since_poll += 1
        if self._since_poll >= self.receive_interval:
            if self.inbox and self._batch_ready():
                return True
            self._since_poll = 0        # the loop polls and finds nothing, or batch waiting puts it off
            self._put_off += bool(self.inbox)
        return False


class Simulation:
    """Requests of a workload through `replicas` engines behind a router."""

    def __init__(self, config: SchedulerConfig, step_time: StepTime, replicas: int = 1,
                 router: str = "least-loaded", record_steps: bool = True, progress: bool = False,
                 give_up: Callable[[RequestTiming], bool] | None = None, fast_forward: bool = True,
                 request_overhead_s: float = 0.0, speculation: Speculation | None = None,
                 receive_interval: int = 1, batch_wait: BatchWait | None = None) -> None:
        """`give_up(timing)`, asked at each request's first token and at its end, stops the simulation when it
        says the outcome is settled (a search's SLO already missed). `fast_forward`: pure decode windows are
        stepped in one go (`Replica.decode_window`; not while recording steps, whose batches it does not form).
        `request_overhead_s`: each request reaches the scheduler that long after it arrives (the API server's time,
        `StepParameters.request_overhead_s`); its TTFT and end-to-end latency include it. `receive_interval`: the
        decode steps between a replica's polls for new requests (SGLang's `--scheduler-recv-interval`; 1: every
        step). `batch_wait`: new prompts held back for a fuller batch (TensorRT-LLM's; None: none)."""
        if router not in ROUTERS:
            raise PlannerError(f"unknown router {router!r} (choose from {', '.join(ROUTERS)})")
        if not isinstance(replicas, int) or replicas <= 0:
            raise PlannerError(f"the number of replicas must be a positive integer, got {replicas!r}")
        if not (math.isfinite(request_overhead_s) and request_overhead_s >= 0):
            raise PlannerError(f"the request overhead must be >= 0 seconds, got {request_overhead_s!r}")
        self.config = config
        self.request_overhead_s = request_overhead_s
        self.env = simpy.Environment()
        self.timings: dict[int, RequestTiming] = {}
        self.steps: list[StepRecord] = []
        self.record_steps = record_steps
        self.peak_pages = 0
        self.peak_running = 0
        self.step_count = 0
        self.router = router
        self._round_robin = itertools.cycle(range(replicas))
        self.replicas = [Replica(self.env, i, config, step_time, self, fast_forward and not record_steps, speculation,
                                 receive_interval, batch_wait) for i in range(replicas)]
        self._closed_loop: Callable[[int], None] | None = None
        self._followers: dict[int, RequestSpec] = {}        # a session's next turn, by the request it follows
        self._transcripts: dict[int, list[int]] = {}        # prompt + answer of a request someone follows
        self._bar = _progress_bar() if progress else None
        self._give_up = give_up
        self._done = self.env.event()       # every request finished, or given up on
        self._expected = 0
        self._finished = 0
        self.abandoned = False

    def observe(self, timing: RequestTiming) -> None:
        if self._give_up is not None and not self.abandoned and self._give_up(timing):
            self.abandoned = True
            self._done.succeed()

    def note_step(self, replica: int, start: float, duration: float, output: SchedulerOutput, pages: int,
                  running: int) -> None:
        self.step_count += 1
        if pages > self.peak_pages:
            self.peak_pages = pages
        if running > self.peak_running:
            self.peak_running = running
        if self.record_steps:
            self.steps.append(StepRecord(replica, start, duration, [(item.seq.seq_id, item.start, item.num_new_tokens)
                                                                     for item in output.scheduled], pages, running))

    def note_pages(self, pages: int) -> None:
        self.peak_pages = max(self.peak_pages, pages)

    def finished(self, seq: Sequence) -> None:
        """Counts a request done; sends the next turn of its conversation (its prompt this one's prompt and answer,
        then its own), or a closed-loop user's next request."""
        if self._bar is not None:
            self._bar.update()
        self._finished += 1
        if self._finished == self._expected and not self._done.triggered:
            self._done.succeed()
        follower = self._followers.pop(seq.seq_id, None)
        if follower is not None:
            self._transcripts[seq.seq_id] = seq.prompt_token_ids + seq.output_token_ids
            if follower.think_s:
                self.env.process(self._after(follower.think_s, follower))
            else:
                self.submit(follower)
        elif self._closed_loop is not None:
            self._closed_loop(seq.seq_id)

    def _route(self) -> Replica:
        if self.router == "round-robin":
            return self.replicas[next(self._round_robin)]
        return min(self.replicas, key=lambda replica: replica.unfinished)

    def _prompt(self, request: RequestSpec) -> list[int]:
        """The request's token identities (see the module's docstring)."""
        if request.follows is not None:
            return self._transcripts.pop(request.follows) + list(request.prompt_ids or ())
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        return [0] * request.prompt_tokens          # named apart from every other request's (`SimulatedSequence`)

    def submit(self, request: RequestSpec) -> None:
        total = request.prompt_tokens + request.output_tokens
        if total > self.config.max_model_len or total > self.config.capacity_tokens:
            raise PlannerError(f"request {request.request_id}: {request.prompt_tokens} + {request.output_tokens} "
                               f"tokens exceed the context ({self.config.max_model_len}) or the KV pool "
                               f"({self.config.capacity_tokens})")
        seq = SimulatedSequence(self._prompt(request),
                                SamplingParams(max_tokens=request.output_tokens, ignore_eos=True),
                                seq_id=request.request_id,
                                unique=request.prompt_ids is None and request.follows is None)
        self.timings[request.request_id] = RequestTiming(request.request_id, self.env.now, seq.num_prompt_tokens)
        if self.request_overhead_s:
            self.env.process(self._admit_later(seq))
        else:
            self._route().submit(seq)

    def _admit_later(self, seq: Sequence):
        """Hands a request to a replica once the API server has taken its time over it."""
        yield self.env.timeout(self.request_overhead_s)
        self._route().submit(seq)

    def _open_arrivals(self, requests: list[RequestSpec]):
        """Sends each request at its arrival time (ties in the order given)."""
        for request in sorted(requests, key=lambda r: r.arrival_s):
            delay = request.arrival_s - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            self.submit(request)

    def run(self, workload: Workload | list[RequestSpec], users: int | None = None,
            think_time_s: float = 0.0) -> SimulationResult:
        """Simulates until every request has finished."""
        if isinstance(workload, Workload):
            users, think_time_s = workload.users, workload.think_time_s
            closed = workload.arrival == "closed"
            requests = workload.requests()
        else:
            requests, closed = workload, users is not None
        if self._bar is not None:
            self._bar.reset(total=len(requests))
        self._expected = len(requests)
        self._followers = {request.follows: request for request in requests if request.follows is not None}
        first_turns = [request for request in requests if request.follows is None]
        start = time.perf_counter()
        if closed:
            pending = iter(first_turns)

            def send_next(_finished: int | None = None) -> None:
                request = next(pending, None)
                if request is None:
                    return
                if think_time_s and _finished is not None:
                    self.env.process(self._after(think_time_s, request))
                else:
                    self.submit(request)

            self._closed_loop = send_next
            for _ in range(min(users, len(first_turns))):
                send_next()
        else:
            self.env.process(self._open_arrivals(first_turns))
        self._done.callbacks.append(simpy.core.StopSimulation.callback)     # ends run() when it triggers
        self.env.run()
        if self._bar is not None:
            self._bar.close()
        unfinished = [r.request_id for r in requests if self.timings.get(r.request_id) is None
                      or self.timings[r.request_id].finish_s is None]
        if unfinished and not self.abandoned:
            raise PlannerError(f"{len(unfinished)} requests never finished (first: {unfinished[0]})")
        schedulers = [replica.scheduler for replica in self.replicas]
        return SimulationResult(list(self.timings.values()), self.steps, self.step_count, self.peak_running,
                                self.peak_pages / self.config.num_pages, len(self.replicas),
                                time.perf_counter() - start, sum(s.num_preemptions for s in schedulers),
                                self.abandoned, sum(s.prefix_queried_tokens for s in schedulers),
                                sum(s.prefix_hit_tokens for s in schedulers),
                                sum(s.block_manager.evictions for s in schedulers))

    def _after(self, delay: float, request: RequestSpec):
        """Submits a closed-loop user's next request after its think time."""
        yield self.env.timeout(delay)
        self.submit(request)


def _progress_bar():
    from tqdm import tqdm

    return tqdm(total=0, file=sys.stderr, unit="req", dynamic_ncols=True, disable=None)
