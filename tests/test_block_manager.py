"""The page allocator: exact page ids on tiny pools, and invariants under random operation sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager, OutOfPages


def test_exact_pages_and_slots():
    manager = BlockManager(num_pages=8, page_size=4)
    assert manager.allocate(7, 10) == [0, 1, 2]
    assert manager.allocate(9, 3) == [3]
    assert manager.num_free_pages == 4
    assert manager.append(7, 2) == []            # slots 10, 11 fit in page 2
    assert manager.append(7, 1) == [4]           # slot 12 opens a page
    assert manager.block_table(7) == [0, 1, 2, 4]
    manager.free(7)
    assert manager.num_free_pages == 7
    assert manager.allocate(11, 16) == [5, 6, 7, 0]   # FIFO: the oldest free pages first
    manager.check_invariants()


def test_can_methods_pair_with_mutators():
    manager = BlockManager(num_pages=2, page_size=4)
    assert manager.can_allocate(8) and not manager.can_allocate(9)
    manager.allocate(1, 5)
    assert manager.can_append(1, 3) and not manager.can_append(1, 4)
    with pytest.raises(OutOfPages):
        manager.append(1, 4)
    with pytest.raises(OutOfPages):
        manager.allocate(1, 1)
    assert manager.block_table(1) == [0, 1] and manager.num_slots(1) == 5
    manager.free(1)
    manager.free(1)
    assert manager.num_free_pages == 2


def test_a_table_naming_a_page_too_many_takes_nothing_from_the_pool():
    """After a double-allocation bug a table names more pages than its slots need: growing into them must not take
    a negative number of pages from the free list (which once handed one page to two sequences)."""
    manager = BlockManager(num_pages=8, page_size=4)
    manager.allocate(1, 4)
    manager.allocate(2, 4)
    manager.fault_grant(1, manager.block_table(2)[0])
    free = manager.num_free_pages
    assert manager.append(1, 2) == [] and manager.num_free_pages == free
    assert set(manager.allocate(3, 8)).isdisjoint(manager.block_table(1) + manager.block_table(2))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "append", "free"]),
                          st.integers(0, 5), st.integers(1, 20)), max_size=60),
       st.integers(1, 12), st.integers(1, 8))
def test_invariants_under_random_operations(operations, num_pages, page_size):
    manager = BlockManager(num_pages, page_size)
    slots: dict[int, int] = {}
    for op, seq_id, tokens in operations:
        if op == "allocate" and seq_id not in slots:
            ok = manager.can_allocate(tokens)
            if ok:
                manager.allocate(seq_id, tokens)
                slots[seq_id] = tokens
            else:
                with pytest.raises(OutOfPages):
                    manager.allocate(seq_id, tokens)
        elif op == "append" and seq_id in slots:
            ok = manager.can_append(seq_id, tokens)
            if ok:
                manager.append(seq_id, tokens)
                slots[seq_id] += tokens
            else:
                with pytest.raises(OutOfPages):
                    manager.append(seq_id, tokens)
        elif op == "free":
            manager.free(seq_id)
            slots.pop(seq_id, None)
        manager.check_invariants()
        used = sum(-(-n // page_size) for n in slots.values())
        assert manager.num_used_pages == used
        assert manager.num_free_pages == num_pages - used
        for seq_id, n in slots.items():
            assert manager.num_slots(seq_id) == n
        held = [p for s in slots for p in manager.block_table(s)]
        assert len(held) == len(set(held)), "a page is held twice"
    for seq_id in list(slots):
        manager.free(seq_id)
    assert manager.num_free_pages == num_pages
