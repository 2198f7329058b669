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

With prefix caching, a page that fills up is published under its chained hash (`engine.core.prefix_cache`),
and a request whose prompt starts with the same tokens (and salt) is given that page instead of computing it:

    seq 7: "You are ... (page A) | (page B) | Hi"      table [A, B, 4]      A, B published, read-only
    seq 9: "You are ... (page A) | (page B) | Hey"     table [A, B, 6]      A, B shared: reference count 2

A published page nobody holds any more stays published, in an LRU of evictable pages; a request's pages enter it
tail first, so a prompt's last pages go before its first ones. The pool takes fresh free pages first and evicts
the least recently used published page only when none is left: the free pages are the free list plus the LRU.

For the integrity checks (`engine.executor.integrity`) every page also has an epoch that changes each time it is
freed; a block table records the epoch at which it got each page (its lease), and an optional
`PageGuard` hears of every grant and release, so that a table that still names a page after its
release, or a page of someone else, can be told from a valid one. The guard also hears when a sequence starts
or stops holding a published page (`shared`, `unshared`): such pages have several readers and no writer. With
a guard, freeing a table releases the pages the guard says the sequence holds and quarantines the entries it
rejects: quarantined pages never go back to the free list (nor stay published).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Protocol

from engine.core.memory import pages_for_tokens


