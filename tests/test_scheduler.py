"""Continuous batching on tiny specs, with exact batches: torch-free, as the simulator runs it."""
from __future__ import annotations

import sys

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import SamplingParams, Sequence


def make(config: SchedulerConfig) -> Scheduler:
    return Scheduler(config)


def seq(seq_id: int, prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), eos_token_ids=(0,),
                    seq_id=seq_id)


def batch(output):
    return [(s.seq.seq_id, s.start, s.num_new_tokens) for s in output.scheduled]


def run_step(scheduler: Scheduler, token: int = 5):
    output = scheduler.schedule()
    sampled = {s.seq.seq_id: token for s in output.scheduled if s.samples}
    return output, scheduler.update(output, sampled)


def test_scheduler_is_torch_free():
    import subprocess

    code = "import engine.core.scheduler, engine.core.block_manager, engine.core.memory, sys; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_prefill_then_decode_mixed_in_one_step():
    scheduler = make(SchedulerConfig(num_pages=16, page_size=4, max_num_batched_tokens=8))
    scheduler.add(seq(1, 5))
    output, _ = run_step(scheduler)
    assert batch(output) == [(1, 0, 5)]
    scheduler.add(seq(2, 10))
    output, _ = run_step(scheduler)
    assert batch(output) == [(1, 5, 1), (2, 0, 7)]     # decode first, then a chunk of the new prompt
    output, _ = run_step(scheduler)
    assert batch(output) == [(1, 6, 1), (2, 7, 3)]
    assert [s.samples for s in output.scheduled] == [True, True]


def test_no_chunking_waits_for_budget():
    scheduler = make(SchedulerConfig(num_pages=16, page_size=4, max_num_batched_tokens=12,
                                     max_model_len=12, enable_chunked_prefill=False))
    scheduler.add(seq(1, 10))
    scheduler.add(seq(2, 6))
    output, _ = run_step(scheduler)
    assert batch(output) == [(1, 0, 10)]
    output, _ = run_step(scheduler)
    assert batch(output) == [(1, 10, 1), (2, 0, 6)]


def test_max_num_seqs_limits_admission():
    scheduler = make(SchedulerConfig(num_pages=16, page_size=4, max_num_seqs=2))
    for i in range(3):
        scheduler.add(seq(i, 3))
    output, _ = run_step(scheduler)
    assert batch(output) == [(0, 0, 3), (1, 0, 3)]
    assert [s.seq_id for s in scheduler.waiting] == [2]


def test_newest_running_is_preempted_and_requeued_first():
    scheduler = make(SchedulerConfig(num_pages=3, page_size=4))
    scheduler.add(seq(1, 4, max_tokens=6))
    scheduler.add(seq(2, 4, max_tokens=6))
    scheduler.add(seq(3, 4, max_tokens=6))
    output, _ = run_step(scheduler)
    assert batch(output) == [(1, 0, 4), (2, 0, 4), (3, 0, 4)]
    output, _ = run_step(scheduler)              # each needs a 2nd page: only 1 is free → 3 then 2 preempted
    assert batch(output) == [(1, 4, 1)]
    assert [s.seq_id for s in output.preempted] == [3, 2]
    assert [s.seq_id for s in scheduler.waiting] == [2, 3]
    assert scheduler.num_preemptions == 2
    preempted = scheduler.waiting[0]
    assert preempted.num_computed_tokens == 0 and preempted.output_token_ids == [5]
    scheduler.block_manager.check_invariants()


def test_every_request_finishes_exactly_once_under_pressure():
    scheduler = make(SchedulerConfig(num_pages=6, page_size=4, max_num_batched_tokens=10))
    for i in range(8):
        scheduler.add(seq(i, 3 + i % 5, max_tokens=2 + i % 4))
    done = []
    for _ in range(500):
        if not scheduler.has_unfinished():
            break
        output, finished = run_step(scheduler)
        assert scheduler.block_manager.num_used_pages <= 6
        assert output.num_batched_tokens <= 10
        done.extend(s.seq_id for s in finished)
    assert sorted(done) == list(range(8))
    assert scheduler.block_manager.num_free_pages == 6


def test_abort_removes_and_frees():
    scheduler = make(SchedulerConfig(num_pages=4, page_size=4))
    scheduler.add(seq(1, 6))
    scheduler.add(seq(2, 3))
    run_step(scheduler)
    assert scheduler.abort(1).finish_reason.value == "abort"
    assert scheduler.abort(1) is None
    assert scheduler.block_manager.num_used_pages == 1


class OneByOne(BlockManager):
    """Refuses the batch of decodes: the scheduler then takes every sequence on its own."""

    def append_decodes(self, seq_ids: list[int]) -> bool:
        return False


def test_the_decode_fast_path_forms_the_same_batches_and_tables_as_one_by_one():
    """Random arrivals and lengths in a pool small enough to preempt: step by step, the scheduler that appends a
    whole decode batch at once and the one that appends each sequence alone schedule, preempt and allocate the
    same; and the fast path did take most steps."""
    import random

    rng = random.Random(7)
    config = SchedulerConfig(num_pages=30, page_size=4, max_num_seqs=12, max_num_batched_tokens=24)
    fast, slow = Scheduler(config), Scheduler(config, OneByOne(config.num_pages, config.page_size))
    taken = []
    original = fast.block_manager.append_decodes
    fast.block_manager.append_decodes = lambda ids: taken.append(original(ids)) or taken[-1]
    arrivals = {step: [(rng.randrange(1, 30), rng.randrange(1, 20)) for _ in range(rng.randrange(1, 4))]
                for step in range(0, 200, 3)}
    next_id = 0
    for step in range(1000):
        for prompt, max_tokens in arrivals.get(step, []):
            fast.add(seq(next_id, prompt, max_tokens))
            slow.add(seq(next_id, prompt, max_tokens))
            next_id += 1
        outputs = [scheduler.schedule() for scheduler in (fast, slow)]
        assert batch(outputs[0]) == batch(outputs[1]), step
        assert [s.seq_id for s in outputs[0].preempted] == [s.seq_id for s in outputs[1].preempted]
        assert fast.block_manager._tables == slow.block_manager._tables
        for scheduler, output in zip((fast, slow), outputs):
            scheduler.update(output, {s.seq.seq_id: 5 for s in output.scheduled if s.samples})
    assert not fast.has_unfinished() and next_id > 100 and fast.num_preemptions > 0
    assert sum(taken) > 100
