"""Prefix caching: page names, the allocator's sharing and eviction, the scheduler's admission from the first
uncached token, and greedy identity with and without it on SmolLM2 (multi-turn, chunked, preempted)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.errors import RequestError
from engine.core.prefix_cache import chain_hash, page_key, root_hash
from engine.core.scheduler import Scheduler
from engine.core.sequence import SamplingParams, Sequence
from engine.llm import LLM


def test_page_names_chain_tokens_and_salt():
    tokens = list(range(40))
    seq = Sequence(tokens, SamplingParams())
    hashes, keys = seq.page_names(2, 16)
    assert hashes[0] == chain_hash(root_hash(None), page_key(tokens[:16]))
    assert hashes[1] == chain_hash(hashes[0], page_key(tokens[16:32]))
    assert len(hashes[0]) == 32                                      # SHA-256, not a 64-bit hash
    other = Sequence(tokens[:16] + [99] + tokens[17:], SamplingParams())
    assert other.page_names(2, 16)[0][0] == hashes[0] and other.page_names(2, 16)[0][1] != hashes[1]
    salted = Sequence(tokens, SamplingParams(), cache_salt="tenant-a")
    assert salted.page_names(1, 16)[0][0] != hashes[0]
    with pytest.raises(RequestError, match="cache_salt"):
        Sequence(tokens, SamplingParams(), cache_salt="")


def _publish_all(manager: BlockManager, seq: Sequence, page_size: int) -> None:
    full = seq.num_tokens // page_size
    manager.publish(seq.seq_id, *seq.page_names(full, page_size), full)


def test_hits_share_pages_and_freed_pages_stay_cached_until_evicted():
    page_size = 4
    manager = BlockManager(num_pages=6, page_size=page_size, enable_prefix_caching=True)
    first = Sequence(list(range(12)), SamplingParams(), seq_id=1)
    manager.allocate(1, 12)
    _publish_all(manager, first, page_size)
    assert manager.num_cached_pages == 3
    second = Sequence(list(range(8)) + [50, 51, 52, 53, 54], SamplingParams(), seq_id=2)
    count = (second.num_tokens - 1) // page_size
    hit = manager.cached_prefix(*second.page_names(count, page_size), count)
    assert hit == manager.block_table(1)[:2]
    manager.allocate(2, 5, hit)
    assert [manager.ref_count(page) for page in hit] == [2, 2]
    assert manager.num_used_pages == 3 + 2
    manager.free(1)
    assert manager.num_free_pages == 1 + 1                   # the free page and the evictable third page of seq 1
    manager.free(2)
    assert manager.num_free_pages == 6 and manager.num_cached_pages == 3
    manager.check_invariants()
    # a new sequence needing every page evicts the cached ones, the least recently used (a table's tail) first
    manager.allocate(3, 4 * page_size)
    assert manager.evictions == 1 and manager.num_cached_pages == 2
    manager.check_invariants()


def test_a_hit_is_confirmed_against_the_page_tokens():
    page_size = 4
    manager = BlockManager(num_pages=8, page_size=page_size, enable_prefix_caching=True)
    a, b = Sequence(list(range(9)), SamplingParams(), seq_id=1), Sequence(list(range(50, 59)), SamplingParams(), seq_id=2)
    for seq in (a, b):
        manager.allocate(seq.seq_id, seq.num_tokens)
        _publish_all(manager, seq, page_size)
    manager.fault_collide(a.page_hashes[0], manager.block_table(2)[0])       # a's first hash now names b's page
    probe = Sequence(list(range(9)), SamplingParams(), seq_id=3)
    assert manager.cached_prefix(*probe.page_names(2, page_size), 2) == []
    assert [page for page, _ in manager.refused_hits] == [manager.block_table(2)[0]]
    assert manager.cached_prefix(*probe.page_names(2, page_size), 2) == []   # the bad entry is gone
    manager.check_invariants()


def _fake_step(scheduler: Scheduler, memory: dict[int, int], rng: random.Random) -> list[Sequence]:
    """What the model does to the cache, without a model: each computed token's id is written into its slot;
    every token a step reads must be the sequence's own."""
    manager, page_size = scheduler.block_manager, scheduler.block_manager.page_size
    output = scheduler.schedule()
    for item in output.scheduled:
        table = manager.block_table(item.seq.seq_id)
        for position in range(item.start):
            slot = table[position // page_size] * page_size + position % page_size
            assert memory.get(slot) == item.seq.token_ids_between(position, position + 1)[0], \
                f"sequence {item.seq.seq_id} reads a token that is not its own at {position}"
        for position in range(item.start, item.end):
            page = table[position // page_size]
            assert manager.ref_count(page) == 1 and not manager.is_published(page), "a write into a shared page"
            memory[page * page_size + position % page_size] = item.seq.token_ids_between(position, position + 1)[0]
    sampled = {item.seq.seq_id: rng.randrange(3) for item in output.scheduled}
    return scheduler.update(output, sampled)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(6, 40), st.sampled_from([2, 4]), st.integers(4, 32))
def test_sharing_under_random_prompts_aborts_and_preemptions(seed, num_pages, page_size, budget):
    """Random prompts opening with one of three prefixes (and salts), random aborts, a pool small enough to
    preempt and evict: reference counts stay consistent, no page is freed or written while held, every token a
    step reads is the sequence's own, and nothing leaks once every request has ended."""
    rng = random.Random(seed)
    config = SchedulerConfig(num_pages=num_pages, page_size=page_size, max_num_seqs=6, max_num_batched_tokens=budget,
                             max_model_len=4096, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    manager = scheduler.block_manager
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    memory: dict[int, int] = {}
    capacity = num_pages * page_size
    for seq_id in range(14):
        prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        max_tokens = rng.randrange(1, 6)
        if len(prompt) + max_tokens > capacity:
            continue
        scheduler.add(Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), seq_id=seq_id,
                               cache_salt=rng.choice([None, None, "other"])))
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        if rng.random() < 0.05 and scheduler.running:
            scheduler.abort(rng.choice(scheduler.running).seq_id)
        _fake_step(scheduler, memory, rng)
        manager.check_invariants()
    assert not scheduler.has_unfinished()
    assert manager.num_used_pages == 0 and manager.num_free_pages == num_pages
    assert scheduler.prefix_hit_tokens <= scheduler.prefix_queried_tokens


