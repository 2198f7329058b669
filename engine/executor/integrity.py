"""KV-cache integrity: every request may read and write only its own pages.

The block manager's tables are what the step reads through; a bug there (a page used after its free, a
stale or foreign entry, one page handed to two requests) or corrupted page memory would make a request
answer from someone else's context. This module keeps an independent record on the device and checks
the step against it before the step runs:

    ownership table (device)    page:    0   1   2   3   4   5
                                owner:   7  -1   9   7  -1   9      (-1: free)
                                epoch:   3   5   1   2   4   1      (bumped on every free)
    block tables of the batch   seq 7: (page 0, epoch 3) (page 3, epoch 2)          ok
                                seq 9: (page 2, epoch 1) (page 1, epoch 4)          page 1 is free: abort 9

Modes: `off` (no record, nothing on the hot path), `ownership` (the check above, one vectorized
operation per step, a Triton kernel on CUDA) and `full`: also a checksum of every page's K/V bytes taken
when the page fills up (sealed) and verified when a step reads it (all pages, or a random sample per
step), and, for FP8 pages, the per-(layer, head) scales compared with their trusted copy.

A request whose check fails is aborted before the step (finish reason `integrity_error`); its suspect
pages are quarantined and never return to the free pool; the others go on. Its pages are released
according to the ownership table, not its (untrusted) block table.

Prefix caching shares pages: a published page's owner is SHARED and its holders are a set (kept on the host,
and on the device as keys page·2³² + holder, so a table entry of a shared page is checked by one
`isin`); a shared page also has a position, the same in every table that holds it (its page number in the
tokens), so a holder's table cannot name it in the wrong place. Shared pages are read-only: a step that would
write into a shared page, or into a sealed one, is a `shared_write` violation of its request. Their checksums are taken once, when they fill up, and verified on
every read. A page released while others still hold it (`freed_held`) aborts its remaining holders: their
context is gone.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from engine.core.block_manager import BlockManager
from engine.core.config import INTEGRITY_MODES
from engine.core.memory import pages_filled, pages_written
from engine.core.scheduler import ScheduledSequence
from engine.executor.step_plan import StepPlan
from engine.kernels.backend import use_triton
from engine.kernels.reference import HOLDER_SHIFT, OWNERSHIP_FLAG, SHARED_OWNER, SHARED_WRITE_FLAG
from engine.model.kv_cache import PagedKVCache
from engine.parallel.group import TensorGroup

FREE = -1
SHARED = SHARED_OWNER
CHECKSUM_CHUNK_PAGES = 64
KIND_CODES = {"ownership": OWNERSHIP_FLAG, "checksum": 2, "shared_write": SHARED_WRITE_FLAG, "freed_held": 4,
              "fp8_scale": 5}       # the agreement's encoding (the device check's flags too); the worst wins
KINDS = {code: kind for kind, code in KIND_CODES.items()}
# a record update: (page, owner, epoch, position, holders who joined, holders who left, reset)
Update = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], bool]

log = logging.getLogger("engine.executor.integrity")


@dataclass(frozen=True)
class StepCheck:
    """What the device check reads of a step, on the device: each item's table and leases (padded rows), its entry
    count and sequence id, its rows in the flat batch, and the batch's slots (a flagged item's are redirected)."""

    tables: torch.Tensor
    leases: torch.Tensor
    entry_counts: torch.Tensor
    seq_ids: torch.Tensor
    row_starts: torch.Tensor
    row_counts: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class Violation:
    """One failed check. `page` is None for a corrupted FP8 scale, which concerns every page."""

    seq_id: int
    kind: str                   # "ownership" | "checksum" | "shared_write" | "freed_held" | "fp8_scale"
    page: int | None
    expected_owner: int | None = None
    found_owner: int | None = None
    expected_epoch: int | None = None
    found_epoch: int | None = None
    rank: int = 0               # the tensor-parallel rank whose record or shard failed

    def describe(self) -> str:
        where = f" on rank {self.rank}" if self.rank else ""
        if self.kind == "ownership" and self.page is None:
            return f"request {self.seq_id}: its block table fails the ownership check{where}"
        if self.kind == "ownership":
            return (f"request {self.seq_id}: page {self.page} expected owner {self.expected_owner} epoch "
                    f"{self.expected_epoch}, found owner {self.found_owner} epoch {self.found_epoch}{where}")
        if self.kind == "checksum":
            return f"request {self.seq_id}: sealed page {self.page} fails its checksum{where}"
        if self.kind == "shared_write":
            return f"request {self.seq_id}: the step would write into shared or sealed page {self.page}{where}"
        if self.kind == "freed_held":
            return f"request {self.seq_id}: page {self.page} was freed while it still held it{where}"
        return f"request {self.seq_id}: the FP8 KV scales differ from their trusted copy{where}"


def checksum_weights(kv_cache: PagedKVCache, seed: int = 0) -> list[torch.Tensor]:
    """Random odd 64-bit weights, one per 8-byte word of a page in each layer of each pool (K and V, or the
    latent; a DSA model's indexer keys and their scales too): [layers, 1, words per page] per pool.

    Multiplying by an odd number is a bijection modulo 2**64, so any change within one word (a flipped
    bit, a burst) changes that word's term and hence the checksum.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = []
    for pool in kv_cache.pools:
        words_per_page = pool[0, 0].numel() * pool.element_size() // 8
        drawn = torch.randint(-(1 << 62), 1 << 62, (pool.shape[0], 1, words_per_page), generator=generator)
        weights.append((drawn * 2 + 1).to(pool.device))
    return weights


def page_checksums(kv_cache: PagedKVCache, pages: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """One int64 checksum per page: sum over layers and pools of word × weight, wrapping modulo 2**64."""
    sums = []
    for chunk in pages.split(CHECKSUM_CHUNK_PAGES):
        total = torch.zeros(len(chunk), dtype=torch.int64, device=pages.device)
        for pool, pool_weights in zip(kv_cache.pools, weights):
            words = pool[:, chunk].reshape(pool.shape[0], len(chunk), -1).view(torch.int64)
            total += (words * pool_weights).sum(dim=(0, 2))
        sums.append(total)
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64, device=pages.device)


class PageRecord:
    """The device record of who owns which page, and the checks of block tables against it.

    Rank 0's `IntegrityChecker` keeps it from the block manager's grants and releases; a tensor-parallel
    worker keeps its own from the updates rank 0 sends with each plan, and checks the plan's tables against
    it (and, in `full` mode, its own shard's pages and scales), so a fault on any rank is seen where it is.
    """

    def __init__(self, mode: str, num_pages: int, kv_cache: PagedKVCache, sample_pages: int = 0,
                 seed: int = 0) -> None:
        if mode not in INTEGRITY_MODES[1:]:
            raise ValueError(f"unknown integrity mode {mode!r} (choose from {', '.join(INTEGRITY_MODES)})")
        self.mode = mode
        self.num_pages = num_pages
        self.kv_cache = kv_cache
        self.sample_pages = sample_pages
        device = kv_cache.device
        self.device = device
        self.owners = torch.full((num_pages,), FREE, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(num_pages, dtype=torch.int64, device=device)
        self.positions = torch.full((num_pages,), -1, dtype=torch.int64, device=device)     # of SHARED pages
        self.shared_holders: dict[int, set[int]] = {}           # page -> its holders, for SHARED pages
        self._holder_keys = torch.zeros(0, dtype=torch.int64, device=device)     # page·2³² + holder, each once,
                                                                                 # sorted (the device check searches)
        self.full = mode == "full"
        if self.full:
            page_bytes = [pool[0, 0].numel() * pool.element_size() for pool in kv_cache.pools]
            if any(size % 8 for size in page_bytes):
                raise ValueError(f"full integrity checks need pages of a multiple of 8 bytes in every layer, got "
                                 f"{page_bytes}")
            self.sealed = torch.zeros(num_pages, dtype=torch.bool, device=device)
            self.checksums = torch.zeros(num_pages, dtype=torch.int64, device=device)
            self.weights = checksum_weights(kv_cache, seed)
            self._generator = torch.Generator(device=device).manual_seed(seed)
            self.trust_scales()

    def apply(self, updates: list[Update]) -> None:
        """Writes updates in one go: (page, owner, epoch, position, joined, left, reset), owner a sequence
        (exclusive), FREE, or SHARED with its position; for a SHARED page the holders who joined and left since the
        last update (`reset`: a new sharing, whose holders are exactly those who joined). A page granted to a
        sequence is no longer sealed (it will be written); a page freed or shared keeps its seal and checksum (its
        bytes stay as they were). The sorted holder keys are rebuilt from the host's sets when holders changed; nothing
        here reads the device (the record is written in the step's stream)."""
        if not updates:
            return
        values = torch.tensor([update[:4] for update in updates], dtype=torch.int64).to(self.device)
        self.owners[values[:, 0]] = values[:, 1]
        self.epochs[values[:, 0]] = values[:, 2]
        self.positions[values[:, 0]] = values[:, 3]
        if self.full:           # a granted page will be written: no longer sealed
            self.sealed[values[:, 0]] &= values[:, 1] < 0
        changed = False
        for page, owner, _, _, joined, left, reset in updates:
            holders = self.shared_holders.get(page)
            if holders is not None and (reset or owner != SHARED):
                changed = True
                holders = None
                del self.shared_holders[page]
            if owner != SHARED:
                continue
            if holders is None:
                holders = self.shared_holders[page] = set()
            holders.difference_update(left)
            holders.update(joined)
            changed = changed or bool(left or joined)
        if changed:             # rebuilt from the host's sets: sorted, each key once
            keys = sorted((page << HOLDER_SHIFT) + holder for page, holders in self.shared_holders.items()
                          for holder in holders)
            self._holder_keys = torch.tensor(keys, dtype=torch.int64).to(self.device)

    def holders(self) -> list[int]:
        exclusive = torch.unique(self.owners[self.owners >= 0]).tolist()
        return sorted(set(exclusive).union(*self.shared_holders.values()))

    def check_tables(self, tables: list[tuple[int, list[int], list[int]]],
                     writes: list[tuple[int, int]] = ()) -> list[Violation]:
        """Checks (sequence, pages, leases) tables (and in `full` mode their sealed pages) before a step, and the
        (sequence, page) pairs the step writes into."""
        entries = self._entries(tables)
        bad = self._failing(entries)
        found = [self._ownership_violation(int(entries[1, i]), int(entries[0, i]), int(entries[2, i]))
                 for i in bad]
        found += self._check_writes(writes)
        if self.full:
            found += self._verify_pages(entries, bad)
            found += self._verify_scales()
        return found

    def _check_writes(self, writes: list[tuple[int, int]]) -> list[Violation]:
        """Shared pages are read-only, and so are sealed ones: their checksums were taken."""
        writes = [(seq_id, page) for seq_id, page in writes if 0 <= page < self.num_pages]
        if not writes or (not self.shared_holders and not self.full):
            return []
        pages = torch.tensor([page for _, page in writes], dtype=torch.int64).to(self.device)
        read_only = self.owners[pages] == SHARED
        if self.full:
            read_only |= self.sealed[pages]
        if not bool(read_only.any()):
            return []
        return [Violation(writes[i][0], "shared_write", writes[i][1])
                for i in torch.nonzero(read_only).flatten().tolist()]

    def _entries(self, tables: list[tuple[int, list[int], list[int]]]) -> torch.Tensor:
        """[4, n]: page, sequence, lease and position in its table of every entry."""
        pages, owners, leases, positions = [], [], [], []
        for seq_id, table, table_leases in tables:
            pages.extend(table)
            leases.extend(table_leases)
            owners.extend([seq_id] * len(table))
            positions.extend(range(len(table)))
        return torch.tensor([pages, owners, leases, positions], dtype=torch.int64).reshape(4, -1).to(self.device)

    def _failing(self, entries: torch.Tensor) -> list[int]:
        if entries.device.type == "cuda":
            from engine.kernels.ownership_check import ownership_check
        else:
            from engine.kernels.reference import ownership_check
        bad = ownership_check(entries[:3], self.owners, self.epochs)
        if not bool(bad.any()):
            return []
        if self.shared_holders:
            bad &= ~self._holds_shared(entries)
        return torch.nonzero(bad).flatten().tolist()

    def _holds_shared(self, entries: torch.Tensor) -> torch.Tensor:
        """Entries naming a SHARED page at its epoch and position, of a sequence among its holders."""
        pages, seq_ids, leases, positions = entries
        in_range = (pages >= 0) & (pages < self.num_pages)
        safe = torch.where(in_range, pages, 0)
        member = torch.isin((safe << HOLDER_SHIFT) + seq_ids, self._holder_keys)
        return (in_range & (self.owners[safe] == SHARED) & (self.epochs[safe] == leases)
                & (self.positions[safe] == positions) & member)

    def _ownership_violation(self, seq_id: int, page: int, lease: int) -> Violation:
        in_range = 0 <= page < self.num_pages
        return Violation(seq_id, "ownership", page, seq_id, int(self.owners[page]) if in_range else None,
                         lease, int(self.epochs[page]) if in_range else None)

    def _verify_pages(self, entries: torch.Tensor, failed: list[int]) -> list[Violation]:
        ok = torch.ones(entries.shape[1], dtype=torch.bool, device=self.device)
        ok[failed] = False
        candidates = torch.nonzero(ok & self.sealed[torch.where(ok, entries[0], 0)]).flatten()
        if self.sample_pages and len(candidates) > self.sample_pages:
            pick = torch.randperm(len(candidates), generator=self._generator, device=self.device)
            candidates = candidates[pick[:self.sample_pages]]
        if not len(candidates):
            return []
        pages = entries[0, candidates]
        mismatched = page_checksums(self.kv_cache, pages, self.weights) != self.checksums[pages]
        return [Violation(int(entries[1, i]), "checksum", int(entries[0, i]))
                for i in candidates[mismatched].tolist()]

    def _verify_scales(self) -> list[Violation]:
        """A corrupted scale changes how every page of its layer reads: all requests holding pages are hit."""
        if not self.kv_cache.is_fp8:
            return []
        if all(torch.equal(scale, trusted) for scale, trusted in zip(self.kv_cache.scales, self._trusted_scales)):
            return []
        self.kv_cache.set_scales(*self._trusted_scales)
        return [Violation(seq_id, "fp8_scale", None) for seq_id in self.holders()]

    def trust_scales(self) -> None:
        """Takes the current FP8 scales as the reference (after calibration or `set_scales`)."""
        if self.full and self.kv_cache.is_fp8:
            self._trusted_scales = tuple(scale.clone() for scale in self.kv_cache.scales)

    def seal_pages(self, pages: list[int]) -> None:
        """After a step's KV writes: records the checksum of every page that became full in it."""
        if not self.full or not pages:
            return
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.checksums[index] = page_checksums(self.kv_cache, index, self.weights)
        self.sealed[index] = True


class PendingPage:
    """A page's change since the record was last written: its owner, epoch and position now, and for a SHARED page
    the holders who joined and left since (`reset`: a new sharing, whose holders are exactly those who joined)."""

    __slots__ = ("owner", "epoch", "position", "joined", "left", "reset")

    def __init__(self, owner: int, epoch: int, position: int = -1, reset: bool = True) -> None:
        self.owner, self.epoch, self.position, self.reset = owner, epoch, position, reset
        self.joined: set[int] = set()
        self.left: set[int] = set()

    def update(self, page: int) -> Update:
        return page, self.owner, self.epoch, self.position, tuple(self.joined), tuple(self.left), self.reset


class IntegrityChecker(PageRecord):
    """Rank 0's record: the block manager's guard, which the manager reports every grant and release to and
    asks, when freeing a table, which pages the sequence really holds. Under tensor parallelism it also keeps
    the updates for the other ranks' records (`take_updates`)."""

    def __init__(self, mode: str, block_manager: BlockManager, kv_cache: PagedKVCache,
                 sample_pages: int = 0, seed: int = 0, tensor_parallel: int = 1) -> None:
        super().__init__(mode, block_manager.num_pages, kv_cache, sample_pages, seed)
        # weakly: the manager holds this record as its guard, and a cycle between them would keep the KV pool alive
        # until the cyclic collector ran (an engine dropped unclosed kept its 1 GiB pool)
        self.block_manager = weakref.proxy(block_manager)
        self._pending: dict[int, PendingPage] = {}
        self._outbox: list[Update] | None = [] if tensor_parallel > 1 else None
        self._sharing: dict[int, tuple[int, int, set[int]]] = {}    # shared page -> (epoch, position, holders)
        self._shared_by: dict[int, set[int]] = {}               # sequence -> the shared pages it holds
        self._held = [(FREE, 0)] * block_manager.num_pages     # (owner, epoch) of each page, on the host: to vet
                                                                # publishes without reading the device
        self.violations: list[Violation] = []      # found while freeing tables, taken by the engine
        # the step's check runs on the device, in the step (`device_flags`), where Triton runs and on one rank
        # (tensor-parallel ranks check their plans and agree, `agree`); decided once, as the pool's padding page is
        self.on_device = self._outbox is None and use_triton(self.owners)
        block_manager.guard = self

    def detach(self) -> None:
        """The block manager guards no more (a closed engine): it no longer holds this record, nor the KV pool."""
        try:
            if self.block_manager.guard is self:
                self.block_manager.guard = None
        except ReferenceError:          # the manager is gone already
            pass

    # The block manager's guard protocol: grants and releases are queued and reach the device in one write; holder
    # changes as who joined and who left, so that a step costs what changed in it, not what is shared.
    def granted(self, seq_id: int, page: int, epoch: int) -> None:
        if self._drop_sharing(page):
            # a shared page others still hold, handed out again (a double allocation): its holders fail their next
            # check, and its cached copy leaves the cache now, before a new request's hit could read what the
            # second owner writes into it
            self.block_manager.quarantine([page])
        self._pending[page] = PendingPage(seq_id, epoch)
        self._held[page] = (seq_id, epoch)

    def shared(self, seq_id: int, page: int, epoch: int, position: int) -> None:
        held_at, at, holders = self._sharing.get(page, (epoch, position, set()))
        pending = self._pending.get(page)
        if (held_at, at) != (epoch, position) or page not in self._sharing:     # a new sharing of the page
            holders = set()
            pending = self._pending[page] = PendingPage(SHARED, epoch, position)
        elif pending is None or pending.owner != SHARED:
            pending = self._pending[page] = PendingPage(SHARED, epoch, position, reset=False)
        holders.add(seq_id)
        pending.joined.add(seq_id)
        pending.left.discard(seq_id)
        self._sharing[page] = (epoch, position, holders)
        self._shared_by.setdefault(seq_id, set()).add(page)
        self._held[page] = (SHARED, epoch)

    def unshared(self, seq_id: int, page: int) -> None:
        epoch, position, holders = self._sharing[page]
        holders.discard(seq_id)
        self._unlink(seq_id, page)
        pending = self._pending.get(page)
        if pending is None or pending.owner != SHARED:
            pending = self._pending[page] = PendingPage(SHARED, epoch, position, reset=False)
        if seq_id in pending.joined:
            pending.joined.discard(seq_id)
        else:
            pending.left.add(seq_id)

    def released(self, page: int, epoch: int) -> None:
        holders = self._drop_sharing(page)
        if len(holders) > 1:        # the last holder releases a shared page; several holders: a bug freed it
            self.violations += [Violation(seq_id, "freed_held", page) for seq_id in sorted(holders)]
        self._pending[page] = PendingPage(FREE, epoch)
        self._held[page] = (FREE, epoch)

    def _drop_sharing(self, page: int) -> set[int]:
        _, _, holders = self._sharing.pop(page, (0, 0, set()))
        for seq_id in holders:
            self._unlink(seq_id, page)
        return holders

    def _unlink(self, seq_id: int, page: int) -> None:
        pages = self._shared_by.get(seq_id)
        if pages is not None:
            pages.discard(page)
            if not pages:
                del self._shared_by[seq_id]

    def _flush(self) -> None:
        if not self._pending:
            return
        updates = [pending.update(page) for page, pending in self._pending.items()]
        self.apply(updates)
        if self._outbox is not None:
            self._outbox.extend(updates)
        self._pending.clear()

    def take_updates(self) -> list[Update]:
        """The record's changes since the last call, in order, for the other ranks' records."""
        self._flush()
        if self._outbox is None:
            return []
        updates, self._outbox = self._outbox, []
        return updates

    def vet(self, pages: list[int]) -> int:
        """Before a cache hit hands published pages to a new holder: in `full` mode, how many of them, from the
        first, still match their checksums (a corrupted page is refused, not read); otherwise all."""
        if not self.full:
            return len(pages)
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        bad = self.sealed[index] & (page_checksums(self.kv_cache, index, self.weights) != self.checksums[index])
        return int(torch.nonzero(bad).flatten()[0]) if bool(bad.any()) else len(pages)

    def publishable(self, seq_id: int, page: int, lease: int) -> bool:
        """Whether the sequence holds the page alone at its lease; if not, its table is corrupt (a foreign, freed or
        out-of-range entry, which a preemption would otherwise publish before the next check): a violation."""
        if 0 <= page < self.num_pages and self._held[page] == (seq_id, lease):
            return True
        owner, epoch = self._held[page] if 0 <= page < self.num_pages else (None, None)
        self.violations.append(Violation(seq_id, "ownership", page, seq_id, owner, lease, epoch))
        return False

    def audit(self, seq_id: int, pages: list[int], leases: list[int]) -> tuple[list[int], list[int]]:
        """Of a table being freed: the pages the sequence really holds, and the entries that fail."""
        self._flush()
        bad = self._failing(self._entries([(seq_id, pages, leases)]))
        suspects = [pages[i] for i in bad]
        for i in bad:
            self.violations.append(self._ownership_violation(seq_id, pages[i], leases[i]))
        return self.owned_by(seq_id), suspects

    def ownership(self) -> tuple[list[int], list[int]]:
        """(owner, epoch) of every page as the device holds them; for tests and debugging."""
        self._flush()
        return self.owners.tolist(), self.epochs.tolist()

    def owned_by(self, seq_id: int) -> list[int]:
        """The pages the record says the sequence holds: its own, and the shared ones it holds."""
        self._flush()
        return torch.nonzero(self.owners == seq_id).flatten().tolist() + sorted(self._shared_by.get(seq_id, ()))

    def take_violations(self) -> list[Violation]:
        """The violations found off the step's check (each once: a refused publish and the audit of the same table
        find the same entry)."""
        found, self.violations = self.violations, []
        return list(dict.fromkeys(found))

    def holders(self) -> list[int]:
        self._flush()
        return super().holders()


    def flush(self) -> None:
        """Writes the queued grants and releases to the device record (before a step the device checks)."""
        self._flush()

    def device_flags(self, step: StepCheck, pad_slot: int) -> torch.Tensor:
        """The step's check on the device, in its stream, reading nothing back: one int32 flag per item (0, or the
        worst violation's kind code) and a flagged item's slots redirected to `pad_slot`, so that its writes touch
        nobody's page. In `full` mode also the checksums of the sealed pages the step reads and the FP8 scales."""
        from engine.kernels.step_integrity import step_integrity_flags

        flags = step_integrity_flags(step.tables, step.leases, step.entry_counts, step.seq_ids, step.row_starts,
                                     step.row_counts, step.slots, self.owners, self.epochs, self.positions,
                                     self._holder_keys, self.sealed if self.full else None,
                                     self.block_manager.page_size, pad_slot)
        return torch.maximum(flags, self._content_flags(step)) if self.full else flags

    def _content_flags(self, step: StepCheck) -> torch.Tensor:
        """`full` mode on the device: each item's sealed entries (all, or `sample_pages` of the step's entries drawn
        on the device) against their checksums, and the FP8 scales against their trusted copy."""
        items, width = step.tables.shape
        valid = torch.arange(width, device=self.device)[None, :] < step.entry_counts[:, None]
        in_range = (step.tables >= 0) & (step.tables < self.num_pages)
        pages = torch.where(in_range, step.tables, 0).flatten()
        candidates = (valid & in_range).flatten() & self.sealed[pages]
        entry = torch.arange(items * width, device=self.device)
        if self.sample_pages and self.sample_pages < items * width:
            entry = torch.randint(items * width, (self.sample_pages,), generator=self._generator, device=self.device)
        checked = pages[entry]
        failed = candidates[entry] & (page_checksums(self.kv_cache, checked, self.weights) != self.checksums[checked])
        flags = torch.zeros(items, dtype=torch.int32, device=self.device)
        flags.scatter_reduce_(0, entry // max(width, 1), failed.to(torch.int32) * KIND_CODES["checksum"], "amax")
        if self.kv_cache.is_fp8:
            changed = torch.stack([(scale != trusted).any()
                                   for scale, trusted in zip(self.kv_cache.scales, self._trusted_scales)]).any()
            flags = torch.maximum(flags, changed.to(torch.int32) * KIND_CODES["fp8_scale"])
        return flags

    def check(self, items: list[ScheduledSequence]) -> list[Violation]:
        """Checks the step's block tables, as its items carry them (and in `full` mode their sealed pages), before
        the step runs, and the pages it writes into."""
        self._flush()
        page_size = self.block_manager.page_size
        tables = [(item.seq.seq_id, item.block_table, item.leases) for item in items]
        writes = [(item.seq.seq_id, page) for item in items
                  for page in pages_written(item.block_table, item.start, item.end, page_size)]
        return self.check_tables(tables, writes)

    def seal(self, items: list[ScheduledSequence]) -> None:
        """After a step's KV writes: seals the pages that became full in it."""
        if not self.full:
            return
        self._flush()
        page_size = self.block_manager.page_size
        self.seal_pages([page for item in items
                         for page in pages_filled(item.block_table, item.start, item.end, page_size)])


def agree(group: TensorGroup, plan: StepPlan, found: list[Violation]) -> dict[int, Violation]:
    """What every rank found wrong with the plan's items, known to every rank, by item.

    One small all-reduce (max) of a [3, items + 1] table: per item the worst kind found, the failing page
    + 1 (checksums: rank 0 quarantines it) and the rank; the last column says a rank's FP8 scales were
    corrupted, which concerns every item. Every rank then drops the same items (`StepPlan.without`).
    """
    table = torch.zeros(3, plan.num_items + 1, dtype=torch.int64)
    item_of = {seq_id: item for item, seq_id in enumerate(plan.seq_ids)}
    for violation in found:
        column = plan.num_items if violation.kind == "fp8_scale" else item_of[violation.seq_id]
        page = violation.page + 1 if violation.kind == "checksum" else 0
        table[:, column] = torch.maximum(table[:, column],
                                         torch.tensor([KIND_CODES[violation.kind], page, group.rank]))
    table = group.max_over_ranks(table).cpu()
    if table[0, -1]:
        rank = int(table[2, -1])
        return {item: Violation(seq_id, "fp8_scale", None, rank=rank) for item, seq_id in enumerate(plan.seq_ids)}
    agreed = {}
    for item in torch.nonzero(table[0, :-1]).flatten().tolist():
        code, page, rank = table[:, item].tolist()
        agreed[item] = Violation(plan.seq_ids[item], KINDS[code], page - 1 if page else None, rank=rank)
    return agreed
