"""KV-cache integrity: exact bookkeeping on a tiny pool, then fault campaigns on the real model (cut in depth)."""
from __future__ import annotations

import random

import pytest
import torch
from campaign import assert_campaign_detects
from conftest import engine_cli
from kernel_cases import step_integrity_case

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.errors import ConfigError
from engine.core.memory import KVLayout
from engine.core.scheduler import ScheduledSequence
from engine.core.sequence import FinishReason, SamplingParams, Sequence
from engine.executor.integrity import KIND_CODES, IntegrityChecker, PageRecord, page_checksums
from engine.harness.fault_campaign import DETECTED_IN, FAULT_KINDS, PAGE_FAULTS, SHARING_FAULTS, run_trial
from engine.kernels import reference
from engine.llm import LLM
from engine.model.kv_cache import PagedKVCache

TRIALS = 2


def tiny_pool(mode: str, kv_dtype: str = "fp32", num_pages: int = 8, prefix_caching: bool = False):
    manager = BlockManager(num_pages, page_size=4, enable_prefix_caching=prefix_caching)
    cache = PagedKVCache(KVLayout(2, kv_dtype, num_kv_heads=2, head_dim=8), num_pages, 4, "cpu")
    return manager, cache, IntegrityChecker(mode, manager, cache)


def scheduled(manager: BlockManager, seq_id: int, tokens: int) -> ScheduledSequence:
    """The sequence's whole prompt as a step would schedule it, with its table as the manager has it now."""
    return ScheduledSequence(Sequence([1] * tokens, SamplingParams(), seq_id=seq_id), 0, tokens).take_tables(manager)


def test_ownership_table_follows_grants_and_frees():
    manager, _, checker = tiny_pool("ownership")
    manager.allocate(1, 6)              # pages 0, 1
    manager.allocate(2, 3)              # page 2
    assert checker.owned_by(1) == [0, 1] and checker.owned_by(2) == [2]
    assert checker.check([scheduled(manager, 1, 6), scheduled(manager, 2, 3)]) == []
    manager.free(1)
    owners, epochs = checker.ownership()
    assert owners[:3] == [-1, -1, 2]
    assert epochs[:3] == [1, 1, 0]      # a free bumps the epoch
    manager.check_invariants()


def test_stale_table_and_foreign_page_are_caught_with_owner_and_epoch():
    manager, _, checker = tiny_pool("ownership")
    manager.allocate(1, 8)              # pages 0, 1
    manager.allocate(2, 4)              # page 2
    manager.fault_release(1)            # page 1 freed behind seq 1's back: epoch 0 -> 1
    manager.fault_table(2)[0] = 0       # seq 2's table names seq 1's page 0
    found = {(v.seq_id, v.page): v for v in checker.check([scheduled(manager, 1, 8), scheduled(manager, 2, 4)])}
    assert set(found) == {(1, 1), (2, 0)}
    assert (found[1, 1].found_owner, found[1, 1].found_epoch, found[1, 1].expected_epoch) == (-1, 1, 0)
    assert (found[2, 0].expected_owner, found[2, 0].found_owner) == (2, 1)
    assert "page 0 expected owner 2" in found[2, 0].describe()


def test_freeing_a_bad_table_releases_true_pages_and_quarantines_the_rest():
    manager, _, checker = tiny_pool("ownership")
    manager.allocate(1, 8)              # pages 0, 1
    manager.allocate(2, 4)              # page 2
    manager.fault_table(1)[1] = 2       # seq 1 names seq 2's page; its own page 1 is orphaned
    manager.free(1)
    assert manager.quarantined == {2}
    assert [v.page for v in checker.take_violations()] == [2]
    assert manager.ref_count(1) == 0 and manager.ref_count(0) == 0       # the orphan came back too
    manager.free(2)
    assert 2 not in manager._free and manager.num_free_pages == manager.num_pages - 1
    manager.check_invariants()


