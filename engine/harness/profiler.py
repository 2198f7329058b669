"""Profiles the real engine: step times of prefill (one prompt or several), decode and mixed batches, and its
memory.

Every sample is a real `LLM.step()` of the configured engine. Decode points need B sequences with C
tokens already cached; prefilling them for real would take hours on a CPU, so the profiler reserves their
pages and marks their tokens computed, then times real decode steps over them. What those pages hold
does matter (FP8 pages convert zeros faster than real K/V), so before the first decode point the whole
pool is filled with one real prefill's K/V.

The profile is a versioned JSON document:

    {"version", "fingerprint": {engine version, device, cores and torch threads / SMs, memory, torch,
                                 triton, dtypes, measured copy bandwidth and matmul rate},
     "model": {shape, parameters}, "memory": {weight bytes, KV bytes per token, activation peak},
     "linears": {"rows", "decoder_s", "head_rows", "head_s"}: the linear layers alone, by row count,
     "samples": [{"kind": "prefill" | "decode" | "mixed" | "verify" | "prefix", "batch": {the step's shape},
                  "times_s": [...],
                  "median_s", "bytes_moved", "achieved_gb_s"[, "collective_s", "collective_bytes"]}],
     "collectives": [{"op", "bytes", "ranks", "median_s", "times_s"}]}   (tensor parallelism only)

Under tensor parallelism the times are rank 0's: its share of the work, and the collectives that wait for the
others (rank 0's time inside them, and the bytes it sent, per step).

`batch` holds the counts the planner's step model reads (`engine.core.step_shape.batch_shape`).

`prefix` samples prefill a prompt whose first tokens are already cached (seeded as decodes are): a prefix-cache hit,
or a long prompt's later chunk. Their attention reads the cached KV as well as the chunk's own, which a fresh
prompt's never does; TTFT under a shared system prompt or a chunked long prompt rests on them.

An engine with prompt-lookup speculation (`--speculative ngram:K`) is also timed verifying: B sequences at a
context, each checking K drafts a step (`verify` samples), at every decode batch and the shortest and longest
decode context; its other points are timed without drafts. This engine runs a verification as a small prefill
chunk, whose cost the prompts' chunks do not tell (a step's first verification costs more than the rest).
"""
from __future__ import annotations

import contextlib
import itertools
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.errors import ConfigError
from engine.core.memory import (
    pages_for_tokens,
)
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import SamplingParams, Sequence, SequenceStatus
from engine.core.step_shape import PROFILE_VERSION, batch_shape, bytes_moved
from engine.harness.fingerprint import fingerprint, model_section, routed_experts, synchronize
from engine.llm import LLM
from engine.model.quantized_linear import Fp8Linear, Int4Linear