class PageGuard(Protocol):
    def granted(self, seq_id: int, page: int, epoch: int) -> None: ...

    def shared(self, seq_id: int, page: int, epoch: int, position: int) -> None:
        """`seq_id` holds the published (read-only) page: it published it, or a cache hit gave it to it. A
        published page sits at the same `position` of every table that holds it (its page number in the tokens)."""

    def unshared(self, seq_id: int, page: int) -> None:
        """`seq_id` let go of a published page that others still hold."""

    def released(self, page: int, epoch: int) -> None: ...

    def vet(self, pages: list[int]) -> int:
        """How many of the published pages, from the first, are sound to hand to a new holder."""

    def publishable(self, seq_id: int, page: int, lease: int) -> bool:
        """Whether the sequence holds the page alone at its lease: only then are its bytes the sequence's own tokens
        to publish (a corrupted table entry, published, would hand a cache hit someone else's page)."""

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
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = enable_prefix_caching
        self._free = FreePages(num_pages)
        self._published: dict[bytes, int] = {}              # page hash -> page
        self._names: dict[int, tuple[bytes, bytes]] = {}    # published page -> (its hash, its token key)
        self._evictable: OrderedDict[int, None] = OrderedDict()     # published, held by none; LRU first
        self._num_published: dict[int, int] = {}            # pages of a table published (or found) so far
        self.evictions = 0
        self.refused_hits: list[tuple[int, str]] = []      # (page, why) of cache hits refused, for the engine
        self._ref_counts = [0] * num_pages
        self._tables: dict[int, list[int]] = {}
        self._leases: dict[int, list[int]] = {}     # epoch of each page of a table when it was granted
        self._num_slots: dict[int, int] = {}
        self._epochs = [0] * num_pages
        self.quarantined: set[int] = set()
        self.guard: PageGuard | None = None

    @property
    def num_free_pages(self) -> int:
        """Pages a request can be given: the free list and the published pages nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free) - len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Published pages, held or not."""
        return len(self._names)

    def is_published(self, page: int) -> bool:
        return page in self._names

    def num_published(self, seq_id: int) -> int:
        return self._num_published.get(seq_id, 0)

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

    def cached_prefix(self, hashes: list[bytes], keys: list[bytes], count: int) -> list[int]:
        """The published pages of the longest run of the first `count` page hashes, each confirmed against its
        stored tokens: a page whose tokens differ (a collision, or a corrupted index) is no hit; its index entry
        is dropped and the page reported in `refused_hits`."""
        pages, published, names = [], self._published, self._names
        for index in range(count):
            page = published.get(hashes[index])
            if page is None:
                break
            if names[page][1] != keys[index]:
                self._drop_index(hashes[index], page)
                break
            pages.append(page)
        return pages

    def _drop_index(self, page_hash: bytes, page: int) -> None:
        del self._published[page_hash]
        self.refused_hits.append((page, "it does not hold the tokens of its hash"))
        if self._names[page][0] == page_hash:       # the page's own name is wrong: it is published no more
            self._unpublish(page)

    def _forget(self, page: int) -> None:
        """The page's name goes, and its index entry if the entry still points at it."""
        page_hash, _ = self._names.pop(page)
        if self._published.get(page_hash) == page:
            del self._published[page_hash]

    def _unpublish(self, page: int) -> None:
        self._forget(page)
        if page in self._evictable:
            del self._evictable[page]
            if page not in self.quarantined:
                self._free.append(page)

    def vet(self, cached: list[int]) -> int:
        """How many of the `cached` pages, from the first, the guard vouches for (all without a guard); the first
        it refuses (its bytes no longer match their checksum) is quarantined and reported in `refused_hits`."""
        if self.guard is None or not cached:
            return len(cached)
        sound = self.guard.vet(cached)
        if sound < len(cached):
            self.quarantine([cached[sound]])
            self.refused_hits.append((cached[sound], "its bytes fail their checksum"))
        return sound

    def _reusable(self, cached: list[int]) -> int:
        """Free pages left once the cached pages (some of which may be evictable) are taken."""
        return self.num_free_pages - sum(1 for page in cached if self._ref_counts[page] == 0)

    def can_allocate(self, num_tokens: int, cached: list[int] = ()) -> bool:
        """Whether a sequence can start with the `cached` pages and slots for `num_tokens` more tokens."""
        return pages_for_tokens(len(cached) * self.page_size + num_tokens, self.page_size) - len(cached) \
            <= (self._reusable(cached) if cached else self.num_free_pages)

    def allocate(self, seq_id: int, num_tokens: int, cached: list[int] = ()) -> list[int]:
        """Gives a sequence without pages the `cached` pages (a prefix-cache hit, shared) and enough new pages
        for `num_tokens` more tokens; returns the new pages."""
        if seq_id in self._tables:
            raise OutOfPages(f"sequence {seq_id} already holds pages")
        if not self.can_allocate(num_tokens, cached):
            raise OutOfPages(f"{num_tokens} tokens need more than the {self.num_free_pages} free pages")
        self._tables[seq_id] = []
        self._leases[seq_id] = []
        self._num_slots[seq_id] = len(cached) * self.page_size
        if self.prefix_caching:
            self._num_published[seq_id] = len(cached)
        if cached:
            self._share(seq_id, cached)
        return self.append(seq_id, num_tokens)

    def _share(self, seq_id: int, pages: list[int]) -> None:
        counts, epochs, guard = self._ref_counts, self._epochs, self.guard
        table, leases = self._tables[seq_id], self._leases[seq_id]
        for page in pages:
            if counts[page] == 0:
                del self._evictable[page]
            counts[page] += 1
            if guard is not None:
                guard.shared(seq_id, page, epochs[page], len(table))
            table.append(page)
            leases.append(epochs[page])

    def publish(self, seq_id: int, hashes: list[bytes], keys: list[bytes], num_full: int) -> None:
        """Publishes the sequence's pages up to its `num_full`-th, now full of computed tokens, under their hashes;
        a page whose hash is published already (the same prefix computed twice at once) stays private. With a guard,
        publishing stops at an entry the guard does not vouch for (a corrupted table: its sequence is aborted)."""
        start = self._num_published[seq_id]
        table, published, names, guard = self._tables[seq_id], self._published, self._names, self.guard
        for index in range(start, min(num_full, len(table))):
            page, page_hash = table[index], hashes[index]
            if page_hash in published or page in names or page in self.quarantined:
                continue
            if guard is not None and not guard.publishable(seq_id, page, self._leases[seq_id][index]):
                break           # the guard reports the entry; pages after it chain on it: no hit could reach them
            published[page_hash] = page
            names[page] = (page_hash, keys[index])
            if guard is not None:
                guard.shared(seq_id, page, self._epochs[page], index)
        self._num_published[seq_id] = max(start, num_full)

    def _take(self, count: int) -> list[int]:
        """`count` pages for new tokens: free ones first, then the least recently used published ones nobody
        holds (evicted: unpublished)."""
        fresh = min(count, len(self._free))
        pages = self._free.take(fresh) if fresh > 0 else []
        for _ in range(count - fresh):
            page, _ = self._evictable.popitem(last=False)
            self._forget(page)
            self.evictions += 1
            pages.append(page)
        return pages

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self._new_pages_needed(seq_id, num_new_tokens) <= self.num_free_pages

    def append(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Reserves slots for `num_new_tokens` more tokens; returns the pages that had to be added."""
        needed = self._new_pages_needed(seq_id, num_new_tokens)
        if needed <= 0:                     # the common decode step: room left in the last page (or a table that
                                            # names more pages than its slots need: a double-allocation bug's)
            self._num_slots[seq_id] += num_new_tokens
            return []
        if needed > self.num_free_pages:
            raise OutOfPages(f"sequence {seq_id} needs {needed} pages, {self.num_free_pages} are free")
        new_pages = self._take(needed)
        self._grant(seq_id, new_pages)
        self._num_slots[seq_id] += num_new_tokens
        return new_pages

    def append_decodes(self, seq_ids: list[int]) -> bool:
        """One more token slot for each sequence (all hold pages), all or nothing: False, and nothing reserved,
        when the free pages cannot take the ones whose last page is full. The decode step's fast path."""
        slots, page_size = self._num_slots, self.page_size
        full = [seq_id for seq_id in seq_ids if slots[seq_id] % page_size == 0]
        if len(full) > self.num_free_pages:
            return False
        for seq_id, page in zip(full, self._take(len(full))):
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
        if self.pages_for_more(seq_ids, num_tokens) > self.num_free_pages:
            raise OutOfPages(f"{num_tokens} more slots for {len(seq_ids)} sequences need more than the "
                             f"{self.num_free_pages} free pages")
        for seq_id in seq_ids:
            self.append(seq_id, num_tokens)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keeps the sequence's first `num_tokens` slots and gives back the rest (rejected speculative drafts): the
        pages only those slots needed are released, last first."""
        if not 0 <= num_tokens <= self._num_slots[seq_id]:
            raise ValueError(f"sequence {seq_id} holds {self._num_slots[seq_id]} slots, cannot keep {num_tokens}")
        keep = pages_for_tokens(num_tokens, self.page_size)
        table = self._tables[seq_id]
        tail = table[keep:]
        if tail:
            del table[keep:]
            del self._leases[seq_id][keep:]
            self._release(tail[::-1], seq_id)
        self._num_slots[seq_id] = num_tokens

    def _grant(self, seq_id: int, pages: list[int]) -> None:
        counts, epochs = self._ref_counts, self._epochs
        for page in pages:
            counts[page] += 1
        self._tables[seq_id].extend(pages)
        self._leases[seq_id].extend([epochs[page] for page in pages])
        if self.guard is not None:
            for page in pages:
                self.guard.granted(seq_id, page, epochs[page])

    def _release(self, pages: list[int], seq_id: int | None) -> None:
        """One reference less (`seq_id`'s) on each of the pages; a page no one holds any more is free again
        (unless quarantined), in a new epoch: back on the free list, or, published, at the end of the LRU."""
        counts, epochs, guard, quarantined, names = (self._ref_counts, self._epochs, self.guard, self.quarantined,
                                                     self._names)
        for page in pages:
            if counts[page] <= 0:
                continue
            counts[page] -= 1
            if counts[page] == 0:
                epochs[page] += 1
                if guard is not None:
                    guard.released(page, epochs[page])
                if page in quarantined:
                    continue
                if page in names:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
            elif page in names and guard is not None and seq_id is not None:
                guard.unshared(seq_id, page)

    def free(self, seq_id: int) -> None:
        """Releases all pages of a sequence (with prefix caching its last first: they leave the cache first); a
        sequence without pages is a no-op. Published pages others hold stay theirs."""
        table = self._tables.pop(seq_id, [])
        leases = self._leases.pop(seq_id, [])
        self._num_slots.pop(seq_id, None)
        self._num_published.pop(seq_id, None)
        if self.guard is not None and table:
            held, suspects = self.guard.audit(seq_id, table, leases)
            self.quarantine(suspects)
            named, kept = set(table), set(held)
            table = [page for page in table if page in kept] + [page for page in held if page not in named]
        self._release(table[::-1] if self.prefix_caching else table, seq_id)

    def quarantine(self, pages: list[int]) -> None:
        """Takes pages out of circulation: whoever holds one keeps it, but it is published no more and never
        returns to the free list."""
        for page in pages:
            if 0 <= page < self.num_pages and page not in self.quarantined:
                self.quarantined.add(page)
                if page in self._names:
                    self._unpublish(page)
                if page in self._free:
                    self._free.remove(page)

    # Fault injection only (`engine.harness.fault_campaign`): the bookkeeping bugs the integrity checks must catch,
    # made through the allocator's own paths so that its guard sees what a real bug would make it see.

    def fault_table(self, seq_id: int) -> list[int]:
        """The sequence's live block table, to be corrupted in place (a bug writing a wrong page id)."""
        return self._tables[seq_id]

    def fault_release(self, page: int) -> None:
        """Frees a page its holders still name, however many they are (a use-after-free bug)."""
        self._ref_counts[page] = min(self._ref_counts[page], 1)
        self._release([page], None)

    def fault_grant(self, seq_id: int, page: int) -> None:
        """Hands a page another sequence holds to `seq_id` as well (a double-allocation bug)."""
        self._grant(seq_id, [page])

    def fault_publish(self, seq_id: int) -> int:
        """Publishes the page the sequence is still writing into (a bug in telling a full page): returns it."""
        page = self._tables[seq_id][-1]
        page_hash = bytes(32 - len(str(page))) + str(page).encode()
        self._published[page_hash] = page
        self._names[page] = (page_hash, b"")
        if self.guard is not None:
            self.guard.shared(seq_id, page, self._epochs[page], len(self._tables[seq_id]) - 1)
        return page

    def fault_collide(self, page_hash: bytes, page: int) -> None:
        """Points a published hash at another published page (a hash collision, or a corrupted index)."""
        self._published[page_hash] = page

    def published_hashes(self) -> dict[bytes, int]:
        """Hash -> page of every published page; for tests and fault injection."""
        return dict(self._published)

    def check_invariants(self) -> None:
        """Raises AssertionError if the accounting is inconsistent; for tests and debugging."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & set(self._evictable), "a page is both free and evictable"
        for page in self._published.values():
            assert page in self._names, f"published page {page} has no name"
            assert page not in free, f"published page {page} is on the free list"
        for page in self._evictable:
            assert self._ref_counts[page] == 0 and page in self._names, f"evictable page {page} is held or unnamed"
        free |= set(self._evictable)
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
