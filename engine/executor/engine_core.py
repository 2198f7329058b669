"""`EngineCore`: the one owner of the engine's state, behind the `engine.llm.LLM` facade.

    LLM (facade) ── EngineCore ─┬─ Scheduler ── BlockManager ── IntegrityChecker (its guard)
                                ├─ StepExecutor ── Worker rank 0 (ModelRunner, KV pool)
                                │                └─ RankProcesses: Worker ranks 1.. (tensor parallelism)
                                ├─ Handoffs (disaggregated serving: arrivals and departures)
                                └─ the drafter (speculative decoding)

A step: schedule (every item carries its block table), admit hand-offs, check integrity, run on every rank,
sample, seal, update the scheduler. Everything that reads or changes these parts goes through this class; the
profiler and the fault campaign, which measure or corrupt them on purpose, reach them here (`LLM.core`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig, SchedulerConfig
from engine.core.engine_stats import EngineStats
from engine.core.errors import ConfigError, RequestError
from engine.core.handoff import KVHandoff
from engine.core.host_memory import release_freed_memory
from engine.core.reference_text import reference_text
from engine.core.request_output import RequestOutput
from engine.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from engine.core.sequence import FinishReason, SamplingParams, Sequence
from engine.core.speculative import DraftStats, NgramProposer
from engine.executor.handoffs import Handoffs
from engine.executor.integrity import IntegrityChecker, Violation
from engine.executor.mtp import MTPDrafts
from engine.executor.rank_processes import MEMORY_QUERY, TILE_KV, RankProcesses
from engine.executor.step_executor import StepExecutor
from engine.executor.worker import Worker
from engine.model.loader import check_shardable
from engine.parallel.group import SINGLE, resolve_device

KV_CALIBRATION_TOKENS = 512

log = logging.getLogger("engine.executor.integrity")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        speculative = config.speculative_config
        if speculative is not None and speculative.method == "mtp" and config.tensor_parallel > 1:
            raise ConfigError(f"the engine drafts with MTP on one device; --tensor-parallel "
                              f"{config.tensor_parallel} workers do not run the module yet")
        self.device = resolve_device(config.device)
        self.compute_dtype = config.resolved_compute_dtype(self.device.type == "cuda")
        self._threads_before: int | None = None      # torch's count, given back on close
        if config.num_threads is not None:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(config.num_threads)
        self.closed = False
        self.ranks: RankProcesses | None = None
        self.worker: Worker | None = None
        self.integrity: IntegrityChecker | None = None
        self.handoffs: Handoffs | None = None
        if config.tensor_parallel > 1 or config.expert_parallel:
            check_shardable(config.model, config)
        try:
            if config.tensor_parallel > 1:
                self.ranks = RankProcesses(config, config.tensor_parallel, self.device)
            self.worker = Worker(config, SINGLE if self.ranks is None else self.ranks.group, self.device)
            self.model_config, self.tokenizer = self.worker.model_config, self.worker.tokenizer
            context = self.model_config.max_position_embeddings
            if config.max_model_len is not None and config.max_model_len > context:
                raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context of {context} "
                                  f"tokens")
            num_pages = self.worker.kv_pool_pages()
            if self.ranks is not None:
                self.ranks.send(num_pages)
        except BaseException:
            self.close()
            raise
        self.worker.allocate_kv(num_pages)
        num_pages = self.worker.schedulable_pages
        self.kv_layout = self.worker.kv_layout
        self.max_model_len = config.max_model_len or context
        self.scheduler_config = SchedulerConfig(
            num_pages=num_pages, page_size=config.page_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill, enable_prefix_caching=config.enable_prefix_caching)
        self.block_manager = BlockManager(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.integrity = None if config.integrity == "off" else IntegrityChecker(
            config.integrity, self.block_manager, self.kv_cache, config.integrity_sample_pages, config.seed,
            config.tensor_parallel)
        if self.integrity is not None and self.integrity.on_device:
            self.worker.runner.device_check = self.integrity.device_flags
        self.executor = StepExecutor(self.worker, self.ranks, self.integrity, config.seed,
                                     speculative.num_draft_tokens if speculative is not None else 1)
        self.proposer: NgramProposer | MTPDrafts | None = None if speculative is None else (
            NgramProposer(speculative) if speculative.method == "ngram" else self.executor.mtp_drafts)
        self.draft_stats = None if speculative is None else DraftStats(speculative.num_draft_tokens)
        self.handoffs = Handoffs(self.kv_cache, self.kv_layout, config.page_size)
        self.last_output: SchedulerOutput | None = None       # the batch of the latest step
        self.integrity_detections = 0       # refused cache hits (`_report_refused_hits`); aborts are counted apart
        if self.kv_cache.is_fp8:
            self.calibrate_kv_scales()

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def kv_cache(self) -> Any:
        return self.worker.kv_cache

    @property
    def capacity_tokens(self) -> int:
        return self.scheduler_config.capacity_tokens

    def stats(self) -> EngineStats:
        manager, scheduler, drafts = self.block_manager, self.scheduler, self.draft_stats
        return EngineStats(
            running=len(scheduler.running), waiting=len(scheduler.waiting) + len(scheduler.arrivals),
            num_pages=manager.num_pages, free_pages=manager.num_free_pages, used_pages=manager.num_used_pages,
            cached_pages=manager.num_cached_pages, quarantined_pages=len(manager.quarantined),
            page_size=self.config.page_size, preemptions=scheduler.num_preemptions,
            prefix_queried_tokens=scheduler.prefix_queried_tokens, prefix_hit_tokens=scheduler.prefix_hit_tokens,
            draft_tokens=0 if drafts is None else drafts.draft_tokens,
            accepted_tokens=0 if drafts is None else drafts.accepted_tokens,
            integrity_detections=self.integrity_detections, handoff_corruptions=self.handoffs.corruptions)

    def memory_by_rank(self) -> list[dict[str, Any]]:
        """`rank_memory` of every rank of the engine, rank 0 (this process) first."""
        own = self.worker.memory()
        return [own] if self.ranks is None else self.ranks.gather(MEMORY_QUERY, own)

    def free_pages_only(self, pages: list[int]) -> list[int]:
        """`pages`, if every one is a page of the pool no request holds; RequestError naming the first that is not."""
        for page in pages:
            if not 0 <= page < self.block_manager.num_pages or self.block_manager.ref_count(page):
                raise RequestError(f"page {page!r} is not a free page of the pool (0..{self.block_manager.num_pages - 1})")
        return pages

    def tile_kv(self, pages: list[int]) -> None:
        """`PagedKVCache.tile` on every rank's share of the pool (the profiler fills the pool with real K/V)."""
        self.kv_cache.tile(pages)
        if self.ranks is not None:
            self.ranks.send((TILE_KV, pages))

    def close(self) -> None:
        """Stops the other ranks, gives torch's thread count back and lets go of the weights, the KV pool and the
        runner's buffers, so a closed engine holds no memory (a server or a test suite builds many); the engine
        refuses work after. Closing twice does nothing more."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self.closed = True
        if self.integrity is not None:
            self.integrity.detach()
        if self.worker is not None:
            self.worker.close()
        if self.handoffs is not None:
            self.handoffs.close()
        for name in ("integrity", "executor", "proposer"):
            setattr(self, name, None)
        release_freed_memory()

    def check_open(self) -> None:
        if self.closed:
            raise RequestError("the engine is closed")

    def calibrate_kv_scales(self, token_ids: list[int] | None = None) -> None:
        """Sets the FP8 KV scales from one warm-up prefill (real English text unless tokens are given)."""
        if token_ids is None:
            count = min(KV_CALIBRATION_TOKENS, self.max_model_len - 1, self.capacity_tokens)
            if self.tokenizer is None:
                generator = torch.Generator().manual_seed(0)
                token_ids = torch.randint(0, self.model_config.vocab_size, (count,), generator=generator).tolist()
            else:
                token_ids = self.tokenizer.encode(reference_text(slice(-1, None)))[:count]
        self.kv_cache.calibrating = True
        try:
            self.score(token_ids)
        finally:
            self.kv_cache.calibrating = False
        if self.integrity is not None:
            self.integrity.trust_scales()

    # Requests: validated here, queued by the caller (a server validates in its handler and queues between steps).
    def usable_tokens(self) -> int:
        """The pool's token slots less its quarantined pages' (integrity violations take pages out for good)."""
        return (self.block_manager.num_pages - len(self.block_manager.quarantined)) * self.config.page_size

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"model {self.config.model!r} has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, token_ids: list[int], max_tokens: int) -> None:
        self.check_open()
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
        usable = self.usable_tokens()
        if total > usable:
            quarantined = len(self.block_manager.quarantined)
            raise RequestError(f"prompt + max_tokens = {total} tokens exceeds the KV pool of {usable} "
                               f"tokens" + (f" ({quarantined} pages quarantined)" if quarantined else ""))

    def new_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                     cache_salt: str | None = None, hands_off: bool = False) -> Sequence:
        """`LLM.new_sequence`."""
        params = params or SamplingParams()
        token_ids = self.encode_prompt(prompt)
        if hands_off:
            self._check_single_device("hand off a prompt's pages")
        self.validate(token_ids, 1 if hands_off else params.max_tokens)
        seq = Sequence(token_ids, replace(params, max_tokens=1) if hands_off else params,
                       self.model_config.eos_token_ids, arrival_time=time.perf_counter(), cache_salt=cache_salt)
        if hands_off:
            self.handoffs.departs(seq, params)
        return seq

    def submit(self, seq: Sequence) -> None:
        """Queues a request `new_sequence` made."""
        self.scheduler.add(seq)

    def _check_single_device(self, what: str) -> None:
        if self.ranks is not None:
            raise RequestError(f"an engine of --tensor-parallel {self.config.tensor_parallel} cannot {what} yet: "
                               f"hand-offs move one device's pages")

    def new_handoff(self, handoff: KVHandoff, params: SamplingParams | None = None) -> Sequence:
        """`LLM.new_handoff`."""
        self.check_open()
        self._check_single_device("take a hand-off")
        params = params or handoff.params
        self.handoffs.check_compatible(handoff)
        token_ids = list(handoff.prompt_token_ids)
        self.validate(token_ids, params.max_tokens)
        if not 0 <= handoff.first_token < self.model_config.vocab_size:
            raise RequestError(f"the hand-off's first token {handoff.first_token!r} is outside the vocabulary")
        seq = Sequence(token_ids, params, self.model_config.eos_token_ids, arrival_time=time.perf_counter(),
                       cache_salt=handoff.cache_salt)
        seq.num_computed_tokens = len(token_ids)
        seq.append_token(handoff.first_token, self.max_model_len)
        return seq

    def queue_handoff(self, seq: Sequence, handoff: KVHandoff) -> None:
        """Queues an arrival `new_handoff` made: one its first token ended answers at the next step."""
        if self.handoffs.arrives(seq, handoff):
            self.scheduler.add_computed(seq)

    def score(self, prompt: str | list[int]) -> torch.Tensor:
        """`LLM.score`."""
        token_ids = self.encode_prompt(prompt)
        self.validate(token_ids, 0)
        seq = Sequence(token_ids, SamplingParams(max_tokens=1))
        if not self.block_manager.can_allocate(seq.num_tokens):
            raise RequestError(f"{seq.num_tokens} tokens do not fit in the {self.block_manager.num_free_pages} "
                               f"free KV pages now")
        self.block_manager.allocate(seq.seq_id, seq.num_tokens)
        try:
            return self.executor.logits([ScheduledSequence(seq, 0, seq.num_tokens).take_tables(self.block_manager)])
        finally:
            self.block_manager.free(seq.seq_id)

    def abort(self, request_id: int) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        return None if seq is None else self._finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.handoffs.has_finished_arrivals()

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the requests that finished in it (or were aborted)."""
        self.check_open()
        if self.proposer is not None:
            self.scheduler.set_drafts(self._propose)
        aborted = [self._finish(seq) for seq in self.handoffs.take_finished_arrivals()]
        output = self.scheduler.schedule_with_tables()
        self.last_output = output
        scheduler = self.scheduler
        if output.is_empty and not output.preempted and scheduler.waiting and not scheduler.running:
            aborted.append(self._abort_unservable(scheduler.waiting[0]))
        if self.block_manager.refused_hits:
            self._report_refused_hits()
        if output.arrived:
            aborted += self._fill_arrivals(output)
        if self.integrity is not None:
            aborted += self._check_before_step(output)
        if output.is_empty:
            return aborted
        sampled, violations = self.executor.execute(output)
        if violations:
            aborted += self._abort_violating(output, violations)
        if self.draft_stats is not None:
            self.draft_stats.record(len(output.decodes) + sum(1 for item in output.chunks if item.is_decode),
                                    [(len(item.drafts), item.num_accepted) for item in output.chunks
                                     if item.drafts and item.seq.seq_id in sampled])
        if self.integrity is not None:
            self.integrity.seal(output.scheduled)
        return aborted + [self._finish(seq) for seq in self.scheduler.update(output, sampled)]

    def _check_before_step(self, output: SchedulerOutput) -> list[RequestOutput]:
        """Aborts, before the step runs, the requests found off the step (frees, publishes) and, unless the check
        runs on the device inside the step (its record written first), those whose tables fail the host's check."""
        integrity = self.integrity
        violations = integrity.take_violations()
        if integrity.on_device:
            integrity.flush()
        else:
            violations += integrity.check(output.scheduled)
        return self._abort_violating(output, violations) if violations else []

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        return self.proposer.propose(seq.seq_id, seq.prompt_token_ids + seq.output_token_ids, room)

    def _abort_unservable(self, seq: Sequence) -> RequestOutput:
        """A schedule that admits nothing with nothing running would repeat forever: the first waiting request no
        longer fits the pool, which quarantined pages shrank after it was accepted. It ends (abort) so that the others
        are served."""
        log.error("request %d needs %d tokens of KV, more than the pool's %d usable (%d pages quarantined): aborted",
                  seq.seq_id, seq.num_prompt_tokens + seq.params.max_tokens, self.usable_tokens(),
                  len(self.block_manager.quarantined))
        self.scheduler.abort(seq.seq_id, FinishReason.ABORT)
        return self._finish(seq)

    def _fill_arrivals(self, output: SchedulerOutput) -> list[RequestOutput]:
        """Writes the pages of the hand-offs admitted in this step; one whose bytes fail the checksums taken before
        sending is aborted (`integrity_error`) before the step reads them, the others go on."""
        aborted = []
        for seq in output.arrived:
            item = next(item for item in output.chunks if item.seq is seq)
            sealed = self.handoffs.fill(seq, item.block_table)
            if sealed is None:
                aborted.append(self._finish(self.scheduler.abort(seq.seq_id, FinishReason.INTEGRITY_ERROR)))
            elif self.integrity is not None:
                self.integrity.seal_pages(sealed)
        if aborted:
            output.drop_finished()
        return aborted

    def _report_refused_hits(self) -> None:
        """Cache hits refused because the page was not what its hash promised: the request computed that part of
        its prompt itself, so nobody was harmed."""
        refused, self.block_manager.refused_hits = self.block_manager.refused_hits, []
        for page, why in refused:
            log.error("integrity violation: a prefix-cache hit on page %d was refused: %s", page, why)
        self.integrity_detections += len(refused)

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
        self.executor.release(seq.seq_id)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        handoff = None
        if seq.keeps_pages:
            if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                handoff = self.handoffs.hand_off(seq, self.block_manager.block_table(seq.seq_id))
            self.block_manager.free(seq.seq_id)
        self.handoffs.forget(seq.seq_id)
        text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer else ""
        reason = (seq.finish_reason or FinishReason.ABORT).value
        return RequestOutput(seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids), text, reason,
                             seq.num_preemptions, seq.num_cached_tokens or 0, handoff)