# A point is timed in each pass as often as fits this many seconds (once at least, at most the cap): a step of
# SmolLM2's single decode jitters +-10% from one step to the next on this VM, and three timings left its
# median 12% above its neighbours' (the fit then missed every such step a light workload served by 12%)
SECONDS_PER_POINT_PER_PASS = 0.25
MAX_TIMINGS_PER_PASS = 8
# Message sizes (bytes) and repetitions of the collectives timed alone under tensor parallelism: from a decode
# step's all-reduce of one token's hidden state (a few KB) to a long prefill's (MBs).
COLLECTIVE_SIZES = [1 << k for k in range(10, 24, 2)]
COLLECTIVE_REPEATS = 10
# Row counts at which the linear layers are timed apart (`Profiler.linear_runs`): every count up to 8,
# then denser than powers of two, since BLAS picks its kernels by row count.
LINEAR_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256,
               384, 512, 768, 1024, 1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class SweepPlan:
    """Which points to time. Points that do not fit the KV pool or the context are left out."""

    prefill_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    # (tokens in all, prompts): prompts that queued up while a step ran are prefilled together, whole
    multi_prefills: tuple[tuple[int, int], ...] = ((512, 2), (1024, 4), (2048, 8))
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_contexts: tuple[int, ...] = (128, 512, 2048, 8192, 32768, 131072)
    # (decodes, their context, prefill tokens[, prompts those tokens are split into; 1 if left out])
    mixed: tuple[tuple[int, ...], ...] = ((4, 256, 64), (8, 512, 256), (16, 256, 512), (32, 1024, 128),
                                          (64, 128, 1024), (8, 256, 1024, 4), (16, 256, 2032, 8))
    # (new tokens, cached tokens before them): a prompt's chunk over a cached prefix
    prefix_prefills: tuple[tuple[int, int], ...] = ((64, 1024), (256, 4096), (512, 512), (1024, 8192), (2048, 2048))
    warmup: int = 1
    repeats: int = 3
    max_kv_tokens: int | None = None    # cap on cached tokens a step reads (the domain a CPU profile covers)

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_batches", "decode_contexts"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v <= 0 for v in values):
                raise ConfigError(f"{name} must be positive integers, got {values!r}")
        for tokens, prompts in self.multi_prefills:
            if not (isinstance(prompts, int) and isinstance(tokens, int) and 0 < prompts <= tokens):
                raise ConfigError(f"multi_prefills are (tokens in all, prompts) with 0 < prompts <= tokens, "
                                  f"got {(tokens, prompts)!r}")
        for point in self.prefix_prefills:
            if len(point) != 2 or any(not isinstance(v, int) or v <= 0 for v in point):
                raise ConfigError(f"prefix prefills are (new tokens, cached tokens) of positive integers, got "
                                  f"{point!r}")
        for point in self.mixed:
            if len(point) not in (3, 4) or any(not isinstance(v, int) or v <= 0 for v in point) or (
                    len(point) == 4 and point[3] > point[2]):
                raise ConfigError(f"mixed points are (decodes, context, prefill tokens[, prompts <= tokens]) of "
                                  f"positive integers, got {point!r}")
        if self.warmup < 0 or self.repeats <= 0:
            raise ConfigError(f"warmup must be >= 0 and repeats > 0, got {self.warmup}, {self.repeats}")


