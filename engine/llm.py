"""`LLM`: the engine's public face, with `generate()` and a step-level API for serving loops."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig, SchedulerConfig
from engine.core.errors import ConfigError, RequestError
from engine.core.handoff import KVHandoff
from engine.core.host_memory import release_freed_memory
from engine.core.memory import (
    GIB,
    kv_bytes_per_token,
    kv_layout,
    kv_pages_for_budget,
    pages_for_tokens,
    with_draft_layers,
)
from engine.core.reference_text import reference_text
from engine.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from engine.core.sequence import FinishReason, SamplingParams, Sequence
from engine.core.speculative import DraftStats, NgramProposer, SpeculativeConfig
from engine.executor.integrity import IntegrityChecker, Violation
from engine.executor.mtp import MTPDrafts
from engine.executor.runner import ModelRunner
from engine.executor.worker import rank_memory
from engine.executor.workers import MEMORY_QUERY, Workers
from engine.model.kv_cache import PagedKVCache
from engine.model.loader import check_shardable, load_model
from engine.model.tokenizer import Tokenizer
from engine.parallel.group import SINGLE, resolve_device

CPU_DEFAULT_KV_GIB = 1.0
KV_CALIBRATION_TOKENS = 512

log = logging.getLogger("engine.executor.integrity")


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_preemptions: int
    num_cached_tokens: int = 0          # prompt tokens a prefix-cache hit supplied (OpenAI's `cached_tokens`)
    handoff: KVHandoff | None = None    # a disaggregated prefill's: the prompt's KV pages and first token


def calibration_tokens(tokenizer: Tokenizer | None, vocab_size: int, count: int) -> list[int]:
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (count,), generator=generator).tolist()
    return tokenizer.encode(reference_text(slice(-1, None)))[:count]


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self._check_speculative(config.speculative_config)
        self.device = resolve_device(config.device)
        on_gpu = self.device.type == "cuda"
        self._threads_before: int | None = None      # torch's count, given back on close
        if config.num_threads is not None:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(config.num_threads)
        self.closed = False
        self.compute_dtype = config.resolved_compute_dtype(on_gpu)
        self.workers: Workers | None = None
        group = SINGLE
        if config.tensor_parallel > 1 or config.expert_parallel:
            check_shardable(config.model, config)
        if config.tensor_parallel > 1:
            self.workers = Workers(config, config.tensor_parallel, self.device)
            group = self.workers.group
        try:
            loaded = load_model(config.model, self.compute_dtype, self.device, config.seed, config, group)
            self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
            context = self.model_config.max_position_embeddings
            if config.max_model_len is not None and config.max_model_len > context:
                raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context of {context} "
                                  f"tokens")
            self.kv_layout = kv_layout(self.model_config, config.resolved_kv_dtype(on_gpu), config.tensor_parallel)
            self.kv_layout = with_draft_layers(self.kv_layout, int(getattr(self.model, "mtp", None) is not None))
            num_pages = config.num_pages or kv_pages_for_budget(self._kv_budget_bytes(), self.kv_layout,
                                                                config.page_size)
            if num_pages <= 0:
                raise ConfigError(f"the KV budget holds no page of {config.page_size} tokens "
                                  f"({kv_bytes_per_token(self.kv_layout)} bytes per token)")
            if self.workers is not None:
                self.workers.send(num_pages)
        except BaseException:
            self.close()
            raise
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.scheduler_config = SchedulerConfig(
            num_pages=num_pages, page_size=config.page_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill, enable_prefix_caching=config.enable_prefix_caching)
        self.block_manager = BlockManager(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.kv_cache = PagedKVCache(self.kv_layout, num_pages, config.page_size, self.device)
        self.integrity = None if config.integrity == "off" else IntegrityChecker(
            config.integrity, self.block_manager, self.kv_cache, config.integrity_sample_pages, config.seed,
            config.tensor_parallel)
        speculative = config.speculative_config
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, config.seed, self.workers,
                                  self.integrity, speculative.num_draft_tokens if speculative is not None else 1)
        self.proposer: NgramProposer | MTPDrafts | None = None if speculative is None else (
            NgramProposer(speculative) if speculative.method == "ngram" else self.runner.mtp_drafts)
        self.draft_stats = None if speculative is None else DraftStats(speculative.num_draft_tokens)
        self.last_output: SchedulerOutput | None = None       # the batch of the latest step, for profiling
        self.integrity_detections = 0       # refused cache hits (`_report_refused_hits`); aborts are counted apart
        self.handoff_corruptions = 0        # hand-offs that arrived with a page failing its checksum
        self._handoffs: dict[int, KVHandoff] = {}            # arrivals not admitted yet: their pages
        self._handoff_params: dict[int, SamplingParams] = {}     # prefills that hand off: the request's own params
        self._finished_arrivals: list[Sequence] = []         # arrivals whose first token already ended them
        if self.kv_cache.is_fp8:
            self.calibrate_kv_scales()

    def memory_by_rank(self) -> list[dict[str, Any]]:
        """`rank_memory` of every rank of the engine, rank 0 (this process) first."""
        own = rank_memory(self.model, self.kv_cache)
        return [own] if self.workers is None else self.workers.gather(MEMORY_QUERY, own)

    def close(self) -> None:
        """Stops the tensor-parallel workers, gives torch's thread count back and lets go of the weights, the KV pool
        and the runner's buffers, so a closed engine holds no memory (a server or a test suite builds many); the
        engine refuses work after. Closing twice does nothing more."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self.closed = True
        if getattr(self, "integrity", None) is not None:
            self.integrity.detach()
        for name in ("model", "kv_cache", "runner", "integrity", "proposer"):
            setattr(self, name, None)
        self._handoffs = {}
        release_freed_memory()

    def _check_open(self) -> None:
        if self.closed:
            raise RequestError("the engine is closed")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _kv_budget_bytes(self) -> int:
        if self.config.kv_cache_gib is not None:
            return int(self.config.kv_cache_gib * GIB)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            return max(0, int(total * self.config.gpu_memory_utilization) - used_by_others)
        return int(CPU_DEFAULT_KV_GIB * GIB)

    def calibrate_kv_scales(self, token_ids: list[int] | None = None) -> None:
        """Sets the FP8 KV scales from one warm-up prefill (real English text unless tokens are given)."""
        if token_ids is None:
            token_ids = calibration_tokens(self.tokenizer, self.model_config.vocab_size,
                                           min(KV_CALIBRATION_TOKENS, self.max_model_len - 1, self.capacity_tokens))
        self.kv_cache.calibrating = True
        try:
            self.score(token_ids)
        finally:
            self.kv_cache.calibrating = False
        if self.integrity is not None:
            self.integrity.trust_scales()

    @property
    def capacity_tokens(self) -> int:
        return self.scheduler_config.capacity_tokens

    @property
    def usable_tokens(self) -> int:
        """The pool's token slots less its quarantined pages' (integrity violations take pages out for good)."""
        return (self.block_manager.num_pages - len(self.block_manager.quarantined)) * self.config.page_size

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"model {self.config.model!r} has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _validate(self, token_ids: list[int], max_tokens: int) -> None:
        self._check_open()
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"token id {bad[0]!r} is outside the vocabulary (0..{vocab - 1})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens; the model's context is "
                               f"{self.max_model_len} tokens")
        total = len(token_ids) + max_tokens
        if total > self.max_model_len:
            raise RequestError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} "
                               f"exceeds the model's context of {self.max_model_len} tokens")
        if total > self.usable_tokens:
            quarantined = len(self.block_manager.quarantined)
            raise RequestError(f"prompt + max_tokens = {total} tokens exceeds the KV pool of {self.usable_tokens} "
                               f"tokens" + (f" ({quarantined} pages quarantined)" if quarantined else ""))

    def new_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                     cache_salt: str | None = None, hands_off: bool = False) -> Sequence:
        """A validated request, not queued yet: a server validates in its handler and queues between steps.
        A bad one raises RequestError. Requests share cached KV pages only with requests of the same
        `cache_salt` (None: the unsalted ones). One that `hands_off` (a disaggregated prefill) runs its prompt,
        samples the first token and ends with its pages copied out (`RequestOutput.handoff`) for a decode
        replica, which decodes the rest under `params`."""
        params = params or SamplingParams()
        token_ids = self.encode_prompt(prompt)
        if hands_off:
            self._check_single_device("hand off a prompt's pages")
        self._validate(token_ids, 1 if hands_off else params.max_tokens)
        seq = Sequence(token_ids, replace(params, max_tokens=1) if hands_off else params,
                       self.model_config.eos_token_ids, arrival_time=time.perf_counter(), cache_salt=cache_salt)
        if hands_off:
            seq.keeps_pages = True
            self._handoff_params[seq.seq_id] = params
        return seq

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, hands_off: bool = False) -> int:
        """Validates and queues a request; a bad one raises RequestError and changes nothing."""
        seq = self.new_sequence(prompt, params, cache_salt, hands_off)
        self.scheduler.add(seq)
        return seq.seq_id

    def _check_single_device(self, what: str) -> None:
        if self.workers is not None:
            raise RequestError(f"an engine of --tensor-parallel {self.config.tensor_parallel} cannot {what} yet: "
                               f"hand-offs move one device's pages")

    def new_handoff(self, handoff: KVHandoff, params: SamplingParams | None = None) -> Sequence:
        """A validated arrival from a prefill replica, not queued yet (`add_handoff`): its prompt computed, its
        first token sampled, under `params` (default: the ones it came with). RequestError if it was computed for
        another cache (layout, page size, FP8 scales) or does not fit here; its pages are checked on admission."""
        self._check_open()
        self._check_single_device("take a hand-off")
        if handoff.layout != self.kv_layout:
            raise RequestError(f"the hand-off was computed for the KV layout {handoff.layout}; this engine's is "
                               f"{self.kv_layout}")
        if handoff.page_size != self.config.page_size:
            raise RequestError(f"the hand-off has pages of {handoff.page_size} tokens; this engine's hold "
                               f"{self.config.page_size}")
        if handoff.scales_digest != self.kv_cache.scales_digest():
            raise RequestError("the hand-off's FP8 KV scales differ from this engine's: its pages would mean other "
                               "values here")
        params = params or handoff.params
        token_ids = list(handoff.prompt_token_ids)
        self._validate(token_ids, params.max_tokens)
        if not 0 <= handoff.first_token < self.model_config.vocab_size:
            raise RequestError(f"the hand-off's first token {handoff.first_token!r} is outside the vocabulary")
        seq = Sequence(token_ids, params, self.model_config.eos_token_ids, arrival_time=time.perf_counter(),
                       cache_salt=handoff.cache_salt)
        seq.num_computed_tokens = len(token_ids)
        seq.append_token(handoff.first_token, self.max_model_len)
        return seq

    def add_handoff(self, handoff: KVHandoff, params: SamplingParams | None = None) -> int:
        """Validates and queues an arrival (`new_handoff`); returns its request id."""
        seq = self.new_handoff(handoff, params)
        self.queue_handoff(seq, handoff)
        return seq.seq_id

    def queue_handoff(self, seq: Sequence, handoff: KVHandoff) -> None:
        """Queues an arrival `new_handoff` made: one its first token ended answers at the next step."""
        if seq.is_finished:
            self._finished_arrivals.append(seq)
            return
        self._handoffs[seq.seq_id] = handoff
        self.scheduler.add_computed(seq)

    def score(self, prompt: str | list[int]) -> torch.Tensor:
        """Logits [n, vocab] at every prompt position, through the paged cache (for evaluation).

        Uses free pages of the pool for the duration of the call; running requests are not touched.
        """
        token_ids = self.encode_prompt(prompt)
        self._validate(token_ids, 0)
        seq = Sequence(token_ids, SamplingParams(max_tokens=1))
        if not self.block_manager.can_allocate(seq.num_tokens):
            raise RequestError(f"{seq.num_tokens} tokens do not fit in the {self.block_manager.num_free_pages} "
                               f"free KV pages now")
        self.block_manager.allocate(seq.seq_id, seq.num_tokens)
        try:
            return self.runner.logits([ScheduledSequence(seq, 0, seq.num_tokens)])
        finally:
            self.block_manager.free(seq.seq_id)

    def abort(self, request_id: int) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return self._finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished_arrivals)

    def _check_speculative(self, speculative: SpeculativeConfig | None) -> None:
        """What the engine drafts with: prompt lookup (ngram:K) anywhere; the model's MTP module (mtp:K) on one
        device (tensor-parallel workers do not run it)."""
        if speculative is None or speculative.method == "ngram":
            return
        if self.config.tensor_parallel > 1:
            raise ConfigError(f"the engine drafts with MTP on one device; --tensor-parallel "
                              f"{self.config.tensor_parallel} workers do not run the module yet")

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        return self.proposer.propose(seq.seq_id, seq.prompt_token_ids + seq.output_token_ids, room)

    @property
    def num_draft_tokens(self) -> int:
        """Speculative tokens verified so far."""
        return 0 if self.draft_stats is None else self.draft_stats.draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Of them, those that stood."""
        return 0 if self.draft_stats is None else self.draft_stats.accepted_tokens

    @property
    def acceptance_rate(self) -> float | None:
        """The share of verified speculative tokens that stood (None before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the requests that finished in it (or were aborted)."""
        self._check_open()
        if self.proposer is not None:
            self.scheduler.set_drafts(self._propose)
        arrived_done, self._finished_arrivals = [self._finish(seq) for seq in self._finished_arrivals], []
        output = self.scheduler.schedule()
        self.last_output = output
        stalled = output.is_empty and not output.preempted and self.scheduler.waiting and not self.scheduler.running
        unservable = [self._abort_unservable(self.scheduler.waiting[0])] if stalled else []
        if self.block_manager.refused_hits:
            self._report_refused_hits()
        aborted = arrived_done + unservable + (self._fill_arrivals(output) if output.arrived else [])
        if self.integrity is not None:
            aborted += self._enforce_integrity(output)
        if output.is_empty:
            return aborted
        sampled, violations = self.runner.execute(output)
        if violations:
            aborted += self._abort_violating(output, violations)
        if self.draft_stats is not None:
            self.draft_stats.record(len(output.decodes) + sum(1 for item in output.chunks if item.is_decode),
                                    [(len(item.drafts), item.num_accepted) for item in output.chunks
                                     if item.drafts and item.seq.seq_id in sampled])
        if self.integrity is not None:
            self.integrity.seal(output.scheduled)
        return aborted + [self._finish(seq) for seq in self.scheduler.update(output, sampled)]

    def _abort_unservable(self, seq: Sequence) -> RequestOutput:
        """A schedule that admits nothing with nothing running would repeat forever: the first waiting request no
        longer fits the pool, which quarantined pages shrank after it was accepted. It ends (abort) so that the others
        are served."""
        log.error("request %d needs %d tokens of KV, more than the pool's %d usable (%d pages quarantined): aborted",
                  seq.seq_id, seq.num_prompt_tokens + seq.params.max_tokens, self.usable_tokens,
                  len(self.block_manager.quarantined))
        self.scheduler.abort(seq.seq_id, FinishReason.ABORT)
        return self._finish(seq)

    def _fill_arrivals(self, output: SchedulerOutput) -> list[RequestOutput]:
        """Writes the pages of the hand-offs admitted in this step; one whose bytes fail the checksums taken before
        sending is aborted (`integrity_error`) before the step reads them, the others go on."""
        aborted = []
        page_size = self.config.page_size
        for seq in output.arrived:
            handoff = self._handoffs.pop(seq.seq_id)
            corrupt = handoff.corrupt_pages()
            if corrupt:
                log.error("integrity violation: request %d: page %d of its hand-off fails the checksum taken before "
                          "sending", seq.seq_id, corrupt[0])
                self.handoff_corruptions += 1
                aborted.append(self._finish(self.scheduler.abort(seq.seq_id, FinishReason.INTEGRITY_ERROR)))
                continue
            pages = self.block_manager.block_table(seq.seq_id)[:handoff.num_pages]
            self.kv_cache.import_pages(pages, handoff.payload)
            if self.integrity is not None:
                self.integrity.seal_pages(pages[:seq.num_prompt_tokens // page_size])
        if aborted:
            output.drop_finished()
        return aborted

    def _hand_off(self, seq: Sequence) -> KVHandoff:
        """Copies a finished prefill's prompt pages out, with their checksums, for its decode replica."""
        pages = self.block_manager.block_table(seq.seq_id)[:pages_for_tokens(seq.num_prompt_tokens,
                                                                             self.config.page_size)]
        return KVHandoff.of_pages(seq.prompt_token_ids, seq.output_token_ids[0], self._handoff_params[seq.seq_id],
                                  self.kv_layout, self.config.page_size, self.kv_cache.scales_digest(),
                                  self.kv_cache.export_pages(pages), seq.cache_salt)

    def _report_refused_hits(self) -> None:
        """Cache hits refused because the page was not what its hash promised: the request computed that part of
        its prompt itself, so nobody was harmed."""
        refused, self.block_manager.refused_hits = self.block_manager.refused_hits, []
        for page, why in refused:
            log.error("integrity violation: a prefix-cache hit on page %d was refused: %s", page, why)
        self.integrity_detections += len(refused)

    def _enforce_integrity(self, output: SchedulerOutput) -> list[RequestOutput]:
        """Aborts, before the step runs, every request whose pages fail a check; the others go on."""
        violations = self.integrity.take_violations() + self.integrity.check(output.scheduled)
        return self._abort_violating(output, violations) if violations else []

    def _abort_violating(self, output: SchedulerOutput, violations: list[Violation]) -> list[RequestOutput]:
        """Aborts the requests of `violations` and takes them out of the step. A corrupted FP8 scale found on
        another rank concerns every request holding pages, as rank 0's record says."""
        scales_rank = next((v.rank for v in violations if v.kind == "fp8_scale" and v.rank), None)
        if scales_rank is not None:
            named = {violation.seq_id for violation in violations}
            violations = violations + [Violation(seq_id, "fp8_scale", None, rank=scales_rank)
                                       for seq_id in self.integrity.holders() if seq_id not in named]
        aborted = []
        for violation in violations:
            log.error("integrity violation: %s", violation.describe())
            if violation.kind == "checksum":
                self.block_manager.quarantine([violation.page])
            seq = self.scheduler.abort(violation.seq_id, FinishReason.INTEGRITY_ERROR)
            if seq is not None:
                aborted.append(self._finish(seq))
        self.integrity.take_violations()      # the aborted tables' own bad entries again, reported above
        output.drop_finished()
        return aborted

    def _finish(self, seq: Sequence) -> RequestOutput:
        self.runner.release(seq.seq_id)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        self._handoffs.pop(seq.seq_id, None)
        handoff = None
        if seq.keeps_pages:
            if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                handoff = self._hand_off(seq)
            self.block_manager.free(seq.seq_id)
            self._handoff_params.pop(seq.seq_id, None)
        text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer else ""
        reason = (seq.finish_reason or FinishReason.ABORT).value
        return RequestOutput(seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids), text, reason,
                             seq.num_preemptions, seq.num_cached_tokens or 0, handoff)

    def generate(self, prompts: list[str | list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs all prompts to completion together; outputs come in the order of the prompts.

        Every prompt is validated before any is queued, so a bad one rejects the call as a whole.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, prompt_params in zip(prompts, params):
                ids.append(self.add_request(prompt, prompt_params))
        except RequestError:
            for request_id in ids:
                self.abort(request_id)
            raise
        results: dict[int, RequestOutput] = {}
        while len(results) < len(ids):
            results.update((r.request_id, r) for r in self.step() if r.request_id in ids)
        return [results[request_id] for request_id in ids]
