"""MTP drafts: after a step, the model's MTP module runs over the positions the step computed and kept, each with
the token that followed it (the next row's, or the one just sampled), and its prediction at a sequence's last
position is the draft of the next step (`--speculative mtp:1`).

Running in the same step, before integrity seals and prefix-cache publication, its cache rows are written while
the pages are still the sequence's own; a sequence that computes its prompt again (preemption) writes them again.
"""
from __future__ import annotations

import torch

from engine.core.scheduler import ScheduledSequence
from engine.executor.step_plan import StepPlan
from engine.model.architectures.base import DecoderModel
from engine.model.kv_cache import PagedKVCache

UNDRAFTED = -1      # a draft slot the step fills by chaining the module (`StepExecutor._chain_mtp`)


class MTPDrafts:
    """The draft each sequence's last MTP pass predicted, with the position it drafts for and the module's hidden
    state there (what a chained pass starts from)."""

    def __init__(self, num_draft_tokens: int = 1) -> None:
        self.num_draft_tokens = num_draft_tokens
        self._drafts: dict[int, tuple[int, int]] = {}       # seq_id -> (its computed tokens then, the draft)
        self.hidden: dict[int, torch.Tensor] = {}           # seq_id -> the module's output there, before its norm

    def record(self, seq_id: int, computed: int, token: int, hidden: torch.Tensor) -> None:
        self._drafts[seq_id] = (computed, token)
        self.hidden[seq_id] = hidden

    def propose(self, seq_id: int, tokens: list[int], room: int) -> list[int]:
        """The draft, if it was made for the sequence as it stands (all but its last token computed), then slots
        for the drafts the step chains after it."""
        draft = self._drafts.get(seq_id)
        if draft is None or room < 1 or draft[0] != len(tokens) - 1:
            return []
        return [draft[1]] + [UNDRAFTED] * (min(self.num_draft_tokens, room) - 1)

    def release(self, seq_id: int) -> None:
        self._drafts.pop(seq_id, None)
        self.hidden.pop(seq_id, None)


def mtp_rows(items: list[ScheduledSequence], plan: StepPlan, sampled: dict[int, int]) -> tuple[
        list[int], list[ScheduledSequence], list[int]]:
    """For the step's items in plan order: the plan rows each kept (after drafts were verified), the items cut to
    those rows (no drafts; decodes first, as a plan wants them: drafts of which none stood leave one row), and each
    kept row's next token."""
    groups, row = [], 0
    for item in items:
        planned = 1 + len(item.drafts) if item.drafts else item.num_new_tokens
        count, seq = item.num_new_tokens, item.seq
        tokens = plan.token_ids[row + 1:row + count]
        if seq.seq_id in sampled:
            tokens.append(sampled[seq.seq_id])
        else:                                   # a prompt chunk short of the prompt's end: its next prompt token
            tokens.extend(seq.token_ids_between(item.end, item.end + 1))
        kept = ScheduledSequence(seq, item.start, count, seq.seq_id in sampled).tables_of(item)
        groups.append((list(range(row, row + count)), kept, tokens))
        row += planned
    groups.sort(key=lambda group: not group[1].is_decode)
    return ([r for rows, _, _ in groups for r in rows], [kept for _, kept, _ in groups],
            [t for _, _, tokens in groups for t in tokens])


@torch.inference_mode()
def run_mtp(model: DecoderModel, kv_cache: PagedKVCache, plan: StepPlan, hidden: torch.Tensor,
            metadata, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The MTP module over `plan` (next tokens, positions, slots) from `hidden` rows (the main model's, or the
    module's own when chained): float32 logits of the plan's logit rows, and its output rows before its norm."""
    tokens = torch.tensor(plan.token_ids, dtype=torch.int64, device=device)
    positions = torch.tensor(plan.positions, dtype=torch.int64, device=device)
    embedded = model.embed(tokens)
    out = model.mtp(embedded, hidden, model.rotary(positions, embedded.dtype), kv_cache, metadata)
    if not plan.logit_rows:
        return None, out
    rows = torch.tensor(plan.logit_rows, dtype=torch.int64, device=device)
    return model.compute_logits(model.mtp.norm(out[rows])), out
