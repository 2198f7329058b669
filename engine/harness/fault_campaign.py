"""Fault injection for the integrity tests and benchmark: the bugs and corruptions the checks must catch.

Each fault strikes a live engine between two steps the way a real defect would: a bug in the page
bookkeeping (the block manager's tables, not the integrity record beside them) or corrupted memory.

    use_after_free      a page is freed while a request's table still names it
    foreign_page        a table entry points at a page of another live request
    double_allocation   the allocator hands a page that a request holds to a second one
    page_out_of_range   a table entry names a page that does not exist
    bit_flip            one bit of a sealed (full) page's K or V bytes flips
    fp8_scale           an FP8 KV scale is overwritten (every page of its layer then reads wrong)
    shared_write        the page a request is still writing into is published (a bug in telling a full page)
    hash_collision      a published hash points at another page (a collision, or a corrupted index); a request
                        with that prefix then arrives, and must compute it rather than read the wrong page
    freed_held          a page several requests share is freed (a reference-count bug)

A fault on a shared page concerns every request holding it: they are all its victims.

Under tensor parallelism a fault can strike a worker rank instead (`inject(..., rank=r)`): rank 0 picks the
victim and sends a `WorkerFault` with the next plan, and the worker `strike`s its own state: its record of
page owners (use_after_free, double_allocation), its copy of the plan's tables (foreign_page,
page_out_of_range), its shard of the KV pool (bit_flip) or its scales (fp8_scale).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.core.sequence import FinishReason, SamplingParams, Sequence
from engine.executor.step_plan import WorkerFault
from engine.llm import LLM

PAGE_FAULTS = ("use_after_free", "foreign_page", "double_allocation", "page_out_of_range", "bit_flip", "fp8_scale")
SHARING_FAULTS = ("shared_write", "hash_collision", "freed_held")
FAULT_KINDS = PAGE_FAULTS + SHARING_FAULTS
OWNERSHIP_FAULTS = PAGE_FAULTS[:4] + SHARING_FAULTS
WORKER_FAULTS = PAGE_FAULTS         # a worker rank's own state: its record, its plan's tables, its pool
DETECTED_IN = {kind: ("ownership", "full") if kind in OWNERSHIP_FAULTS else ("full",) for kind in FAULT_KINDS}


@dataclass(frozen=True)
class Fault:
    kind: str
    victims: tuple[int, ...]            # the requests whose context the fault corrupts
    page: int | None
    tokens_at_fault: dict[int, int]     # output tokens each victim had when the fault struck
    probe: tuple[int, int] | None = None    # hash_collision: (the request sent after it, the one whose prompt it is)


def _holders(llm: LLM) -> list[Sequence]:
    return [seq for seq in llm.core.scheduler.running if llm.core.block_manager.num_slots(seq.seq_id)]


def _full_pages(llm: LLM, seq: Sequence) -> list[int]:
    manager = llm.core.block_manager
    return manager.block_table(seq.seq_id)[:seq.num_computed_tokens // manager.page_size]


def _holding(llm: LLM, page: int) -> list[Sequence]:
    """The running requests whose tables name the page."""
    return [seq for seq in _holders(llm) if page in llm.core.block_manager.block_table(seq.seq_id)]


def _inject_sharing(llm: LLM, kind: str, rng: random.Random, holders: list[Sequence]) -> Fault | None:
    manager = llm.core.block_manager
    if kind == "shared_write":
        writing = [seq for seq in holders if manager.num_slots(seq.seq_id) % manager.page_size]
        if not writing:
            return None
        victim = rng.choice(writing)
        return _fault(kind, [victim], manager.fault_publish(victim.seq_id))
    if kind == "freed_held":
        shared = sorted({page for seq in holders for page in manager.block_table(seq.seq_id)
                         if manager.ref_count(page) > 1 and manager.is_published(page)})
        if not shared:
            return None
        page = rng.choice(shared)
        victims = _holding(llm, page)
        manager.fault_release(page)
        return _fault(kind, victims, page)
    published = manager.published_hashes()
    cached = [seq for seq in holders if seq.page_hashes and published.get(seq.page_hashes[0]) is not None]
    if not cached or len(set(published.values())) < 2:
        return None
    source = rng.choice(cached)
    target = rng.choice(sorted(set(published.values()) - {published[source.page_hashes[0]]}))
    manager.fault_collide(source.page_hashes[0], target)
    probe = llm.add_request(source.prompt_token_ids, source.params, source.cache_salt)
    return Fault(kind, (), target, {}, (probe, source.seq_id))


def inject(llm: LLM, kind: str, rng: random.Random, rank: int = 0) -> Fault | None:
    """Injects one fault of `kind` into requests chosen by `rng`, on rank 0's state or on worker `rank`'s;
    None when none can take it now."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r} (choose from {', '.join(FAULT_KINDS)})")
    if rank:
        if kind not in WORKER_FAULTS:
            raise ValueError(f"fault {kind!r} strikes rank 0's allocator; a worker rank takes "
                             f"{', '.join(WORKER_FAULTS)}")
        return _inject_on_worker(llm, kind, rng, rank)
    manager = llm.core.block_manager
    holders = _holders(llm)
    if kind in SHARING_FAULTS:
        return _inject_sharing(llm, kind, rng, holders)
    if kind == "fp8_scale":
        if not llm.core.kv_cache.is_fp8 or not holders:
            return None
        scales = llm.core.kv_cache.scales[0]
        scales[rng.randrange(scales.shape[0]), rng.randrange(scales.shape[1])] *= 2.0
        return _fault(kind, holders, None)
    if kind == "bit_flip":
        sealed = [seq for seq in holders if _full_pages(llm, seq)]
        if not sealed:
            return None
        victim = rng.choice(sealed)
        page = rng.choice(_full_pages(llm, victim))
        pool = rng.choice(llm.core.kv_cache.pools)
        page_bytes = pool.view(torch.uint8)[rng.randrange(pool.shape[0]), page].view(-1)
        page_bytes[rng.randrange(page_bytes.numel())] ^= 1 << rng.randrange(8)
        return _fault(kind, _holding(llm, page), page)
    needs_two = kind in ("foreign_page", "double_allocation")
    if not holders or (needs_two and len(holders) < 2):
        return None
    victim = rng.choice(holders)
    table = manager.fault_table(victim.seq_id)
    index = rng.randrange(len(table))
    if kind == "use_after_free":
        page = table[index]
        victims = _holding(llm, page)
        manager.fault_release(page)
        return _fault(kind, victims, page)
    if kind == "page_out_of_range":
        page = rng.choice((-1 - rng.randrange(manager.num_pages), manager.num_pages + rng.randrange(manager.num_pages)))
        table[index] = page
        return _fault(kind, [victim], page)
    others = [seq for seq in holders if seq is not victim]
    if kind == "foreign_page":      # a page of another request that the victim does not hold (shared ones it may)
        pages = sorted({page for seq in others for page in manager.block_table(seq.seq_id)} - set(table))
        if not pages:
            return None
        page = table[index] = rng.choice(pages)
        return _fault(kind, [victim], page)
    page = table[index]
    others = [seq for seq in others if page not in manager.block_table(seq.seq_id)]
    if not others:
        return None
    victims = _holding(llm, page)
    manager.fault_grant(rng.choice(others).seq_id, page)
    return _fault(kind, victims, page)