@pytest.mark.parametrize(("fault", "bad_page"), [("foreign_page", 0), ("double_allocation", 2),
                                               ("use_after_free", 2), ("page_out_of_range", -3)])
def test_a_corrupt_table_preempted_before_its_check_publishes_nothing(fault, bad_page):
    """A preemption publishes a table's full pages, then frees it: a victim preempted between its fault and its
    next check must not publish the bad entry (its true holder then failed its own check, harmed: the soak caught
    it once in ~10 runs; a cache hit would read another request's page; an out-of-range page would stand for
    another in the record). The victim is reported once, the bystander passes."""
    manager, _, checker = tiny_pool("ownership", prefix_caching=True)
    manager.allocate(1, 8)              # pages 0, 1: the bystander
    manager.allocate(2, 8)              # pages 2, 3: the victim
    if fault == "double_allocation":
        manager.fault_grant(1, 2)       # the victim's page handed to the bystander as well
    elif fault == "use_after_free":
        manager.fault_release(2)
    else:
        manager.fault_table(2)[0] = bad_page
    manager.publish(2, [bytes([1]) * 32, bytes([2]) * 32], [b"first", b"second"], 2)
    manager.free(2)
    assert manager.published_hashes() == {}
    assert checker.check([scheduled(manager, 1, 8)]) == []
    assert [(v.seq_id, v.kind, v.page) for v in checker.take_violations()] == [(2, "ownership", bad_page)]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8"])
def test_checksum_changes_with_any_single_bit(kv_dtype):
    manager, cache, checker = tiny_pool("full", kv_dtype)
    generator = torch.Generator().manual_seed(3)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator).to(cache.keys.dtype))
    pages = torch.arange(manager.num_pages)
    before = page_checksums(cache, pages, checker.weights)
    raw = cache.values.view(torch.uint8)
    for trial in range(20):
        layer, page = trial % 2, trial % manager.num_pages
        flat = raw[layer, page].view(-1)
        index, bit = (trial * 37) % flat.numel(), trial % 8
        flat[index] ^= 1 << bit
        after = page_checksums(cache, pages, checker.weights)
        assert (after != before).tolist() == [p == page for p in range(manager.num_pages)]
        flat[index] ^= 1 << bit
    assert torch.equal(page_checksums(cache, pages, checker.weights), before)


def test_bad_integrity_mode_is_rejected():
    with pytest.raises(ConfigError, match="unknown integrity mode 'paranoid'"):
        EngineConfig(integrity="paranoid")