def split_prompts(tokens: int, prompts: int) -> list[int]:
    """`tokens` split into `prompts` prompts as even as integers allow."""
    return [tokens // prompts + (index < tokens % prompts) for index in range(prompts)]


def steps_per_point(plan: SweepPlan) -> int:
    """The most steps a point's sequences run: warm-up, every timing a pass may take, and one more."""
    return plan.warmup + max(plan.repeats, MAX_TIMINGS_PER_PASS) + 1


def pages_to_remeasure(kind: str, point: tuple[int, ...], page_size: int, plan: SweepPlan, drafts: int = 0) -> int:
    """The KV pages a step of `kind` at sweep `point` (`Profiler.point_of`) holds at most while it is timed: what a
    pool must have to time it, and what an engine built only to time such points needs."""
    def prompt_pages(tokens: int, prompts: int = 1) -> int:
        return sum(pages_for_tokens(n + 1, page_size) for n in split_prompts(tokens, prompts))

    if kind == "prefill":
        return prompt_pages(*point)
    if kind == "prefix":
        tokens, cached = point
        return pages_for_tokens(cached + tokens + 1, page_size)
    if kind == "decode":
        batch, context = point
        return batch * pages_for_tokens(context + steps_per_point(plan), page_size)
    if kind == "verify":
        batch, context = point
        return batch * pages_for_tokens(context + steps_per_point(plan) * (drafts + 1), page_size)
    batch, context, *prefill = point
    return batch * pages_for_tokens(context + 2, page_size) + prompt_pages(*prefill)


class RepeatDrafts:
    """Drafts for the verification points: a sequence's last K tokens again. What a verification costs does not
    hang on which tokens it checks or on how many stand, and forced drafts make every step of a point verify."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = num_draft_tokens

    def propose(self, seq_id: int, tokens: list[int], room: int) -> list[int]:
        count = min(self.num_draft_tokens, room)
        return tokens[-count:] if count > 0 else []

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""


class Profiler:
    def __init__(self, llm: LLM, plan: SweepPlan | None = None, seed: int = 0) -> None:
        self.llm = llm
        self.plan = plan or SweepPlan()
        self.rng = random.Random(seed)
        # every profiled prompt under a salt of its own: a point timed again, here or by another profiler of the
        # same seed, must compute its prompt, not find it in the prefix cache
        self._salts = (f"profile-{uuid.uuid4().hex}-{n}" for n in itertools.count())
        self.model = model_section(llm)
        self.samples: list[dict[str, Any]] = []
        self.activation_peak_bytes: int | None = None
        self.linears: dict[str, list] | None = None
        self._pool_holds_real_kv = False
        self._step_collectives: list[tuple[float, int]] = []     # per timed step: seconds and bytes in collectives
        self.collectives: list[dict[str, Any]] | None = None     # the group's collectives alone, by message size

    def _tokens(self, count: int) -> list[int]:
        vocab = self.llm.model_config.vocab_size
        return [self.rng.randrange(vocab) for _ in range(count)]

    def _fill_pool_with_real_kv(self) -> None:
        """Seeded decodes read pages no step wrote: zeros, which FP8 pages convert 1.7x faster than real
        K/V (measured on this CPU: 5 ms against 8.5 ms for the same elements), so a profile would promise
        decode steps the engine never runs. One real prefill's K/V, tiled over the whole pool (on every rank),
        fixes that."""
        page = self.llm.config.page_size
        tokens = min(1024, self.llm.config.max_num_batched_tokens, self.llm.max_model_len - 2,
                     self.llm.capacity_tokens - page)
        if tokens < page:
            return
        seq_id = self.llm.add_request(self._tokens(tokens), SamplingParams(max_tokens=2, ignore_eos=True),
                                      next(self._salts))
        self.llm.step()                                  # the prefill writes K/V; the sequence still runs
        written = self.llm.core.block_manager.block_table(seq_id)[:tokens // page]
        self.llm.core.tile_kv(written)              # every rank's shard of the pool, from its own K/V
        self._clear()
        self._pool_holds_real_kv = True

    def _seed_decodes(self, batch: int, context: int, max_tokens: int) -> list[Sequence]:
        """`batch` running sequences with `context - 1` tokens cached: their next step decodes at `context`."""
        if not self._pool_holds_real_kv:
            self._fill_pool_with_real_kv()
        seqs = []
        for _ in range(batch):
            seq = Sequence(self._tokens(context), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           cache_salt=next(self._salts))
            seq.publishes_eagerly = False       # its pages hold tiled K/V, not its tokens': never to be found
            self.llm.core.block_manager.allocate(seq.seq_id, context - 1)
            seq.num_computed_tokens = context - 1
            seq.status = SequenceStatus.RUNNING
            self.llm.core.scheduler.running.append(seq)
            seqs.append(seq)
        return seqs

    def _seed_prefix(self, tokens: int, cached: int) -> None:
        """A prompt of `cached + tokens` tokens whose first `cached` are in the pool (real K/V, tiled): its next step
        computes the other `tokens` over them, and samples its one token."""
        if not self._pool_holds_real_kv:
            self._fill_pool_with_real_kv()
        seq = Sequence(self._tokens(cached + tokens), SamplingParams(max_tokens=1, ignore_eos=True),
                       cache_salt=next(self._salts))
        seq.publishes_eagerly = False
        self.llm.core.block_manager.allocate(seq.seq_id, cached)
        seq.num_computed_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.llm.core.scheduler.running.append(seq)

    def _clear(self) -> None:
        for seq in list(self.llm.core.scheduler.running) + list(self.llm.core.scheduler.waiting):
            self.llm.abort(seq.seq_id)

    def _seconds(self, run: Callable[[], Any]) -> float:
        synchronize(self.llm.device)
        start = time.perf_counter()
        run()
        synchronize(self.llm.device)
        return time.perf_counter() - start

    def _timed_step(self) -> tuple[float, SchedulerOutput]:
        stats = self.llm.core.model.group.stats
        stats.timed = True          # each collective's time measured (on a GPU: waited for) while profiling
        seconds, moved = stats.seconds, stats.bytes
        elapsed = self._seconds(self.llm.step)
        self._step_collectives.append((stats.seconds - seconds, stats.bytes - moved))
        return elapsed, self.llm.last_step

    def _record(self, kind: str, times: list[float], output: SchedulerOutput) -> dict[str, Any]:
        """The sample of the timed steps; under tensor parallelism also the median time rank 0 spent in
        collectives in one of them, and the bytes it sent into them (the same in every repetition)."""
        sample = self._sample(kind, batch_shape(output, self.llm.model_config.attention.index_topk), times)
        timed, self._step_collectives = self._step_collectives[-len(times):], []
        if self.llm.core.model.group.size > 1:
            sample["collective_s"] = round(statistics.median(seconds for seconds, _ in timed), 7)
            sample["collective_bytes"] = timed[-1][1]
        return sample

    def _sample(self, kind: str, batch: dict[str, int], times: list[float]) -> dict[str, Any]:
        median = statistics.median(times)
        moved = bytes_moved(self.model, batch)
        return {"kind": kind, "batch": batch, "times_s": [round(t, 6) for t in times],
                "median_s": round(median, 6), "bytes_moved": moved, "achieved_gb_s": round(moved / median / 1e9, 3)}

    def _pages_fit(self, kind: str, *point: int) -> bool:
        pages = pages_to_remeasure(kind, point, self.llm.config.page_size, self.plan, self._drafts())
        return pages * self.llm.config.page_size <= self.llm.capacity_tokens

    def _prompts_fit(self, tokens: int, prompts: int) -> bool:
        """`prompts` prompts of `tokens` in all, prefilled in one step."""
        return (max(split_prompts(tokens, prompts)) < self.llm.max_model_len
                and tokens <= self.llm.config.max_num_batched_tokens)

    def _prefill_fits(self, tokens: int, prompts: int = 1) -> bool:
        return (prompts <= self.llm.config.max_num_seqs and self._prompts_fit(tokens, prompts)
                and self._pages_fit("prefill", tokens, prompts))

    def _decode_fits(self, batch: int, context: int) -> bool:
        return (context + steps_per_point(self.plan) < self.llm.max_model_len and batch <= self.llm.config.max_num_seqs
                and self._pages_fit("decode", batch, context)
                and batch * context <= (self.plan.max_kv_tokens or self.llm.capacity_tokens))

    def _mixed_fits(self, batch: int, context: int, prefill: int, prompts: int = 1) -> bool:
        return (context + 2 < self.llm.max_model_len
                and batch * context + prefill <= (self.plan.max_kv_tokens or self.llm.capacity_tokens)
                and batch + prompts <= self.llm.config.max_num_seqs
                and batch + prefill <= self.llm.config.max_num_batched_tokens
                and self._prompts_fit(prefill, prompts) and self._pages_fit("mixed", batch, context, prefill, prompts))

    def _prefix_fits(self, tokens: int, cached: int) -> bool:
        return (cached + tokens + 1 < self.llm.max_model_len and tokens <= self.llm.config.max_num_batched_tokens
                and cached + tokens <= (self.plan.max_kv_tokens or self.llm.capacity_tokens)
                and self._pages_fit("prefix", tokens, cached))

    def _drafts(self) -> int:
        """K of the engine's prompt-lookup speculation; 0 without it (MTP's drafts are the model's own)."""
        speculative = self.llm.config.speculative_config
        return speculative.num_draft_tokens if speculative is not None and speculative.method == "ngram" else 0

    def _verify_fits(self, batch: int, context: int) -> bool:
        drafts = self._drafts()
        steps = steps_per_point(self.plan) * (drafts + 1)
        return (drafts > 0 and context + steps < self.llm.max_model_len and batch <= self.llm.config.max_num_seqs
                and batch * (drafts + 1) <= self.llm.config.max_num_batched_tokens
                and self._pages_fit("verify", batch, context)
                and batch * context <= (self.plan.max_kv_tokens or self.llm.capacity_tokens))

    def prefill_points(self) -> list[int]:
        return [n for n in self.plan.prefill_tokens if self._prefill_fits(n)]

    def multi_prefill_points(self) -> list[tuple[int, int]]:
        return [point for point in self.plan.multi_prefills if self._prefill_fits(*point)]

    def decode_points(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.plan.decode_batches for c in self.plan.decode_contexts if self._decode_fits(b, c)]

    def mixed_points(self) -> list[tuple[int, ...]]:
        return [point for point in self.plan.mixed if self._mixed_fits(*point)]

    def prefix_points(self) -> list[tuple[int, int]]:
        return [point for point in self.plan.prefix_prefills if self._prefix_fits(*point)]

    def verify_points(self) -> list[tuple[int, int]]:
        """With prompt-lookup speculation: every decode batch at the shortest and the longest decode context."""
        contexts = dict.fromkeys((min(self.plan.decode_contexts), max(self.plan.decode_contexts)))
        return [(b, c) for b in self.plan.decode_batches for c in contexts if self._verify_fits(b, c)]

    @staticmethod
    def point_of(sample: dict[str, Any]) -> tuple[int, ...]:
        """A recorded sample's sweep point: (tokens[, prompts]), (batch, context), (new tokens, cached tokens) or
        (batch, context, prefill tokens[, prompts]); the prompts only where there are several."""
        batch = sample["batch"]
        if sample["kind"] == "prefix":
            return batch["prefill_tokens"], batch["prefill_context_tokens"] - batch["prefill_tokens"]
        if sample["kind"] == "decode":
            return batch["num_decodes"], batch["decode_context_tokens"] // batch["num_decodes"]
        if sample["kind"] == "verify":      # each a chunk of K + 1 tokens ending at context + K
            count = batch["num_verifications"]
            drafts = batch["verification_tokens"] // count - 1
            return count, batch["prefill_context_tokens"] // count - drafts
        prompts = (batch["num_prefills"],) if batch["num_prefills"] > 1 else ()
        if sample["kind"] == "prefill":
            return batch["prefill_tokens"], *prompts
        context = batch["decode_context_tokens"] // batch["num_decodes"]
        return batch["num_decodes"], context, batch["prefill_tokens"], *prompts

    def can_remeasure(self, sample: dict[str, Any]) -> bool:
        """Whether this engine (its pool, its limits) can run a step like a profile's `sample`."""
        fits = {"prefill": self._prefill_fits, "decode": self._decode_fits, "mixed": self._mixed_fits,
                "verify": self._verify_fits, "prefix": self._prefix_fits}
        batch = sample["batch"]
        if sample["kind"] == "verify" and batch["verification_tokens"] != batch["num_verifications"] * (
                self._drafts() + 1):
            return False
        return fits[sample["kind"]](*self.point_of(sample))

    def remeasure(self, sample: dict[str, Any]) -> dict[str, Any]:
        """The same sweep point again, now: how fast this machine runs today what it was profiled on."""
        measure = {"prefill": self.profile_prefill, "decode": self.profile_decode, "mixed": self.profile_mixed,
                   "verify": self.profile_verify, "prefix": self.profile_prefix}
        return measure[sample["kind"]](*self.point_of(sample), warmup=self.plan.warmup, repeats=self.plan.repeats)

    def _time_from_scratch(self, kind: str, set_up: Callable[[], None], warmup: int, repeats: int) -> dict[str, Any]:
        """Each repetition sets its batch up anew, times one step of it and clears the engine."""
        times, output = [], None
        for index in range(warmup + repeats):
            set_up()
            elapsed, output = self._timed_step()
            if index >= warmup:
                times.append(elapsed)
            self._clear()
        return self._record(kind, times, output)

    def _add_prefills(self, tokens: int, prompts: int) -> None:
        for count in split_prompts(tokens, prompts):
            self.llm.add_request(self._tokens(count), SamplingParams(max_tokens=1, ignore_eos=True), next(self._salts))

    @contextlib.contextmanager
    def _drafting(self, proposer: RepeatDrafts | None) -> Iterator[None]:
        """The engine's proposer swapped for the point's: none for plain steps (a speculative engine's prefill,
        decode and mixed points time what an engine without drafts runs), `RepeatDrafts` for verifications."""
        kept, self.llm.core.proposer = self.llm.core.proposer, proposer
        try:
            yield
        finally:
            self.llm.core.proposer = kept

    def profile_prefill(self, tokens: int, prompts: int = 1, warmup: int = 1, repeats: int = 1) -> dict[str, Any]:
        with self._drafting(None):
            return self._time_from_scratch("prefill", lambda: self._add_prefills(tokens, prompts), warmup, repeats)

    def profile_prefix(self, tokens: int, cached: int, warmup: int = 1, repeats: int = 1) -> dict[str, Any]:
        with self._drafting(None):
            return self._time_from_scratch("prefix", lambda: self._seed_prefix(tokens, cached), warmup, repeats)

    def _time_steps(self, kind: str, warmup: int, repeats: int) -> dict[str, Any]:
        """Times the seeded sequences' next steps, then clears the engine."""
        times, output = [], None
        for index in range(warmup + repeats):
            elapsed, step_output = self._timed_step()
            if index >= warmup:
                times.append(elapsed)
                output = output or step_output
        self._clear()
        return self._record(kind, times, output)

    def profile_decode(self, batch: int, context: int, warmup: int = 1, repeats: int = 1) -> dict[str, Any]:
        self._seed_decodes(batch, context, warmup + repeats + 1)
        with self._drafting(None):
            return self._time_steps("decode", warmup, repeats)

    def profile_mixed(self, batch: int, context: int, prefill: int, prompts: int = 1, warmup: int = 1,
                      repeats: int = 1) -> dict[str, Any]:
        def set_up() -> None:
            self._seed_decodes(batch, context, 2)
            self._add_prefills(prefill, prompts)
        with self._drafting(None):
            return self._time_from_scratch("mixed", set_up, warmup, repeats)

    def profile_verify(self, batch: int, context: int, warmup: int = 1, repeats: int = 1) -> dict[str, Any]:
        """`batch` sequences at `context` whose every step verifies K drafts (`RepeatDrafts`)."""
        drafts = self._drafts()
        self._seed_decodes(batch, context, (warmup + repeats + 1) * (drafts + 1))
        with self._drafting(RepeatDrafts(drafts)):
            return self._time_steps("verify", warmup, repeats)

    def _linear_layers(self) -> list[torch.nn.Module]:
        kinds = (torch.nn.Linear, Int4Linear, Fp8Linear)
        return [module for module in self.llm.core.model.layers.modules() if isinstance(module, kinds)]

    def linear_runs(self, max_rows: int, max_head_rows: int) -> LinearRuns:
        """Runs of all the decoder's linear layers, and of the output head, at each row count up to the
        largest a profiled step has. A matmul's time is not smooth in its rows: BLAS changes kernels with the
        row count (on a 2-core VM one thread ran SmolLM2's layers at 8 rows in 0.73x the time of 16, at 14
        rows in 1.3x), which no formula of bytes and FLOPs says; the step model reads these instead. Each
        layer's output is dropped before the next runs, as a forward pass frees it."""
        layers = self._linear_layers()
        dtype = next(self.llm.core.model.parameters()).dtype
        hidden = self.llm.model_config.hidden_size

        def decoder(count: int) -> Callable[[], None]:
            inputs = {width: torch.randn(count, width, dtype=dtype, device=self.llm.device)
                      for width in {layer.in_features for layer in layers}}

            def run() -> None:
                for layer in layers:
                    layer(inputs[layer.in_features])
            return run

        def head(count: int) -> Callable[[], None]:
            states = torch.randn(count, hidden, dtype=dtype, device=self.llm.device)
            model = self.llm.core.model
            return lambda: model.local_logits(states)     # a rank's share: the gather is communication

        rows, head_rows = _rows_up_to(max_rows), _rows_up_to(max_head_rows)
        return LinearRuns(rows, head_rows, [decoder(r) for r in rows] + [head(r) for r in head_rows])

    def _time_run(self, run: Callable[[], Any], warmup: int) -> float:
        with torch.inference_mode():
            for _ in range(warmup):
                run()
            return self._seconds(run)

    def planned_rows(self) -> tuple[int, int]:
        """The most new tokens, and the most sequences, of any step the sweep will time."""
        shapes = ([(n, 1) for n in self.prefill_points()] + list(self.multi_prefill_points())
                  + [(n, 1) for n, _ in self.prefix_points()]
                  + [(b, b) for b, _ in self.decode_points()]
                  + [(p[0] + p[2], p[0] + (p[3] if len(p) == 4 else 1)) for p in self.mixed_points()])
        return max(rows for rows, _ in shapes), max(seqs for _, seqs in shapes)

    def measure_activation_peak(self, tokens: int) -> int | None:
        """Bytes above weights and KV pool while the largest prefill runs (CUDA allocator or the RSS high-water mark)."""
        self._add_prefills(tokens, 1)
        if self.llm.device.type == "cuda":
            torch.cuda.synchronize(self.llm.device)
            before = torch.cuda.memory_allocated(self.llm.device)
            torch.cuda.reset_peak_memory_stats(self.llm.device)
            self.llm.step()
            peak = torch.cuda.max_memory_allocated(self.llm.device) - before
        else:
            peak = _cpu_peak_during(self.llm.step)
        self._clear()
        return peak

    def run(self, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Every point timed in each of `repeats` passes (the first after `warmup` untimed steps of each; once
        in the first pass, then as often as `SECONDS_PER_POINT_PER_PASS` allows): a slow minute of a shared
        machine, which comes and goes (a neighbour slowed identical steps 2x for a minute on this VM), then
        costs each point one pass of its timings, not all of some points' timings."""
        Job = Callable[[int, int], dict[str, Any]]
        jobs: list[tuple[str, Job]] = []
        jobs += [(f"prefill {n} tokens", lambda w, r, n=n: self.profile_prefill(n, 1, w, r))
                 for n in self.prefill_points()]
        jobs += [(f"prefill {n} tokens in {k} prompts", lambda w, r, n=n, k=k: self.profile_prefill(n, k, w, r))
                 for n, k in self.multi_prefill_points()]
        # decodes warm up every pass: it costs one short step, and each pass then times the same contexts
        jobs += [(f"decode batch {b} x context {c}", lambda w, r, b=b, c=c: self.profile_decode(b, c, self.plan.warmup, r))
                 for b, c in self.decode_points()]
        jobs += [(f"mixed {point[0]} decodes at {point[1]} + prefill {point[2]}"
                  + (f" in {point[3]} prompts" if len(point) == 4 else ""),
                  lambda w, r, point=point: self.profile_mixed(*point, warmup=w, repeats=r))
                 for point in self.mixed_points()]
        jobs += [(f"prefill {n} tokens over {c} cached", lambda w, r, n=n, c=c: self.profile_prefix(n, c, w, r))
                 for n, c in self.prefix_points()]
        jobs += [(f"verify {b} x {self._drafts()} drafts at context {c}",
                  lambda w, r, b=b, c=c: self.profile_verify(b, c, self.plan.warmup, r))
                 for b, c in self.verify_points()]
        if not jobs:
            raise ConfigError("no profiling point fits this engine's KV pool and context")
        # A MoE model's linears are not timed apart (which experts run depends on the tokens' routing). The
        # others' are timed within the passes, spread between the steps: timed after the sweep, a slow minute
        # of the machine then fell on the table alone (1.9-3.4 s at 1024 rows in ten profiles of one engine,
        # whose whole prefill of 1024 tokens took 2.5-3.3 s) and the fit had to bend every term to it.
        linears = None if routed_experts(self.llm.core.model) else self.linear_runs(*self.planned_rows())
        runs = linears.runs if linears else []
        runs_after = [[run for run in range(len(runs)) if run * len(jobs) // len(runs) == index]
                      for index in range(len(jobs))]
        run_times: list[list[float]] = [[] for _ in runs]
        timings_per_pass = [1] * len(jobs)
        bar = _progress_bar(len(jobs) * self.plan.repeats)
        passes: list[list[dict[str, Any]]] = []
        for number in range(self.plan.repeats):
            passes.append([])
            warmup = self.plan.warmup if number == 0 else 0
            for index, ((label, job), after) in enumerate(zip(jobs, runs_after)):
                passes[-1].append(job(warmup, timings_per_pass[index]))
                if number == 0:
                    timings_per_pass[index] = max(1, min(MAX_TIMINGS_PER_PASS, int(
                        SECONDS_PER_POINT_PER_PASS / max(passes[-1][-1]["median_s"], 1e-9))))
                for run in after:
                    run_times[run].append(self._time_run(runs[run], warmup))
                bar.set_description(f"pass {number + 1}/{self.plan.repeats}: {label}")
                bar.update()
                if progress is not None:
                    progress(label)
        self.samples = [_merged(self._sample(timed[0]["kind"], timed[0]["batch"],
                                             [t for s in timed for t in s["times_s"]]), timed)
                        for timed in zip(*passes)]
        if self.llm.core.ranks is not None:
            self.collectives = self.llm.core.ranks.time_collectives(COLLECTIVE_SIZES, COLLECTIVE_REPEATS,
                                                                    self.llm.device)
        for (label, _), sample in zip(jobs, self.samples):
            bar.write(f"{label:40s} {sample['median_s'] * 1e3:10.2f} ms  {sample['achieved_gb_s']:8.2f} GB/s",
                      file=sys.stderr)      # tqdm writes to stdout unless told: --json owns stdout
        bar.close()
        self.linears = linears.table([round(statistics.median(times), 7) for times in run_times]) if linears else None
        points = self.prefill_points()
        self.activation_peak_bytes = self.measure_activation_peak(max(points)) if points else None
        return self.document()

    def document(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "fingerprint": fingerprint(self.llm),
            "model": self.model,
            "memory": {"weight_bytes": self.model["weight_bytes"],
                       "kv_bytes_per_token": self.model["kv_bytes_per_token"],
                       "kv_capacity_tokens": self.llm.capacity_tokens,
                       "activation_peak_bytes": self.activation_peak_bytes},
            "plan": {"warmup": self.plan.warmup, "repeats": self.plan.repeats,
                     "max_kv_tokens": self.plan.max_kv_tokens},
            "linears": self.linears,
            "samples": self.samples,
            **({"collectives": self.collectives} if self.collectives else {}),
        }


def _merged(sample: dict[str, Any], passes: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """A point's sample over all passes, with the median of its passes' time in collectives where timed."""
    if "collective_s" in passes[0]:
        sample["collective_s"] = statistics.median(p["collective_s"] for p in passes)
        sample["collective_bytes"] = passes[0]["collective_bytes"]
    return sample


@dataclass(frozen=True)
class LinearRuns:
    """The decoder's linears at each of `rows`, then the head at each of `head_rows`, as runs to time."""

    rows: list[int]
    head_rows: list[int]
    runs: list[Callable[[], None]]

    def table(self, seconds: list[float]) -> dict[str, list]:
        """The profile's `linears` section from each run's time, in the runs' order."""
        return {"rows": self.rows, "decoder_s": seconds[:len(self.rows)], "head_rows": self.head_rows,
                "head_s": seconds[len(self.rows):]}


def _rows_up_to(count: int) -> list[int]:
    """The grid's row counts up to the first at or past `count` (all of them past the grid's end)."""
    return [r for r in LINEAR_ROWS if r < count] + [r for r in LINEAR_ROWS if r >= count][:1]


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, unit="point", dynamic_ncols=True, disable=None)


def _cpu_peak_during(run: Callable[[], Any]) -> int | None:
    """Peak RSS growth while `run` runs; Linux resets the high-water mark through /proc/self/clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        before = _proc_status_kib("VmRSS")
        run()
        return max(0, (_proc_status_kib("VmHWM") - before) * 1024)
    except OSError:
        run()
        return None


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"{field_name} not in /proc/self/status")
