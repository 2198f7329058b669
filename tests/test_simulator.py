"""The SimPy simulator: invariants, directions, determinism, workloads, and agreement with the real engine."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO

from engine.core.config import SchedulerConfig
from planner.cost.step_model import BatchShape
from planner.deployment.capacity import Deployment
from planner.deployment.simulate import preemption_onset
from planner.errors import PlannerError
from planner.simulation.simulator import BatchWait, Simulation, model_step_time, replayed_step_time
from planner.simulation.workload import LengthDistribution, RequestSpec, Workload, read_trace


def toy_step(batch: BatchShape) -> float:
    return 0.01 + 2e-4 * batch.num_seqs + 2e-5 * batch.prefill_tokens + 1e-8 * batch.decode_context_tokens


def toy_simulation(num_pages: int = 400, replicas: int = 1, router: str = "least-loaded") -> Simulation:
    config = SchedulerConfig(num_pages=num_pages, page_size=16, max_num_seqs=64, max_num_batched_tokens=1024,
                             max_model_len=4096)
    return Simulation(config, model_step_time(toy_step), replicas, router)


WORKLOAD = Workload("poisson", 400, rate=8.0, prompt=LengthDistribution("uniform", low=50, high=400),
                    output=LengthDistribution("uniform", low=20, high=200), seed=3)


def test_invariants_pages_and_completion():
    sim = toy_simulation(num_pages=150)
    result = sim.run(WORKLOAD)
    requests = WORKLOAD.requests()
    assert len(result.timings) == len(requests) and all(t.finish_s is not None for t in result.timings)
    assert [t.output_tokens for t in sorted(result.timings, key=lambda t: t.request_id)] == \
        [r.output_tokens for r in requests]
    assert max(step.pages_in_use for step in result.steps) <= 150
    assert result.preemptions > 0                   # 150 pages of 16 tokens are too few for this load
    for replica in sim.replicas:
        replica.scheduler.block_manager.check_invariants()
        assert replica.scheduler.block_manager.num_free_pages == 150


def test_littles_law_in_steady_state():
    workload = Workload("poisson", 3000, rate=6.0, prompt=LengthDistribution("fixed", 100),
                        output=LengthDistribution("uniform", low=20, high=100), seed=11)
    result = toy_simulation(num_pages=4000).run(workload)
    timings = result.timings
    start, end = 100.0, max(t.arrival_s for t in timings) - 50.0        # no warm-up, no drain
    events = sorted([(t.arrival_s, 1) for t in timings] + [(t.finish_s, -1) for t in timings])
    in_system, area, last = 0, 0.0, start
    for moment, change in events:
        if moment > end:
            break
        if moment > start:
            area += in_system * (moment - last)
            last = moment
        in_system += change
    area += in_system * (end - last)
    average_in_system = area / (end - start)
    window = [t for t in timings if start <= t.arrival_s < end]
    rate = len(window) / (end - start)
    mean_time = sum(t.e2e_s for t in window) / len(window)
    assert average_in_system == pytest.approx(rate * mean_time, rel=0.05)


def test_same_seed_same_results_other_seed_other_results():
    first = toy_simulation().run(WORKLOAD).report()
    second = toy_simulation().run(WORKLOAD).report()
    for key in ("ttft_p99_s", "tpot_p50_s", "e2e_p50_s", "preemptions", "steps"):
        assert first[key] == second[key]
    other = toy_simulation().run(Workload(**{**WORKLOAD.__dict__, "seed": 4})).report()
    assert other["e2e_p50_s"] != first["e2e_p50_s"]


def test_more_memory_never_raises_ttft_p99():
    p99 = [toy_simulation(num_pages=pages).run(WORKLOAD).report()["ttft_p99_s"] for pages in (120, 200, 400, 1600)]
    assert p99 == sorted(p99, reverse=True)


def test_fp8_kv_never_lowers_the_kv_limited_concurrency():
    workload = Workload("closed", 60, users=1, prompt=LengthDistribution("fixed", 6000),
                        output=LengthDistribution("fixed", 500))
    onset = {kv: preemption_onset(Deployment("llama-3.1-8b", "l4", 1, "fp8", kv, context=6500), workload, 64)
             for kv in ("bf16", "fp8")}
    assert 0 < onset["bf16"] < onset["fp8"]


def test_routers_spread_requests_over_replicas():
    for router in ("round-robin", "least-loaded"):
        sim = toy_simulation(replicas=3, router=router)
        result = sim.run(WORKLOAD)
        steps_per_replica = [sum(1 for s in result.steps if s.replica == i) for i in range(3)]
        assert min(steps_per_replica) > 0.5 * max(steps_per_replica)
    single = toy_simulation().run(WORKLOAD).report()
    assert toy_simulation(replicas=3).run(WORKLOAD).report()["ttft_p99_s"] < single["ttft_p99_s"]


def test_closed_loop_keeps_the_users_busy():
    workload = Workload("closed", 200, users=12, prompt=LengthDistribution("fixed", 64),
                        output=LengthDistribution("fixed", 32))
    result = toy_simulation(num_pages=4000).run(workload)
    assert result.peak_running == 12
    assert all(t.finish_s is not None for t in result.timings)


def test_gamma_arrivals_are_burstier_than_poisson():
    def gap_cv(arrival: str) -> float:
        arrivals = np.array([r.arrival_s for r in Workload(arrival, 5000, rate=10, burstiness=3.0).requests()])
        gaps = np.diff(arrivals)
        return gaps.std() / gaps.mean()

    assert gap_cv("poisson") == pytest.approx(1.0, abs=0.1)
    assert gap_cv("gamma") == pytest.approx(3.0, rel=0.15)


def test_length_distributions_and_traces(tmp_path):
    rng = np.random.default_rng(0)
    assert LengthDistribution.parse("512").sample(rng, 3).tolist() == [512] * 3
    uniform = LengthDistribution.parse("uniform:10:20").sample(rng, 1000)
    assert uniform.min() >= 10 and uniform.max() <= 20
    lognormal = LengthDistribution.parse("lognormal:300:0.8").sample(rng, 20000)
    assert np.median(lognormal) == pytest.approx(300, rel=0.05)
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 4}\n'
                     '{"arrival_s": 0.1, "prompt_tokens": 30, "output_tokens": 2}\n')
    requests = read_trace(trace)
    assert [(r.arrival_s, r.prompt_tokens) for r in requests] == [(0.1, 30), (0.5, 10)]
    assert LengthDistribution.parse(f"trace:{trace}:prompt_tokens").values == (30, 10)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0.5, "prompt_tokens": 10}\n')
    with pytest.raises(PlannerError, match="line 1"):
        read_trace(bad)
    with pytest.raises(PlannerError, match="bad length 'uniform:9'"):
        LengthDistribution.parse("uniform:9")


def test_a_request_larger_than_the_pool_is_refused():
    with pytest.raises(PlannerError, match="exceed"):
        toy_simulation(num_pages=10).run([RequestSpec(0, 0.0, 150, 20)])


def test_simulate_cli_json_and_errors():
    args = ["simulate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--gpus", "1", "--weights", "fp8",
            "--kv", "fp8", "--workload", "poisson", "--rate", "5", "--requests", "200", "--prompt-tokens", "512",
            "--output-tokens", "uniform:50:150", "--json"]

    def simulate(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "planner.cli", *args, *extra], capture_output=True, text=True,
                              cwd=REPO)

    result = simulate()
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) == {"completed", "throughput_tokens_per_s", "output_tokens_per_s", "ttft_p50_s",
                            "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "max_concurrency_reached",
                            "preemptions", "kv_utilization_peak", "prefix_cache_hit_rate", "cached_tokens_per_request",
                            "sim_wall_s", "uncertainty_pct"}
    assert payload["completed"] == 200 and 0 < payload["kv_utilization_peak"] <= 1
    bad = simulate("--workload", "bursty")
    assert bad.returncode == 2 and "unknown workload 'bursty'" in bad.stderr
    polled = simulate("--scheduler-recv-interval", "30")
    assert polled.returncode == 0, polled.stderr
    assert json.loads(polled.stdout)["ttft_p50_s"] > payload["ttft_p50_s"]     # arrivals wait for the next poll
    zero = simulate("--scheduler-recv-interval", "0")
    assert zero.returncode == 2 and "scheduler recv interval must be a positive integer, got 0" in zero.stderr
    waiting = simulate("--batch-wait", "20:0.9")
    assert waiting.returncode == 0, waiting.stderr
    assert json.loads(waiting.stdout)["ttft_p50_s"] > payload["ttft_p50_s"]    # prompts held for a fuller batch
    garbled = simulate("--batch-wait", "20")
    assert garbled.returncode == 2 and garbled.stderr.count("\n") == 1
    assert "batch waiting is STEPS:RATIO (e.g. 20:0.9), got '20'" in garbled.stderr


def test_simulator_replays_the_engines_batches(english_prompts):
    """The real engine serves staggered requests on a virtual clock; the simulator, given the engine's
    measured step durations, forms exactly the same batches (ids, starts, token counts) in the same order.
    Work between steps (here a sleep, in verification the drift probes) stays out of the served timeline."""
    from engine.harness.served_run import ServeRequest, serve_requests
    from engine.llm import LLM

    llm = LLM(model="smollm2-135m", device="cpu", num_pages=24, page_size=8, max_num_batched_tokens=96,
              max_num_seqs=6, integrity="off")
    rng = random.Random(5)
    requests, arrival = [], 0.0
    for prompt in english_prompts[:12]:
        requests.append(ServeRequest(arrival, prompt, rng.randrange(10, 30)))
        arrival += rng.choice((0.0, 0.02, 0.1))
    calls = []

    def between_steps(steps_done: int) -> None:
        calls.append(steps_done)
        if steps_done <= 3:
            time.sleep(0.5)

    with pytest.raises(ValueError, match="use 'virtual'"):
        serve_requests(llm, requests, clock="wall", between_steps=between_steps)
    served = serve_requests(llm, requests, clock="virtual", between_steps=between_steps)
    assert calls == list(range(1, len(served.steps) + 1))
    arrivals = {r.arrival_s for r in requests}
    for before, after in zip(served.steps, served.steps[1:]):      # contiguous, or idle until an arrival
        assert after.start_s == pytest.approx(before.start_s + before.duration_s, abs=1e-9) or after.start_s in arrivals
    # 24 pages of 8 tokens run out whatever this machine's speed: with constant steps from 10 ms to
    # 400 ms this arrival pattern preempts 3 to 8 times.
    assert served.preemptions > 0
    config = llm.scheduler_config
    sim = Simulation(config, replayed_step_time([step.duration_s for step in served.steps]), record_steps=True)
    result = sim.run([RequestSpec(i, r.arrival_s, len(r.prompt_token_ids), r.output_tokens)
                      for i, r in enumerate(requests)])
    assert [step.batch for step in result.steps] == [step.batch for step in served.steps]
    assert result.preemptions == served.preemptions
    engine_ttft = sorted((t.request_id, round(t.ttft_s, 9)) for t in served.timings)
    assert sorted((t.request_id, round(t.ttft_s, 9)) for t in result.timings) == engine_ttft


def test_conversations_replay_the_engines_batches(english_prompts):
    """Later turns sent at one instant (their predecessors ended in the same step, with the same think time) reach
    the engine in the order those ended, as in the simulator, and every turn finds its transcript cached on both
    sides: the replay forms the engine's batches. Request 1 arrives first and answers one token more than request 0,
    so they end in one step in the order 1, 0: not their order in the list."""
    from engine.harness.served_run import ServeRequest, serve_requests
    from engine.llm import LLM

    llm = LLM(model="smollm2-135m", device="cpu", num_pages=120, page_size=8, max_num_batched_tokens=64,
              integrity="off")
    prompts = english_prompts
    requests = [ServeRequest(0.05, prompts[5], 10), ServeRequest(0.0, prompts[6], 11),
                ServeRequest(0.0, prompts[2], 8, follows=0, think_s=0.2), ServeRequest(0.0, prompts[3], 8, follows=1,
                                                                                        think_s=0.2)]
    served = serve_requests(llm, requests, clock="virtual")
    ends = {t.request_id: t.finish_s for t in served.timings}
    assert ends[0] == ends[1] and served.timings[2].arrival_s == served.timings[3].arrival_s
    sim = Simulation(llm.scheduler_config, replayed_step_time([step.duration_s for step in served.steps]),
                     record_steps=True)
    specs = [RequestSpec(0, 0.05, len(prompts[5]), 10, tuple(prompts[5])),
             RequestSpec(1, 0.0, len(prompts[6]), 11, tuple(prompts[6])),
             RequestSpec(2, None, len(prompts[5]) + 10 + len(prompts[2]), 8, tuple(prompts[2]), 0, 0.2),
             RequestSpec(3, None, len(prompts[6]) + 11 + len(prompts[3]), 8, tuple(prompts[3]), 1, 0.2)]
    result = sim.run(specs)
    assert [step.batch for step in result.steps] == [step.batch for step in served.steps]
    cached = {t.request_id: t.cached_tokens for t in result.timings}
    assert cached == {t.request_id: t.cached_tokens for t in served.timings} and cached[2] > 0 and cached[3] > 0


def sparse_step(batch: BatchShape) -> float:
    """A step that prices sparse attention's reads: the selected tokens of each decode, not its context."""
    selected = batch.decode_context_tokens if batch.decode_selected_tokens is None else batch.decode_selected_tokens
    return 0.004 + 1e-4 * batch.num_seqs + 2e-5 * batch.prefill_tokens + 3e-7 * selected


