"""Rank 0's side of a step: the plan of flat inputs and block tables made from the scheduler's batch, the forward
pass on every rank, sampling.

The plan is plain lists (`engine.executor.step_plan.StepPlan`) so that it can be broadcast to the other ranks, which
run the same forward pass on it (`engine.executor.worker.Worker.run`)."""
from __future__ import annotations

import itertools

import torch

from engine.core.errors import RequestError
from engine.core.memory import pages_for_tokens
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.executor.integrity import KINDS, IntegrityChecker, Violation
from engine.executor.mtp import UNDRAFTED, MTPDrafts, mtp_rows, run_mtp
from engine.executor.rank_processes import RankProcesses
from engine.executor.sampler import sample, verify_drafts
from engine.executor.step_plan import StepPlan, WorkerFault
from engine.executor.worker import Worker


class StepExecutor:
    """Rank 0's side of every step: plans it from the scheduler's batch (the block tables its items carry), sends
    the plan to the other ranks, runs rank 0's share on its own `Worker`, then samples (verifying drafts, and
    drafting with the model's MTP module where it has one)."""

    def __init__(self, worker: Worker, ranks: RankProcesses | None, integrity: IntegrityChecker | None,
                 seed: int = 0, num_draft_tokens: int = 1) -> None:
        self.worker = worker
        self.model = worker.model
        self.kv_cache = worker.kv_cache
        self.page_size = worker.config.page_size
        self.ranks = ranks
        self.integrity = integrity
        self.fail_rank: int | None = None          # fault injection: a worker rank that must fail the next step
        self.worker_fault: WorkerFault | None = None     # fault injection: one for a worker's own state
        self.device = worker.device
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}
        self.also_violating: list[Violation] = []          # requests outside the step a flagged scale concerns
        self.mtp_drafts = MTPDrafts(num_draft_tokens) if getattr(worker.model, "mtp", None) is not None else None

    def _generator(self, item: ScheduledSequence) -> torch.Generator | None:
        seq = item.seq
        if seq.params.greedy:
            return None
        if seq.seq_id not in self._generators:
            seed = seq.params.seed if seq.params.seed is not None else self.seed * 1_000_003 + seq.seq_id
            self._generators[seq.seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self._generators[seq.seq_id]

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        if self.mtp_drafts is not None:
            self.mtp_drafts.release(seq_id)

    @property
    def checks_on_device(self) -> bool:
        return self.integrity is not None and self.integrity.on_device

    def plan(self, items: list[ScheduledSequence], logit_rows: list[int] | None, device_check: bool = False) -> StepPlan:
        """The step's flat inputs from the block tables; `items` must list decodes first. Under tensor
        parallelism with integrity checks, it also carries each table's leases and the ownership record's
        changes since the last plan, so that every rank can check the tables itself; with `device_check`, the
        leases for the check the runner runs on the device."""
        page_size = self.page_size
        check = self.integrity is not None and self.ranks is not None
        plan = StepPlan([], [], [], [], [], [], logit_rows, calibrate_kv=self.kv_cache.calibrating,
                        fail_rank=self.fail_rank, check=check, worker_fault=self.worker_fault,
                        device_check=device_check)
        self.fail_rank, self.worker_fault = None, None
        for item in items:
            table = item.block_table
            plan.seq_ids.append(item.seq.seq_id)
            if item.drafts:         # the last token, then the drafts after it
                plan.token_ids.extend(item.seq.token_ids_between(item.start, item.start + 1))
                plan.token_ids.extend(item.drafts)
            else:
                plan.token_ids.extend(item.seq.token_ids_between(item.start, item.end))
            span = range(item.start, item.end)
            plan.positions.extend(span)
            plan.slots.extend(table[p // page_size] * page_size + p % page_size for p in span)
            pages = len(table) if item.is_decode else pages_for_tokens(item.end, page_size)
            if check or device_check:
                plan.leases.append(item.leases[:pages])
            if item.is_decode:
                plan.decode_tables.append(table)
                plan.decode_lens.append(item.end)
            else:
                plan.prefills.append((len(plan.token_ids) - item.num_new_tokens, item.num_new_tokens, item.end,
                                      table[:pages]))
        if check:
            plan.ownership_updates = self.integrity.take_updates()
        return plan

    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, dict[int, Violation], torch.Tensor | None]:
        """Sends the plan to the other ranks (tensor parallelism), agrees with them on the items that fail an
        integrity check on some rank, and runs this rank's share of the rest. Returns the logits, the dropped
        items' violations by item, and the device check's flags by item where the plan asked for it."""
        try:
            if self.ranks is not None:
                self.ranks.send(plan)
            return self.worker.run(plan)        # rank 0 checked its record before planning
        except RuntimeError as error:
            if self.ranks is None:
                raise
            raise self.ranks.failed(error) from None

    def logits(self, items: list[ScheduledSequence]) -> torch.Tensor:
        """Logits of every computed position, float32 [T, vocab]; for scoring, not serving."""
        items = sorted(items, key=lambda item: not item.is_decode)
        logits, dropped, flags = self.run(self.plan(items, None, self.checks_on_device))
        if flags is not None:
            dropped |= self._flagged(items, flags.tolist())
        if dropped:
            raise RequestError("; ".join(violation.describe() for violation in dropped.values()))
        return logits

    def execute(self, output: SchedulerOutput) -> tuple[dict[int, int], list[Violation]]:
        """Runs the step: the sampled token of every sequence that reached its last token (with drafts: the token
        after those that stood, which `ScheduledSequence.accept` records), and the violations another rank found
        (their sequences did not run; the caller aborts them)."""
        items = sorted(output.scheduled, key=lambda item: not item.is_decode)
        if self.mtp_drafts is not None:
            self._chain_mtp(items)
        logit_rows = [row for rows, item in zip(_logit_rows(items), items) if item.samples for row in rows]
        plan = self.plan(items, logit_rows, self.checks_on_device)
        logits, dropped, flags = self.run(plan)
        sampling = [item for index, item in enumerate(items) if item.samples and index not in dropped]
        tokens: list[int] = []
        flag_values = []
        if sampling and any(item.drafts for item in sampling):
            tokens = self._verify(logits, sampling)
        elif sampling:
            drawn = sample(logits, [item.seq.params for item in sampling], [self._generator(item) for item in sampling])
            if flags is not None:           # the tokens and the flags in one read
                drawn = torch.cat([drawn, flags.to(drawn.dtype)])
            values = drawn.tolist()
            tokens, flag_values = values[:len(sampling)], values[len(sampling):]
        if flags is not None and not flag_values:
            flag_values = flags.tolist()
        if flag_values:
            dropped |= self._flagged(items, flag_values)
        dropped_ids = {items[index].seq.seq_id for index in dropped}
        sampled = {item.seq.seq_id: token for item, token in zip(sampling, tokens) if item.seq.seq_id not in dropped_ids}
        if self.mtp_drafts is not None and items:
            self._draft_with_mtp(items, plan, sampled)
        also, self.also_violating = self.also_violating, []
        return sampled, list(dropped.values()) + also

    def _flagged(self, items: list[ScheduledSequence], flags: list[int]) -> dict[int, Violation]:
        """The items the device check flagged, by item, with what the host check finds wrong in each (the rare path:
        it reads the record to name the page, restores corrupted FP8 scales); their tokens are never emitted, the
        caller aborts them. A corrupted scale concerns every request holding pages: those outside the step are
        kept in `self.also_violating` for the caller."""
        flagged = {index: item for index, (item, flag) in enumerate(zip(items, flags)) if flag}
        if not flagged:
            return {}
        found: dict[int, Violation] = {}
        for violation in self.integrity.check(list(flagged.values())):
            found.setdefault(violation.seq_id, violation)
        stepping = {item.seq.seq_id for item in items}
        self.also_violating += [violation for seq_id, violation in found.items() if seq_id not in stepping]
        return {index: found.get(item.seq.seq_id, Violation(item.seq.seq_id, KINDS[flags[index]], None))
                for index, item in flagged.items()}

    def _draft_with_mtp(self, items: list[ScheduledSequence], plan: StepPlan, sampled: dict[int, int]) -> None:
        """The MTP module over the rows the step kept; each sequence that sampled gets its next draft."""
        rows, kept, next_tokens = mtp_rows(items, plan, sampled)
        drafting = [index for index, item in enumerate(kept) if item.samples]
        ends = list(itertools.accumulate(item.num_new_tokens for item in kept))
        mtp_plan = self.plan(kept, [ends[index] - 1 for index in drafting])
        mtp_plan.token_ids = next_tokens
        hidden = self.model.last_hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)]
        logits, out = run_mtp(self.model, self.kv_cache, mtp_plan, hidden,
                              self.worker.runner.attention_metadata(mtp_plan), self.device)
        if logits is None:
            return
        for index, token in zip(drafting, logits.argmax(dim=-1).tolist()):
            item = kept[index]
            self.mtp_drafts.record(item.seq.seq_id, item.end, token, out[ends[index] - 1])

    def _chain_mtp(self, items: list[ScheduledSequence]) -> None:
        """Fills the drafts after the first by chaining the MTP module: pass j runs at position start + j - 1 of
        every sequence with more than j drafts, from the module's previous output and the draft before, writing
        its cache row into a slot the step reserved (the verification overwrites what does not stand)."""
        drafts = self.mtp_drafts
        chained = [item for item in items if UNDRAFTED in item.drafts]
        filled = {id(item): list(item.drafts) for item in chained}
        hidden = {id(item): drafts.hidden[item.seq.seq_id] for item in chained}
        for depth in range(1, max((len(item.drafts) for item in chained), default=0)):
            going = [item for item in chained if len(item.drafts) > depth]
            steps = [ScheduledSequence(item.seq, item.start + depth - 1, 1, True).tables_of(item) for item in going]
            plan = self.plan(steps, list(range(len(steps))))
            plan.token_ids = [filled[id(item)][depth - 1] for item in going]
            rows = torch.stack([hidden[id(item)] for item in going])
            logits, out = run_mtp(self.model, self.kv_cache, plan, rows, self.worker.runner.attention_metadata(plan),
                                  self.device)
            for row, (item, token) in enumerate(zip(going, logits.argmax(dim=-1).tolist())):
                filled[id(item)][depth] = token
                hidden[id(item)] = out[row]
        for item in chained:
            item.drafts = tuple(filled[id(item)])

    def _verify(self, logits: torch.Tensor, sampling: list[ScheduledSequence]) -> list[int]:
        """A step with drafts: logits hold each item's rows in order (one, or K + 1 with drafts). The plain items
        sample in one call; each item with drafts verifies them and records how many stood."""
        starts, row = [], 0
        for item in sampling:
            starts.append(row)
            row += 1 + len(item.drafts)
        plain = [index for index, item in enumerate(sampling) if not item.drafts]
        rows = torch.tensor([starts[index] for index in plain], dtype=torch.int64, device=logits.device)
        tokens = dict(zip(plain, sample(logits[rows], [sampling[i].seq.params for i in plain],
                                        [self._generator(sampling[i]) for i in plain]).tolist())) if plain else {}
        for index, item in enumerate(sampling):
            if item.drafts:
                start = starts[index]
                accepted, tokens[index] = verify_drafts(logits[start:start + 1 + len(item.drafts)], item.drafts,
                                                        item.seq.params, self._generator(item))
                item.accept(accepted)
        return [tokens[index] for index in range(len(sampling))]


def _logit_rows(items: list[ScheduledSequence]) -> list[range]:
    """The rows of each item whose logits a step wants if it samples: the last; with drafts, the last token's and
    every draft's."""
    spans, end = [], 0
    for item in items:
        end += item.num_new_tokens
        spans.append(range(end - 1 - len(item.drafts), end))
    return spans