def _inject_on_worker(llm: LLM, kind: str, rng: random.Random, rank: int) -> Fault | None:
    _check_worker_rank(llm, rank)
    holders = _holders(llm)
    seed = rng.randrange(1 << 31)
    if kind == "fp8_scale":
        if not llm.core.kv_cache.is_fp8 or not holders:
            return None
        llm.core.executor.worker_fault = WorkerFault(rank, kind, -1, -1, seed)
        return _fault(kind, holders, None)
    candidates = [seq for seq in holders if _full_pages(llm, seq)] if kind == "bit_flip" else holders
    if not candidates or (kind in ("foreign_page", "double_allocation") and len(holders) < 2):
        return None
    victim = rng.choice(candidates)
    table = llm.core.block_manager.block_table(victim.seq_id)
    page = rng.choice(_full_pages(llm, victim) if kind == "bit_flip" else table)
    others = [seq for seq in holders if seq is not victim]
    num_pages = llm.core.block_manager.num_pages
    if kind == "foreign_page":
        value = rng.choice(llm.core.block_manager.block_table(rng.choice(others).seq_id))
    elif kind == "double_allocation":
        value = rng.choice(others).seq_id
    elif kind == "page_out_of_range":
        value = rng.choice((-1 - rng.randrange(num_pages), num_pages + rng.randrange(num_pages)))
    else:
        value = seed
    llm.core.executor.worker_fault = WorkerFault(rank, kind, victim.seq_id, page, value)
    return _fault(kind, [victim], page)