@pytest.mark.parametrize("index_topk, num_pages, replicas, receive_interval, batch_wait",
                         [(0, 400, 1, 1, None), (96, 400, 2, 1, None), (0, 60, 1, 1, None), (0, 400, 2, 7, None),
                          (0, 400, 1, 1, BatchWait(6, 0.5))])
def test_fast_forwarded_decode_windows_give_the_step_by_step_timings(index_topk, num_pages, replicas,
                                                                     receive_interval, batch_wait, monkeypatch):
    """Dense and sparse step prices, two replicas, a pool small enough to preempt, a scheduler that polls for
    requests every 7 decode steps, one that holds prompts back for a fuller batch: the same first tokens, ends,
    steps, peaks and preemptions, float for float, with windows fast-forwarded or not; and windows did run, their
    steps sharing timeouts where nothing else happens between them."""
    import simpy

    from planner.simulation.simulator import Replica

    windows, timeouts = [], []
    original, timeout = Replica.decode_window, simpy.Environment.timeout

    def counted(self):
        steps = yield from original(self)
        windows.append(steps)
        return steps

    def counted_timeout(self, delay=0, value=None):
        timeouts.append(delay)
        return timeout(self, delay, value)
    monkeypatch.setattr(Replica, "decode_window", counted)
    monkeypatch.setattr(simpy.Environment, "timeout", counted_timeout)
    config = SchedulerConfig(num_pages=num_pages, page_size=16, max_num_seqs=64, max_num_batched_tokens=1024,
                             max_model_len=4096)
    workload = Workload("poisson", 300, rate=3.0, prompt=LengthDistribution("uniform", low=20, high=300),
                        output=LengthDistribution("uniform", low=10, high=300), seed=5)
    results, timeouts_per_run = [], []
    for fast_forward in (False, True):
        timeouts.clear()
        results.append(Simulation(config, model_step_time(sparse_step, index_topk), replicas, record_steps=False,
                                  fast_forward=fast_forward, receive_interval=receive_interval,
                                  batch_wait=batch_wait).run(workload))
        timeouts_per_run.append(len(timeouts))
    slow, fast = results
    assert [(t.first_token_s, t.finish_s, t.output_tokens, t.preemptions) for t in slow.timings] == \
           [(t.first_token_s, t.finish_s, t.output_tokens, t.preemptions) for t in fast.timings]
    assert (slow.num_steps, slow.peak_running, slow.kv_utilization_peak, slow.preemptions) == \
           (fast.num_steps, fast.peak_running, fast.kv_utilization_peak, fast.preemptions)
    assert sum(windows) > slow.num_steps / 4, (sum(windows), slow.num_steps)
    assert timeouts_per_run[1] < timeouts_per_run[0], (timeouts_per_run, sum(windows))
    assert num_pages > 100 or slow.preemptions > 0