def test_a_request_the_quarantine_outgrew_ends_and_the_others_are_served():
    """Quarantined pages never come back, so a request accepted into a pool of 8 pages can outgrow the 6 left: it
    preempts itself and waits for pages that cannot come. It ends (abort) instead of stalling the engine, the request
    beside it keeps its greedy tokens, and a new request of its size is refused, naming the quarantine."""
    from engine.core.errors import RequestError

    with LLM(model="smollm2-135m", num_layers=2, device="cpu", page_size=8, num_pages=8,
             integrity="ownership") as llm:
        small, large = list(range(400, 405)), list(range(500, 520))
        alone = llm.generate([small], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
        ids = [llm.add_request(small, SamplingParams(max_tokens=4, ignore_eos=True)),
               llm.add_request(large, SamplingParams(max_tokens=30, ignore_eos=True))]
        llm.core.block_manager.quarantine([6, 7])        # as two violations would: 48 usable token slots for 50
        ended = {}
        for _ in range(100):
            ended.update((result.request_id, result) for result in llm.step())
            if not llm.has_unfinished():
                break
        assert not llm.has_unfinished()
        assert (ended[ids[0]].finish_reason, ended[ids[0]].token_ids) == ("length", alone)
        assert ended[ids[1]].finish_reason == "abort" and 0 < len(ended[ids[1]].token_ids) < 30
        with pytest.raises(RequestError, match=r"50 tokens exceeds the KV pool of 48 tokens \(2 pages quarantined\)"):
            llm.add_request(large, SamplingParams(max_tokens=30))


@pytest.fixture(scope="module")
def workload(english_prompts):
    """16 mixed requests: prompts of 3..130 tokens, 4..11 new tokens each."""
    rng = random.Random(7)
    return english_prompts, [SamplingParams(max_tokens=rng.randrange(4, 12), ignore_eos=True)
                             for _ in english_prompts]


def campaign_engine(mode: str, kv_dtype: str | None = None, max_num_batched_tokens: int = 2048) -> LLM:
    """SmolLM2's first four layers: a page holds every layer's K/V, and the checks, the faults and the pages are
    the same at any depth; all thirty took 118 s of the suite (bench/integrity.py runs its campaign on them all)."""
    return LLM(model="smollm2-135m", num_layers=4, device="cpu", page_size=8, num_pages=400, integrity=mode,
               kv_dtype=kv_dtype, max_num_batched_tokens=max_num_batched_tokens)


def test_ownership_mode_catches_every_bookkeeping_fault(workload):
    llm = campaign_engine("ownership")
    assert_campaign_detects(llm, workload, PAGE_FAULTS[:4], TRIALS, seed=1)
    assert 0 < len(llm.core.block_manager.quarantined) <= 3 * TRIALS      # out-of-range pages quarantine nothing


def test_full_mode_also_catches_memory_corruption(workload):
    llm = campaign_engine("full", kv_dtype="fp8")
    assert_campaign_detects(llm, workload, PAGE_FAULTS, TRIALS, seed=2)
    assert all("full" in DETECTED_IN[kind] for kind in FAULT_KINDS)


def test_ownership_mode_does_not_claim_to_catch_bit_flips(workload):
    """The modes cover what they say and no more: a flipped bit passes the ownership check."""
    prompts, params = workload
    llm = campaign_engine("ownership")
    reference = [r.token_ids for r in llm.generate(prompts, params)]
    result = run_trial(llm, prompts, params, reference, "bit_flip", random.Random(3))
    assert result.fault is not None and not result.detected and "ownership" not in DETECTED_IN["bit_flip"]


def test_off_mode_keeps_checks_off_the_hot_path(workload, monkeypatch):
    def forbidden(*_args, **_kwargs):
        raise AssertionError("an integrity check ran in mode off")

    for name in ("check", "seal", "audit", "granted", "released"):
        monkeypatch.setattr(IntegrityChecker, name, forbidden)
    llm = campaign_engine("off")
    assert llm.core.integrity is None and llm.core.block_manager.guard is None
    outputs = llm.generate(*workload)
    assert all(r.finish_reason == FinishReason.LENGTH.value for r in outputs)


def test_breaking_the_ownership_update_breaks_detection(workload, monkeypatch):
    """The checks cannot pass vacuously: a block manager that stops reporting frees lets faults through."""
    release = BlockManager._release

    def release_silently(self, pages, seq_id):
        guard, self.guard = self.guard, None
        try:
            release(self, pages, seq_id)
        finally:
            self.guard = guard

    monkeypatch.setattr(BlockManager, "_release", release_silently)
    llm = campaign_engine("ownership")
    with pytest.raises(AssertionError, match="not detected"):
        assert_campaign_detects(llm, workload, ["use_after_free"], 1, seed=4)


def test_cli_generate_takes_integrity_mode():
    result = engine_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "4",
                        "--integrity", "full", "--json")
    assert result.returncode == 0, result.stderr
    assert '"completion_tokens": 4' in result.stdout
    bad = engine_cli("generate", "--prompt", "x", "--integrity", "paranoid")
    assert bad.returncode == 2 and "paranoid" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def shared_workload(english_prompts):
    """8 requests opening with the same 20-token system prompt (2 full pages of 8 shared), then their own."""
    system = list(range(300, 320))
    rng = random.Random(11)
    prompts = [system + prompt for prompt in english_prompts[:8]]
    return prompts, [SamplingParams(max_tokens=rng.randrange(6, 12), ignore_eos=True) for _ in prompts]


