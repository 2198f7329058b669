"""One forward pass as every rank runs it: plain lists, so rank 0 can broadcast it to the other ranks.

    rows     d0 d1 d2 | p0 p0 p0 p0 | p1 p1        decodes first (one row each), then prefill chunks
    items    0  1  2  | 3           | 4            one per sequence: seq_ids, tables and leases by item

The integrity fields let every rank check the tables it is about to read through against its own record of
who owns which page (`engine.executor.integrity.PageRecord`, kept in step by `ownership_updates`), and drop the same
items everywhere when one rank finds a violation (`without`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.core.memory import pages_filled


@dataclass(frozen=True)
class WorkerFault:
    """Fault injection: a fault for worker `rank` to strike on its own state in the first step where it can
    (`engine.executor.faults.strike`); it travels with a plan."""

    rank: int
    kind: str
    seq_id: int         # the victim (-1 for fp8_scale: every holder)
    page: int           # the victim's page the fault concerns
    value: int          # foreign_page / page_out_of_range: the page written over `page`; double_allocation: the
                        # second owner; bit_flip / fp8_scale: the seed that picks the bit or the scale


@dataclass
class StepPlan:
    """Flat new tokens, their cache slots, each decode's block table and context length, each prefill chunk
    as (first row, tokens, context length, pages), the rows whose logits are wanted (None: every row)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_tables: list[list[int]]
    decode_lens: list[int]
    prefills: list[tuple[int, int, int, list[int]]]
    logit_rows: list[int] | None
    calibrate_kv: bool = False          # the FP8 scale calibration's prefill: each rank sets its own scales
    fail_rank: int | None = None        # fault injection: this worker rank raises instead of running the step
    check: bool = False                 # integrity on: every rank checks the tables before the forward pass
    device_check: bool = False          # one rank, integrity on the device: the runner flags the items in the step
    seq_ids: list[int] = field(default_factory=list)                # by item
    leases: list[list[int]] = field(default_factory=list)           # by item, the epoch of each table entry
    # (page, owner, epoch, position, holders who joined, who left, reset): `engine.executor.integrity.Update`
    ownership_updates: list[tuple] = field(default_factory=list)
    worker_fault: WorkerFault | None = None

    @property
    def num_items(self) -> int:
        return len(self.decode_tables) + len(self.prefills)

    def tables(self) -> list[list[int]]:
        """The pages each item reads through, by item."""
        return self.decode_tables + [pages for *_, pages in self.prefills]

    def rows(self, item: int) -> range:
        if item < len(self.decode_tables):
            return range(item, item + 1)
        row, tokens, _, _ = self.prefills[item - len(self.decode_tables)]
        return range(row, row + tokens)

    def writes(self, page_size: int) -> list[tuple[int, int]]:
        """(sequence, page) of every page the step writes into, by item."""
        return [(seq_id, page) for item, seq_id in enumerate(self.seq_ids)
                for page in dict.fromkeys(self.slots[row] // page_size for row in self.rows(item))]

    def filled_pages(self, page_size: int) -> list[int]:
        """The pages this step's writes complete (what integrity's `full` mode seals after it)."""
        spans = [(length - 1, length) for length in self.decode_lens]
        spans += [(context - tokens, context) for _, tokens, context, _ in self.prefills]
        return [page for (start, end), table in zip(spans, self.tables())
                for page in pages_filled(table, start, end, page_size)]

    def without(self, dropped: set[int]) -> StepPlan:
        """The plan with the `dropped` items taken out, rows renumbered: every rank derives the same one."""
        kept = [item for item in range(self.num_items) if item not in dropped]
        new_row: dict[int, int] = {}
        for item in kept:
            for row in self.rows(item):
                new_row[row] = len(new_row)
        rows = sorted(new_row)
        num_decodes = len(self.decode_tables)
        decodes = [item for item in kept if item < num_decodes]
        prefills = []
        for item in kept[len(decodes):]:
            row, tokens, context, pages = self.prefills[item - num_decodes]
            prefills.append((new_row[row], tokens, context, pages))
        return replace(
            self,
            token_ids=[self.token_ids[row] for row in rows],
            positions=[self.positions[row] for row in rows],
            slots=[self.slots[row] for row in rows],
            decode_tables=[self.decode_tables[item] for item in decodes],
            decode_lens=[self.decode_lens[item] for item in decodes],
            prefills=prefills,
            logit_rows=None if self.logit_rows is None else [new_row[r] for r in self.logit_rows if r in new_row],
            seq_ids=[self.seq_ids[item] for item in kept],
            leases=[self.leases[item] for item in kept],
        )
