"""Page allocator of the paged KV cache. Torch-free: the simulator drives this very class.

The pool holds `num_pages` pages of `page_size` token slots. A sequence owns a block table, the list of
its pages in token order; slot `t` of the sequence lives in page `table[t // page_size]` at offset
`t % page_size`:

    page_size = 4           pool: [0][1][2][3][4][5][6][7]
    seq 7: 10 tokens        table [5, 2, 6]   tokens 0-3 -> page 5, 4-7 -> page 2, 8-9 -> page 6 (2 free)
    seq 9:  3 tokens        table [0]         tokens 0-2 -> page 0 (1 free)
    free pages (FIFO):      1, 3, 4, 7

Every mutating method has a paired `can_*` that says whether it would succeed; calling the mutator when
its `can_*` is false is a bug of the caller and raises `OutOfPages`. Pages carry reference counts and go
back to the free list when the count drops to zero.

For the integrity checks (`engine.executor.integrity`) every page also has an epoch that changes each time it is
freed; a block table records the epoch at which it got each page (its lease), and an optional
`PageGuard` hears of every grant and release, so that a table that still names a page after its
release, or a page of someone else, can be told from a valid one. With a guard, freeing a table releases
the pages the guard says the sequence holds and quarantines the entries it rejects: quarantined pages
never go back to the free list.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine.core.memory import pages_for_tokens


class PageGuard(Protocol):
    def granted(self, seq_id: int, page: int, epoch: int) -> None: ...

    def released(self, page: int, epoch: int) -> None: ...

    def audit(self, seq_id: int, pages: list[int], leases: list[int]) -> tuple[list[int], list[int]]:
        """Of a table being freed: the pages the sequence really holds, and the entries that fail."""


class OutOfPages(RuntimeError):
    """A mutator was called although its `can_*` check was false."""


class FreePages:
    """The free list: the pages never handed out yet, lowest first (made lazily, so a pool of a million pages
    costs nothing to create: the simulator makes one per simulation), then the pages given back, in the order
    they came back. A deque's interface, as much of it as the manager uses."""

    def __init__(self, num_pages: int) -> None:
        self._next, self._end = 0, num_pages
        self._withdrawn: set[int] = set()       # never handed out, but taken out of circulation
        self._returned: deque[int] = deque()

    def __len__(self) -> int:
        return self._end - self._next - len(self._withdrawn) + len(self._returned)

    def _fresh(self, page: int) -> bool:
        return self._next <= page < self._end and page not in self._withdrawn

    def __contains__(self, page: int) -> bool:
        return self._fresh(page) or page in self._returned

    def __iter__(self) -> Iterator[int]:
        yield from (page for page in range(self._next, self._end) if page not in self._withdrawn)
        yield from self._returned

    def take(self, count: int) -> list[int]:
        """The next `count` pages, as `count` poplefts would give them."""
        if not self._withdrawn and self._end - self._next >= count:
            pages = list(range(self._next, self._next + count))
            self._next += count
            return pages
        return [self.popleft() for _ in range(count)]

    def popleft(self) -> int:
        while self._next < self._end:
            page = self._next
            self._next += 1
            if page not in self._withdrawn:
                return page
            self._withdrawn.discard(page)
        return self._returned.popleft()

    def append(self, page: int) -> None:
        self._returned.append(page)

    def remove(self, page: int) -> None:
        if self._fresh(page):
            self._withdrawn.add(page)
        else:
            self._returned.remove(page)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = FreePages(num_pages)
        self._ref_counts = [0] * num_pages
        self._tables: dict[int, list[int]] = {}
        self._leases: dict[int, list[int]] = {}     # epoch of each page of a table when it was granted
        self._num_slots: dict[int, int] = {}
        self._epochs = [0] * num_pages
        self.quarantined: set[int] = set()
        self.guard: PageGuard | None = None

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def leases(self, seq_id: int) -> list[int]:
        """The epoch at which the sequence got each page of its block table, in table order."""
        return list(self._leases[seq_id])

    def num_slots(self, seq_id: int) -> int:
        """Token slots reserved for the sequence (its cached tokens plus those scheduled now)."""
        return self._num_slots.get(seq_id, 0)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def _new_pages_needed(self, seq_id: int, num_new_tokens: int) -> int:
        # on the hot path of every step for every sequence (the simulator's too): plain arithmetic
        table = self._tables.get(seq_id)
        if table is None:
            return -(-num_new_tokens // self.page_size)
        return -(-(self._num_slots[seq_id] + num_new_tokens) // self.page_size) - len(table)

    def can_allocate(self, num_tokens: int) -> bool:
        return pages_for_tokens(num_tokens, self.page_size) <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Gives a sequence without pages enough pages for its first `num_tokens` tokens."""
        if seq_id in self._tables:
            raise OutOfPages(f"sequence {seq_id} already holds pages")
        if not self.can_allocate(num_tokens):
            raise OutOfPages(f"{num_tokens} tokens need more than the {len(self._free)} free pages")
        self._tables[seq_id] = []
        self._leases[seq_id] = []
        self._num_slots[seq_id] = 0
        return self.append(seq_id, num_tokens)

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self._new_pages_needed(seq_id, num_new_tokens) <= len(self._free)

    def append(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Reserves slots for `num_new_tokens` more tokens; returns the pages that had to be added."""
        needed = self._new_pages_needed(seq_id, num_new_tokens)
        if needed == 0:                     # the common decode step: room left in the last page
            self._num_slots[seq_id] += num_new_tokens
            return []
        if needed > len(self._free):
            raise OutOfPages(f"sequence {seq_id} needs {needed} pages, {len(self._free)} are free")
        new_pages = self._free.take(needed)
        self._grant(seq_id, new_pages)
        self._num_slots[seq_id] += num_new_tokens
        return new_pages

    def append_decodes(self, seq_ids: list[int]) -> bool:
        """One more token slot for each sequence (all hold pages), all or nothing: False, and nothing reserved,
        when the free pages cannot take the ones whose last page is full. The decode step's fast path."""
        slots, page_size = self._num_slots, self.page_size
        full = [seq_id for seq_id in seq_ids if slots[seq_id] % page_size == 0]
        if len(full) > len(self._free):
            return False
        for seq_id, page in zip(full, self._free.take(len(full))):
            self._grant(seq_id, [page])
        for seq_id in seq_ids:
            slots[seq_id] += 1
        return True

    def pages_for_more(self, seq_ids: list[int], num_tokens: int) -> int:
        """The pages `num_tokens` more slots for each sequence would add."""
        slots, tables, page_size = self._num_slots, self._tables, self.page_size
        return sum(-(-(slots[seq_id] + num_tokens) // page_size) - len(tables[seq_id]) for seq_id in seq_ids)

    def append_many(self, seq_ids: list[int], num_tokens: int) -> None:
        """`num_tokens` more slots for each sequence at once (the caller checked `pages_for_more`): what that
        many decode steps reserve, with the same page counts (not the same page ids)."""
        if self.pages_for_more(seq_ids, num_tokens) > len(self._free):
            raise OutOfPages(f"{num_tokens} more slots for {len(seq_ids)} sequences need more than the "
                             f"{len(self._free)} free pages")
        for seq_id in seq_ids:
            self.append(seq_id, num_tokens)

    def _grant(self, seq_id: int, pages: list[int]) -> None:
        counts, epochs = self._ref_counts, self._epochs
        for page in pages:
            counts[page] += 1
        self._tables[seq_id].extend(pages)
        self._leases[seq_id].extend([epochs[page] for page in pages])
        if self.guard is not None:
            for page in pages:
                self.guard.granted(seq_id, page, epochs[page])

    def _release(self, pages: list[int]) -> None:
        """One reference less on each of the pages; a page no one holds any more is free again (unless
        quarantined), in a new epoch."""
        counts, epochs, guard, quarantined, free = (self._ref_counts, self._epochs, self.guard, self.quarantined,
                                                    self._free)
        for page in pages:
            if counts[page] <= 0:
                continue
            counts[page] -= 1
            if counts[page] == 0:
                epochs[page] += 1
                if guard is not None:
                    guard.released(page, epochs[page])
                if page not in quarantined:
                    free.append(page)

    def free(self, seq_id: int) -> None:
        """Releases all pages of a sequence; a sequence without pages is a no-op."""
        table = self._tables.pop(seq_id, [])
        leases = self._leases.pop(seq_id, [])
        self._num_slots.pop(seq_id, None)
        if self.guard is not None and table:
            table, suspects = self.guard.audit(seq_id, table, leases)
            self.quarantine(suspects)
        self._release(table)

    def quarantine(self, pages: list[int]) -> None:
        """Takes pages out of circulation: whoever holds one keeps it, but it never returns to the free list."""
        for page in pages:
            if 0 <= page < self.num_pages and page not in self.quarantined:
                self.quarantined.add(page)
                if page in self._free:
                    self._free.remove(page)

    # Fault injection only (`engine.harness.fault_campaign`): the bookkeeping bugs the integrity checks must catch,
    # made through the allocator's own paths so that its guard sees what a real bug would make it see.

    def fault_table(self, seq_id: int) -> list[int]:
        """The sequence's live block table, to be corrupted in place (a bug writing a wrong page id)."""
        return self._tables[seq_id]

    def fault_release(self, page: int) -> None:
        """Frees a page its holder still names (a use-after-free bug)."""
        self._release([page])

    def fault_grant(self, seq_id: int, page: int) -> None:
        """Hands a page another sequence holds to `seq_id` as well (a double-allocation bug)."""
        self._grant(seq_id, [page])

    def check_invariants(self) -> None:
        """Raises AssertionError if the accounting is inconsistent; for tests and debugging."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        held: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            assert len(table) == pages_for_tokens(self._num_slots[seq_id], self.page_size), \
                f"sequence {seq_id} holds {len(table)} pages for {self._num_slots[seq_id]} slots"
            for page in table:
                held[page] = held.get(page, 0) + 1
        for page in range(self.num_pages):
            if page in self.quarantined:
                assert page not in free, f"quarantined page {page} is on the free list"
                continue
            assert self._ref_counts[page] == held.get(page, 0), f"page {page} has a wrong reference count"
            assert (page in free) == (self._ref_counts[page] == 0), f"page {page} is both free and held"