def test_salted_requests_share_only_with_their_salt():
    config = SchedulerConfig(num_pages=32, page_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    prompt = list(range(20))
    for seq_id, salt in enumerate(["a", "a", "b", None]):
        scheduler.add(Sequence(prompt, SamplingParams(max_tokens=2, ignore_eos=True), seq_id=seq_id, cache_salt=salt))
        finished = []
        while scheduler.has_unfinished():
            finished += scheduler.update(scheduler.schedule(), None)
        assert finished[0].num_cached_tokens == (16 if seq_id == 1 else 0), (seq_id, salt)


@pytest.fixture(scope="module")
def conversations(english_prompts):
    """Three conversations of three turns: each turn's prompt is the conversation so far plus a new message."""
    return [[english_prompts[c * 5 + t] for t in range(3)] for c in range(3)]


def _converse(llm: LLM, conversations: list[list[list[int]]], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Runs the conversations' turns interleaved (turn t of every conversation together): each turn's answer
    joins the transcript. Returns every turn's tokens and cached tokens."""
    transcripts = [[] for _ in conversations]
    tokens, cached = [], []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for turn in range(len(conversations[0])):
        prompts = [transcript + conversation[turn] for transcript, conversation in zip(transcripts, conversations)]
        outputs = llm.generate(prompts, params)
        for index, (prompt, output) in enumerate(zip(prompts, outputs)):
            transcripts[index] = prompt + output.token_ids
            tokens.append(output.token_ids)
            cached.append(output.num_cached_tokens)
    return tokens, cached


@pytest.mark.parametrize("num_pages, preempts", [(200, False), (36, True)], ids=["chunked", "preempted"])
def test_greedy_tokens_identical_with_and_without_caching(conversations, num_pages, preempts):
    """Chunked prefill (48 tokens a step) in both; a pool of 36 pages of 8 (the longest turn needs 35) forces preemptions."""
    common = dict(model="smollm2-135m", device="cpu", page_size=8, num_threads=1, num_pages=num_pages,
                  max_num_batched_tokens=48)
    with_cache = LLM(enable_prefix_caching=True, **common)
    without = LLM(enable_prefix_caching=False, **common)
    tokens, cached = _converse(with_cache, conversations, max_tokens=10)
    reference, uncached = _converse(without, conversations, max_tokens=10)
    assert tokens == reference
    assert not any(uncached)
    assert all(count > 0 for count in cached[3:]), cached           # every later turn reuses its transcript
    assert (with_cache.num_preemptions > 0 and without.num_preemptions > 0) == preempts
    assert with_cache.core.block_manager.num_used_pages == 0
    with_cache.core.block_manager.check_invariants()
