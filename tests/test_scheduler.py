"""Continuous batching on tiny specs, with exact batches: torch-free, as the simulator runs it."""
from __future__ import annotations

import sys

from engine.config import SchedulerConfig
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SamplingParams


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

    code = "import engine.scheduler, engine.block_manager, engine.memory, sys; assert 'torch' not in sys.modules"
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
