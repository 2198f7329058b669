"""The step plan every rank runs: dropping items renumbers rows the same way on every rank."""
from __future__ import annotations

from engine.executor.step_plan import StepPlan


def plan_of_two_decodes_and_two_prefills() -> StepPlan:
    """Rows: decode A (row 0), decode B (row 1), prefill C (rows 2-4), prefill D (rows 5-6); pages of 4 tokens."""
    return StepPlan(token_ids=[10, 11, 20, 21, 22, 30, 31], positions=[7, 3, 0, 1, 2, 4, 5],
                    slots=[107, 203, 300, 301, 302, 404, 405], decode_tables=[[1, 2], [3]], decode_lens=[8, 4],
                    prefills=[(2, 3, 3, [5]), (5, 2, 6, [6, 4])], logit_rows=[0, 1, 4, 6], check=True,
                    seq_ids=[100, 101, 102, 103], leases=[[0, 0], [1], [2], [3, 3]])


def test_dropping_items_renumbers_rows_logits_and_prefill_starts():
    plan = plan_of_two_decodes_and_two_prefills().without({0, 2})
    assert plan.token_ids == [11, 30, 31] and plan.positions == [3, 4, 5] and plan.slots == [203, 404, 405]
    assert plan.decode_tables == [[3]] and plan.decode_lens == [4]
    assert plan.prefills == [(1, 2, 6, [6, 4])]
    assert plan.logit_rows == [0, 2]
    assert plan.seq_ids == [101, 103] and plan.leases == [[1], [3, 3]] and plan.num_items == 2


def test_dropping_nothing_or_everything():
    plan = plan_of_two_decodes_and_two_prefills()
    assert plan.without(set()) == plan
    empty = plan.without({0, 1, 2, 3})
    assert empty.token_ids == [] and empty.logit_rows == [] and empty.num_items == 0


def test_filled_pages_are_the_pages_a_step_completes():
    """Decode A writes position 7, the last slot of its page 2; decode B writes position 3 and fills page 3;
    prefill C (positions 0-2) fills nothing; prefill D (positions 4-5) leaves page 4 half full."""
    assert plan_of_two_decodes_and_two_prefills().filled_pages(4) == [2, 3]