def test_a_prompt_whose_last_token_is_left_alone_still_gets_its_first_token():
    """Two prompts of a whole step's budget: the second's last token is scheduled alone, beside decodes. That step
    samples its first token, so the fast-forward must not take it for a decode (it once did: no TTFT at all)."""
    config = SchedulerConfig(num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                             max_model_len=512)
    requests = [RequestSpec(i, 0.0, 64, 40) for i in range(2)]
    fast = Simulation(config, model_step_time(toy_step), record_steps=False).run(list(requests))
    slow = Simulation(config, model_step_time(toy_step), record_steps=False, fast_forward=False).run(list(requests))
    assert all(t.first_token_s is not None for t in fast.timings)
    assert [t.first_token_s for t in fast.timings] + [t.finish_s for t in fast.timings] == pytest.approx(
        [t.first_token_s for t in slow.timings] + [t.finish_s for t in slow.timings], rel=1e-12)


def test_the_api_servers_time_delays_each_request_by_as_much():
    config = SchedulerConfig(num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                             max_model_len=512)
    alone = Simulation(config, model_step_time(toy_step)).run([RequestSpec(0, 0.0, 100, 10)])
    served = Simulation(config, model_step_time(toy_step), request_overhead_s=0.25).run([RequestSpec(0, 0.0, 100, 10)])
    (first,), (second,) = alone.timings, served.timings
    assert second.ttft_s == pytest.approx(first.ttft_s + 0.25) and second.tpot_s == pytest.approx(first.tpot_s)
    with pytest.raises(PlannerError, match="request overhead must be >= 0 seconds, got -1"):
        Simulation(config, model_step_time(toy_step), request_overhead_s=-1)


