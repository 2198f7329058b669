"""`LLM`: the engine's public face: requests in, steps, outputs and statistics out.

A thin facade over `engine.executor.engine_core.EngineCore`, which owns the scheduler, the ranks, integrity and
hand-offs. Servers, harnesses, verifications and benches use only these methods; the profiler and the fault
campaign, which measure or corrupt the engine's parts on purpose, reach them through `core`."""
from __future__ import annotations

from typing import Any

import torch

from engine.core.config import EngineConfig, SchedulerConfig
from engine.core.engine_stats import EngineStats
from engine.core.errors import RequestError
from engine.core.handoff import KVHandoff
from engine.core.memory import KVLayout
from engine.core.request_output import RequestOutput
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import SamplingParams, Sequence
from engine.core.spec import ModelSpec
from engine.core.speculative import DraftStats
from engine.executor.engine_core import EngineCore
from engine.model.tokenizer import Tokenizer

__all__ = ["LLM", "RequestOutput"]


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.config = config or EngineConfig(**overrides)
        self.core = EngineCore(self.config)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of everything the engine holds (`EngineCore.close`); it refuses work after."""
        self.core.close()

    @property
    def closed(self) -> bool:
        return self.core.closed

    # What the engine is.
    @property
    def model_config(self) -> ModelSpec:
        return self.core.model_config

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.tokenizer

    @property
    def kv_layout(self) -> KVLayout:
        return self.core.kv_layout

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's limits: pool pages, page size, batch and context limits."""
        return self.core.scheduler_config

    @property
    def capacity_tokens(self) -> int:
        """The KV pool's token slots."""
        return self.core.capacity_tokens

    def memory_by_rank(self) -> list[dict[str, Any]]:
        """What every rank holds (weight bytes by component, KV pool bytes), rank 0 first."""
        return self.core.memory_by_rank()

    # How it is doing.
    def stats(self) -> EngineStats:
        """Queues, KV pool usage and counters, as of now."""
        return self.core.stats()

    @property
    def last_step(self) -> SchedulerOutput | None:
        """The batch of the latest step (its shape: `engine.core.step_shape.batch_shape`)."""
        return self.core.last_output

    @property
    def num_preemptions(self) -> int:
        return self.core.scheduler.num_preemptions

    @property
    def acceptance_rate(self) -> float | None:
        """The share of verified speculative tokens that stood (None before any)."""
        stats = self.stats()
        return stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else None

    @property
    def draft_stats(self) -> DraftStats | None:
        """Speculative decoding's counts by draft position (None without it)."""
        return self.core.draft_stats

    def copy_pages_out(self, pages: list[int]) -> KVHandoff:
        """Free pages of the pool copied out as a hand-off of as many tokens, with their checksums: what a prefill
        replica's hand-off costs, timed by the disaggregated verification without touching anyone's pages."""
        return self.core.handoffs.pages_out(self.core.free_pages_only(pages))

    def copy_pages_in(self, handoff: KVHandoff, pages: list[int]) -> None:
        """A hand-off's pages checked against their checksums and written into free pages (`copy_pages_out`)."""
        self.core.handoffs.pages_in(handoff, self.core.free_pages_only(pages))

    # Requests.
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.core.encode_prompt(prompt)

    def new_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                     cache_salt: str | None = None, hands_off: bool = False) -> Sequence:
        """A validated request, not queued yet (`submit`): a server validates in its handler and queues between
        steps. A bad one raises RequestError. Requests share cached KV pages only with requests of the same
        `cache_salt` (None: the unsalted ones). One that `hands_off` (a disaggregated prefill) runs its prompt,
        samples the first token and ends with its pages copied out (`RequestOutput.handoff`) for a decode
        replica, which decodes the rest under `params`."""
        return self.core.new_sequence(prompt, params, cache_salt, hands_off)

    def submit(self, seq: Sequence) -> None:
        """Queues a request `new_sequence` made."""
        self.core.submit(seq)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, hands_off: bool = False) -> int:
        """Validates and queues a request; a bad one raises RequestError and changes nothing."""
        seq = self.new_sequence(prompt, params, cache_salt, hands_off)
        self.submit(seq)
        return seq.seq_id

    def new_handoff(self, handoff: KVHandoff, params: SamplingParams | None = None) -> Sequence:
        """A validated arrival from a prefill replica, not queued yet (`queue_handoff`): its prompt computed, its
        first token sampled, under `params` (default: the ones it came with). RequestError if it was computed for
        another cache (layout, page size, FP8 scales) or does not fit here; its pages are checked on admission."""
        return self.core.new_handoff(handoff, params)

    def queue_handoff(self, seq: Sequence, handoff: KVHandoff) -> None:
        """Queues an arrival `new_handoff` made: one its first token ended answers at the next step."""
        self.core.queue_handoff(seq, handoff)

    def add_handoff(self, handoff: KVHandoff, params: SamplingParams | None = None) -> int:
        """Validates and queues an arrival; returns its request id."""
        seq = self.new_handoff(handoff, params)
        self.queue_handoff(seq, handoff)
        return seq.seq_id

    def abort(self, request_id: int) -> RequestOutput | None:
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the requests that finished in it (or were aborted)."""
        return self.core.step()

    def score(self, prompt: str | list[int]) -> torch.Tensor:
        """Logits [n, vocab] at every prompt position, through the paged cache (for evaluation). Uses free pages of
        the pool for the duration of the call; running requests are not touched."""
        return self.core.score(prompt)

    def calibrate_kv_scales(self, token_ids: list[int] | None = None) -> None:
        """Sets the FP8 KV scales from one warm-up prefill (real English text unless tokens are given)."""
        self.core.calibrate_kv_scales(token_ids)

    def generate(self, prompts: list[str | list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs all prompts to completion together; outputs come in the order of the prompts. Every prompt is
        validated before any is queued, so a bad one rejects the call as a whole."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        sequences = [self.new_sequence(prompt, prompt_params) for prompt, prompt_params in zip(prompts, params)]
        for seq in sequences:
            self.submit(seq)
        ids = [seq.seq_id for seq in sequences]
        results: dict[int, RequestOutput] = {}
        while len(results) < len(ids):
            results.update((r.request_id, r) for r in self.step() if r.request_id in ids)
        return [results[request_id] for request_id in ids]