def _check_worker_rank(llm: LLM, rank: int) -> None:
    size = llm.config.tensor_parallel
    if not 0 < rank < size:
        raise ValueError(f"worker rank must be in 1..{size - 1}, got {rank!r}")


def _fault(kind: str, victims: list[Sequence], page: int | None) -> Fault:
    return Fault(kind, tuple(seq.seq_id for seq in victims), page,
                 {seq.seq_id: len(seq.output_token_ids) for seq in victims})


@dataclass(frozen=True)
class TrialResult:
    fault: Fault | None         # None when no moment of the run could take the fault
    detected: bool              # every victim ended with `integrity_error` (hash_collision: the hit was refused
                                # and the probe computed its prompt itself, getting the tokens it gets alone)
    victims_clean: bool         # no victim received a token produced after the fault
    harmed: int                 # other requests whose tokens differ from the fault-free run
    leaked_pages: int           # pages neither free nor quarantined once every request ended


def run_trial(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], reference: list[list[int]],
              kind: str, rng: random.Random, earliest_step: int = 1, rank: int = 0) -> TrialResult:
    """Runs the requests to completion with one fault injected after a random step (on `rank`'s state);
    compares with `reference`."""
    ids = [llm.add_request(prompt, request_params) for prompt, request_params in zip(prompts, params)]
    outputs: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    fault, step = None, 0
    detections = llm.stats().integrity_detections
    strike_at = earliest_step + rng.randrange(4)
    while llm.has_unfinished():
        for result in llm.step():
            outputs[result.request_id], finish[result.request_id] = result.token_ids, result.finish_reason
        step += 1
        if fault is None and step >= strike_at and llm.has_unfinished():
            fault = inject(llm, kind, rng, rank)
    manager = llm.core.block_manager
    leaked = manager.num_pages - manager.num_free_pages - len(manager.quarantined)
    if fault is None:
        return TrialResult(None, False, True, 0, leaked)
    victims = set(fault.victims)
    detected = all(finish[seq_id] == FinishReason.INTEGRITY_ERROR.value for seq_id in victims)
    if fault.probe is not None:
        probe, source = fault.probe
        detected = llm.stats().integrity_detections > detections and outputs[probe] == reference[ids.index(source)]
    clean = all(len(outputs[seq_id]) <= fault.tokens_at_fault[seq_id] for seq_id in victims)
    harmed = sum(1 for seq_id, expected in zip(ids, reference)
                 if seq_id not in victims and outputs[seq_id] != expected)
    return TrialResult(fault, detected, clean, harmed, leaked)


def crash_worker(llm: LLM, rank: int) -> None:
    """Makes tensor-parallel worker `rank` raise in the next step, as a bug or a lost device would: the engine
    must end with that worker's error, not hang."""
    _check_worker_rank(llm, rank)
    llm.core.executor.fail_rank = rank