# a replica whose intake is tested: one long request decoding, short prompts arriving beside it
INTAKE_CONFIG = SchedulerConfig(num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                                max_model_len=512)


def first_step_of(request_id: int, result) -> int:
    """The first recorded step whose batch holds the request."""
    return next(i for i, step in enumerate(result.steps) if any(rid == request_id for rid, _, _ in step.batch))


def test_a_scheduler_polling_every_n_decode_steps_takes_a_request_in_at_the_next_poll():
    """SGLang's `--scheduler-recv-interval 10`: after a prefill step the loop polls at once, then after every 10
    decode steps. A request arriving in decode step 3 of a long request waits for the poll before step 11 and is
    prefilled there (polling every step: in step 4); one arriving at an idle server starts at once."""
    for interval, expected in ((1, 4), (10, 11)):
        simulation = Simulation(INTAKE_CONFIG, model_step_time(toy_step), receive_interval=interval)
        result = simulation.run([RequestSpec(0, 0.0, 100, 40), RequestSpec(1, 0.035, 50, 5),
                                 RequestSpec(2, 5.0, 50, 5)])
        step = result.steps[first_step_of(1, result)]
        assert result.steps[3].start_s < 0.035 < result.steps[4].start_s
        assert first_step_of(1, result) == expected and step.batch == [(0, 100 + expected - 1, 1), (1, 0, 50)]
        idle = result.steps[first_step_of(2, result)]
        assert idle.start_s == 5.0 and idle.batch == [(2, 0, 50)]
    with pytest.raises(PlannerError, match="receive interval must be a positive integer of steps, got 0"):
        Simulation(INTAKE_CONFIG, model_step_time(toy_step), receive_interval=0)


