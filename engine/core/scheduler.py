"""Continuous batching. Torch-free: the simulator drives this very class with a simulated clock.

The step interface is two calls: `schedule()` forms the batch of the next step, `update()` takes what
the step produced. Each step spends a budget of `max_num_batched_tokens`:

1. running sequences, oldest first, each gets its next token (decode) or the next chunk of its prompt;
   when the pool cannot hold them, the newest running sequence is preempted by recompute: its pages
   are freed and it goes back to the front of the waiting queue, keeping the tokens it generated
   (the oldest running sequences that all decode, when the pool takes them all, are scheduled in one go:
   the same batch, without the per-sequence checks);
2. then, if nothing was preempted, waiting sequences are admitted in FCFS order while the budget,
   `max_num_seqs` and the free pages allow (a prompt larger than the budget is chunked).

Prefill chunks and decodes share one step. A running sequence with speculative drafts (`Sequence.draft_token_ids`,
set before `schedule`) computes its last token and the drafts in one chunk when the budget and the pool allow it
(drafts are cut to the budget and dropped rather than preempt anyone); `update` keeps the drafts that stood
(`ScheduledSequence.accept`) and gives the rest of their slots back (`BlockManager.truncate`).

With prefix caching (`SchedulerConfig.enable_prefix_caching`) a sequence is admitted with the published pages
of its longest cached prefix (`BlockManager.cached_prefix`) and computes from its first uncached token; at least
its last token is always computed, since that step samples the next one. After each step the pages that filled
up are published (`update`). A preempted sequence releases its references; its published pages stay cached, so
its recompute starts from whatever of them is still there.

Disaggregated decoding: a sequence whose prompt another replica computed arrives with its KV and first token
(`add_computed`); it is admitted, when no waiting prompt is held up, as soon as the pool has pages for its prompt
and the token it decodes in that very step (`SchedulerOutput.arrived`: the engine fills those pages first). A
preempted arrival recomputes like any other sequence. A prefill replica's sequences that hand off keep their pages
when they finish (`Sequence.keeps_pages`) until the engine has copied them out.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.sequence import FinishReason, Sequence, SequenceStatus


class ScheduledSequence:
    """A sequence in this step: it computes tokens [start, start + num_new_tokens). With speculative `drafts` it
    computes its last token and the drafts after it; once the step verified them, `accept` shortens it to the
    last token and the drafts that stood (`num_accepted`), and `update` gives the other slots back.

    A plain slotted class, not a dataclass: hundreds are made per step.
    """

    __slots__ = ("seq", "start", "num_new_tokens", "end", "samples", "drafts", "num_accepted", "block_table", "leases",
                 "first_new_page")

    def __init__(self, seq: Sequence, start: int, num_new_tokens: int, samples: bool | None = None,
                 drafts: tuple[int, ...] = ()) -> None:
        self.seq = seq
        self.start = start
        self.num_new_tokens = num_new_tokens
        self.end = start + num_new_tokens
        # the step reaches the last known token: one is sampled (known at schedule time, told when made later)
        self.samples = (self.end == seq.num_tokens or bool(drafts)) if samples is None else samples
        self.drafts = drafts
        self.num_accepted = 0
        # the engine's steps only (`Scheduler.schedule_with_tables`): what the runner reads instead of the manager
        self.block_table: list[int] = []
        self.leases: list[int] = []         # the epoch at which the sequence got each page of its table
        self.first_new_page = 0             # table index of the first page this step starts writing

    def take_tables(self, manager: BlockManager) -> ScheduledSequence:
        """Copies the sequence's block table and leases as they are for this step."""
        seq_id = self.seq.seq_id
        self.block_table, self.leases = manager.block_table(seq_id), manager.leases(seq_id)
        self.first_new_page = -(-self.start // manager.page_size)
        return self

    def tables_of(self, other: ScheduledSequence) -> ScheduledSequence:
        """The tables another item of the same sequence and step took (a pass of drafting over it)."""
        self.block_table, self.leases, self.first_new_page = other.block_table, other.leases, other.first_new_page
        return self

    @property
    def new_pages(self) -> list[int]:
        """The pages this step writes first: granted for it, or a prompt chunk's not reached before."""
        return self.block_table[self.first_new_page:]

    def __repr__(self) -> str:
        drafts = f", drafts={len(self.drafts)}" if self.drafts else ""
        return f"ScheduledSequence({self.seq.seq_id}, start={self.start}, new={self.num_new_tokens}{drafts})"

    @property
    def scheduled_tokens(self) -> int:
        """The tokens the step computes for it: with drafts, its last token and every draft, whatever stood."""
        return 1 + len(self.drafts) if self.drafts else self.num_new_tokens

    def accept(self, num_accepted: int) -> None:
        """The first `num_accepted` drafts stood: the step computed the last token and those."""
        if not 0 <= num_accepted <= len(self.drafts):
            raise ValueError(f"{num_accepted} drafts accepted of {len(self.drafts)}")
        self.num_accepted = num_accepted
        self.num_new_tokens = 1 + num_accepted
        self.end = self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token after a computed context; a verification of drafts is a chunk even when none stood."""
        return self.num_new_tokens == 1 and self.start > 0 and not self.drafts


class SchedulerOutput:
    """A step's batch, in two parts. `decodes`: the oldest running sequences, each computing its one next token
    (at `decode_starts`), kept as bare sequences because the simulator reads every step's batch and a step can
    hold hundreds of them; `chunks`: the rest, as items (prefill chunks, decodes scheduled one at a time).
    `scheduled` is the whole batch as items, decodes first, made when first asked for."""

    __slots__ = ("decodes", "decode_starts", "chunks", "preempted", "arrived", "_scheduled")

    def __init__(self) -> None:
        self.decodes: list[Sequence] = []
        self.decode_starts: list[int] = []
        self.chunks: list[ScheduledSequence] = []
        self.preempted: list[Sequence] = []
        self.arrived: list[Sequence] = []        # handed-off sequences admitted now: their pages to fill first
        self._scheduled: list[ScheduledSequence] | None = None

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        if self._scheduled is None:
            self._scheduled = [ScheduledSequence(seq, start, 1, True)
                               for seq, start in zip(self.decodes, self.decode_starts)] + self.chunks
        return self._scheduled

    def drop_finished(self) -> None:
        """Takes the sequences finished since scheduling (aborted) out of the batch."""
        kept = [(seq, start) for seq, start in zip(self.decodes, self.decode_starts) if not seq.is_finished]
        self.decodes, self.decode_starts = [seq for seq, _ in kept], [start for _, start in kept]
        self.chunks = [item for item in self.chunks if not item.seq.is_finished]
        if self._scheduled is not None:         # the items made: kept, with the tables they carry
            self._scheduled = [item for item in self._scheduled if not item.seq.is_finished]

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(item.num_new_tokens for item in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | None = None) -> None:
        self.config = config
        self.block_manager = block_manager or BlockManager(config.num_pages, config.page_size,
                                                           config.enable_prefix_caching)
        if self.block_manager.prefix_caching != config.enable_prefix_caching:
            raise ValueError("the block manager and the scheduler disagree on prefix caching")
        self.prefix_caching = config.enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.arrivals: deque[Sequence] = deque()    # prompts computed elsewhere, waiting for pages here
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0      # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hit_tokens = 0          # of them, found there

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_computed(self, seq: Sequence) -> None:
        """Queues a sequence whose prompt (`num_computed_tokens` of it) another replica computed and whose first
        token it sampled: it needs pages for that KV and decodes from there."""
        if seq.num_uncomputed_tokens != 1:
            raise ValueError(f"a handed-off sequence arrives with one token to decode, not "
                             f"{seq.num_uncomputed_tokens}")
        self.arrivals.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.arrivals)

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Removes a sequence wherever it is and frees its pages; returns it, or None if unknown."""
        for queue in (self.waiting, self.running, self.arrivals):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self.block_manager.free(seq_id)
                    seq.finish(reason)
                    return seq
        return None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        manager, running, chunks = self.block_manager, self.running, out.chunks
        index = self.decode_prefix(budget)
        if index and manager.append_decodes([seq.seq_id for seq in running[:index]]):
            # the oldest running sequences all decode and the pool takes them all: that part of the batch at once
            out.decodes = running[:index]
            out.decode_starts = [seq.num_computed_tokens for seq in out.decodes]
            budget -= index
        else:
            index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = seq.draft_token_ids[:budget - 1] if num_new == 1 else []
            if drafts and manager.can_append(seq.seq_id, 1 + len(drafts)):
                manager.append(seq.seq_id, 1 + len(drafts))
                chunks.append(ScheduledSequence(seq, seq.num_computed_tokens, 1 + len(drafts), True, tuple(drafts)))
                budget -= 1 + len(drafts)
                index += 1
                continue
            while not manager.can_append(seq.seq_id, num_new):      # drafts never preempt: decode without them
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                manager.append(seq.seq_id, num_new)
                chunks.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
                budget -= num_new
                index += 1

        while not out.preempted:
            admitted = self.admissible(budget)
            if admitted is None:
                break
            num_new, cached = admitted
            if manager.vet(cached) < len(cached):
                continue            # a cached page failed its check and left the cache: look again
            seq = self.waiting.popleft()
            manager.allocate(seq.seq_id, num_new, cached)
            seq.num_computed_tokens = len(cached) * manager.page_size
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            if self.prefix_caching:
                self.prefix_queried_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        if not (out.preempted or self.waiting):
            self._admit_arrivals(out, budget)
        return out

    def schedule_with_tables(self) -> SchedulerOutput:
        """The engine's `schedule`: every item of the batch carries its block table, leases and new pages, so that
        the step's runner never reads the block manager (the simulator, which runs no model, skips the copies)."""
        out = self.schedule()
        for item in out.scheduled:
            item.take_tables(self.block_manager)
        return out

    def _admit_arrivals(self, out: SchedulerOutput, budget: int) -> None:
        """Handed-off sequences in arrival order, each with pages for its computed prompt and the token it decodes
        in this step, while the budget, `max_num_seqs` and the pool allow."""
        manager = self.block_manager
        while self.arrivals and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.arrivals[0]
            if not manager.can_allocate(seq.num_tokens):
                break
            self.arrivals.popleft()
            manager.allocate(seq.seq_id, seq.num_tokens)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.arrived.append(seq)
            out.chunks.append(ScheduledSequence(seq, seq.num_computed_tokens, 1))
            budget -= 1

    def decode_prefix(self, budget: int) -> int:
        """How many of the oldest running sequences, at most `budget`, each need exactly one token (decode)."""
        count = 0
        for seq in self.running:
            if count == budget or seq.num_tokens - seq.num_computed_tokens != 1 or seq.draft_token_ids:
                break
            count += 1
        return count

    def admissible(self, budget: int) -> tuple[int, list[int]] | None:
        """What a step with `budget` tokens left would admit of the first waiting sequence: the tokens it would
        compute (the rest of its prompt, or a chunk) and the cached pages it would start with; None when it
        would admit none."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return None
        seq = self.waiting[0]
        cached = self.cached_pages(seq) if self.prefix_caching else []
        num_new = seq.num_tokens - len(cached) * self.block_manager.page_size
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        return (num_new, cached) if self.block_manager.can_allocate(num_new, cached) else None

    def cached_pages(self, seq: Sequence) -> list[int]:
        """The published pages a waiting sequence would start with: its longest cached prefix of full pages,
        short of its last token."""
        page_size = self.block_manager.page_size
        count = (seq.num_tokens - 1) // page_size
        hashes, keys = seq.page_names(count, page_size)
        return self.block_manager.cached_prefix(hashes, keys, count)

    def _publish(self, seq: Sequence, preempted: bool = False) -> None:
        """Publishes the sequence's pages that its computed tokens have filled (`Sequence.publishes_eagerly`)."""
        if not (seq.publishes_eagerly or preempted):
            return
        page_size = self.block_manager.page_size
        full = seq.num_computed_tokens // page_size
        if full > self.block_manager.num_published(seq.seq_id):
            hashes, keys = seq.page_names(full, page_size)
            self.block_manager.publish(seq.seq_id, hashes, keys, full)

    def _preempt(self, seq: Sequence) -> None:
        if self.prefix_caching:
            self._publish(seq, preempted=True)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def advance_decodes(self, steps: int) -> None:
        """`steps` decode steps of every running sequence at once, each sampling token 0: what as many `update`s
        of all-decode batches leave, for the simulator's fast-forward over a window in which no sequence finishes
        and nothing else is scheduled (the caller checked both, and the pages, with `pages_for_more`)."""
        self.block_manager.append_many([seq.seq_id for seq in self.running], steps)
        for seq in self.running:
            seq.output_token_ids.extend([0] * steps)
            seq.num_tokens += steps
            seq.num_computed_tokens += steps
            if self.prefix_caching:
                self._publish(seq)

    def set_drafts(self, propose: Callable[[Sequence, int], list[int]]) -> None:
        """Drafts for every running sequence about to decode, from `propose(seq, room)`: `room` is what its
        max_tokens and the context leave after the token the step samples anyway (the engine's proposers and the
        simulator's draws alike)."""
        max_model_len = self.config.max_model_len
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens != 1:
                seq.draft_token_ids = []
                continue
            room = min(seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens) - 1
            seq.draft_token_ids = propose(seq, room)

    def _take_drafts(self, item: ScheduledSequence, bonus: int) -> bool:
        """Appends the drafts that stood and the token sampled after them (until one ends the sequence) and gives
        back the rejected drafts' slots; True if the sequence finished."""
        seq, max_model_len = item.seq, self.config.max_model_len
        seq.draft_token_ids = []
        for token in (*item.drafts[:item.num_accepted], bonus):
            if seq.append_token(token, max_model_len):
                return True
        self.block_manager.truncate(seq.seq_id, item.end)
        return False

    def update(self, output: SchedulerOutput, sampled: dict[int, int] | None) -> list[Sequence]:
        """Advances the scheduled sequences; `sampled` maps seq_id to its new token (None: token 0 for every
        one, as the simulator samples, where lengths alone end requests). Returns the finished."""
        finished = []
        max_model_len, done = self.config.max_model_len, SequenceStatus.FINISHED
        publish = self._publish if self.prefix_caching else None
        page_size = self.block_manager.page_size
        for seq in output.decodes:
            if seq.status is done:       # aborted between schedule and update
                continue
            seq.num_computed_tokens += 1
            if publish and seq.num_computed_tokens % page_size == 0:      # the decode filled a page
                publish(seq)
            if seq.append_token(0 if sampled is None else sampled[seq.seq_id], max_model_len):
                finished.append(seq)
        for item in output.chunks:
            seq = item.seq
            if seq.status is done:
                continue
            seq.num_computed_tokens = item.end
            if publish:
                publish(seq)
            if item.drafts:
                if self._take_drafts(item, 0 if sampled is None else sampled[seq.seq_id]):
                    finished.append(seq)
            elif item.samples and seq.append_token(0 if sampled is None else sampled[seq.seq_id], max_model_len):
                finished.append(seq)
        if finished:
            ended = {id(seq) for seq in finished}
            self.running = [seq for seq in self.running if id(seq) not in ended]
            for seq in finished:
                if not seq.keeps_pages:
                    self.block_manager.free(seq.seq_id)
        return finished