@pytest.mark.parametrize("mode", ["ownership", "full"])
def test_the_campaign_with_shared_pages(shared_workload, mode):
    """Every fault, classic or of sharing, on requests that share cached pages: all detected, no one else
    harmed, no page leaked. A small token budget admits the requests over several steps, so that the later ones
    find the earlier ones' pages published in every trial (pages a fault touched are quarantined, not reused)."""
    llm = campaign_engine(mode, max_num_batched_tokens=48)
    kinds = SHARING_FAULTS + (PAGE_FAULTS[:4] if mode == "ownership" else ("bit_flip",))
    assert_campaign_detects(llm, shared_workload, kinds, TRIALS, seed=5)
    llm.core.block_manager.check_invariants()


def test_the_record_of_shared_pages_follows_the_allocator(shared_workload):
    """Step by step: every published page the record calls shared has exactly the holders whose tables name it,
    and its device keys are those holders' (kept by what joined and left, never rebuilt)."""
    from engine.executor.integrity import HOLDER_SHIFT, SHARED

    llm = campaign_engine("ownership", max_num_batched_tokens=48)
    prompts, params = shared_workload
    for prompt, request_params in zip(prompts, params):
        llm.add_request(prompt, request_params)
    shared_seen = 0
    while llm.has_unfinished():
        llm.step()
        record, manager = llm.core.integrity, llm.core.block_manager
        owners, _ = record.ownership()
        tables = {seq.seq_id: manager.block_table(seq.seq_id) for seq in llm.core.scheduler.running}
        for page, holders in record.shared_holders.items():
            assert owners[page] == SHARED and manager.is_published(page)
            assert holders == {seq_id for seq_id, table in tables.items() if page in table}, page
            shared_seen += len(holders) > 1
        keys = sorted(record._holder_keys.tolist())
        assert keys == sorted((page << HOLDER_SHIFT) + holder for page, holders in record.shared_holders.items()
                              for holder in holders)
    assert shared_seen > 0


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_device_check_flags_exactly_what_the_host_check_finds(seed, full):
    """`step_integrity_flags` (the device check: one flag per request, the worst kind) against `PageRecord`'s host
    check of the same tables and writes, on random records with shared pages and corrupted entries."""
    case, updates, sealed = step_integrity_case(9, 60, 12, 4, "cpu", seed, full)
    cache = PagedKVCache(KVLayout(1, "fp32", num_kv_heads=1, head_dim=2), 60, 4, "cpu")
    record = PageRecord("full" if full else "ownership", 60, cache)
    record.apply(updates)
    if full:
        record.sealed[sealed] = True
    seq_ids, counts = case["seq_ids"].tolist(), case["entry_counts"].tolist()
    tables = [(seq_id, table[:count], leases[:count]) for seq_id, table, leases, count in
              zip(seq_ids, case["tables"].tolist(), case["leases"].tolist(), counts)]
    slots = case["slots"].tolist()
    writes = [(seq_id, slots[row] // 4) for seq_id, start, rows in
              zip(seq_ids, case["row_starts"].tolist(), case["row_counts"].tolist()) for row in range(start, start + rows)]
    expected = dict.fromkeys(seq_ids, 0)
    for violation in record.check_tables(tables, writes):
        expected[violation.seq_id] = max(expected[violation.seq_id], KIND_CODES[violation.kind])
    flags = reference.step_integrity_flags(**case)
    assert flags.tolist() == [expected[seq_id] for seq_id in seq_ids]
    assert {0, KIND_CODES["ownership"], KIND_CODES["shared_write"]} >= set(flags.tolist()) and any(flags.tolist())