def test_batch_waiting_holds_a_prompt_until_the_batch_fills_or_the_steps_run_out():
    """TensorRT-LLM's `batch_wait_timeout_iters: 5`, `batch_wait_max_tokens_ratio`: a 50-token prompt arriving in
    decode step 3 of a long request is put off at five polls and prefilled in step 9 (no waiting: step 4); at a ratio
    of 0.75 of 256 tokens, a 150-token prompt arriving in step 4 fills the batch (1 decode + 200 prompt tokens) and
    both start in step 5; one arriving at an idle server starts at once."""
    long_one, late, idle = RequestSpec(0, 0.0, 100, 40), RequestSpec(1, 0.035, 50, 5), RequestSpec(9, 5.0, 50, 5)
    for wait, expected in ((None, 4), (BatchWait(5, 0.9), 9)):
        result = Simulation(INTAKE_CONFIG, model_step_time(toy_step), batch_wait=wait).run([long_one, late, idle])
        assert result.steps[3].start_s < 0.035 < result.steps[4].start_s
        assert first_step_of(1, result) == expected
        assert result.steps[first_step_of(9, result)].start_s == 5.0
    filled = Simulation(INTAKE_CONFIG, model_step_time(toy_step), batch_wait=BatchWait(5, 0.75)).run(
        [long_one, late, RequestSpec(2, 0.045, 150, 5)])
    assert filled.steps[4].start_s < 0.045 < filled.steps[5].start_s
    assert first_step_of(1, filled) == first_step_of(2, filled) == 5
    assert filled.steps[5].batch == [(0, 104, 1), (1, 0, 50), (2, 0, 150)]
    for bad, message in (((0, 0.5), "steps must be a positive integer, got 0"),
                         ((5, 0.0), r"token ratio must be in \(0, 1\], got 0.0")):
        with pytest.raises(PlannerError, match=message):
            BatchWait(*bad)
    with pytest.raises(PlannerError, match="batch waiting is STEPS:RATIO .*, got '20'"):
        BatchWait.parse("20")
