"""The planner's speculative decoding: expected tokens a step, the simulator's draws against them, the engine's
scheduler verifying and rolling back inside the simulation, and when speculation stops paying."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from conftest import REPO

from engine.core.config import SchedulerConfig
from engine.core.speculative import DraftStats
from planner.cost.step_model import BatchShape
from planner.errors import PlannerError
from planner.simulation.simulator import Simulation, model_step_time
from planner.simulation.speculation import MTP_ACCEPTANCE, Speculation
from planner.simulation.workload import LengthDistribution, Workload


def test_expected_tokens_per_step():
    assert Speculation("mtp", 1, (0.875,)).expected_tokens_per_step == pytest.approx(1.875)
    rate = 0.8
    assert Speculation("ngram", 4, (rate,)).expected_tokens_per_step == pytest.approx(
        sum(rate ** i for i in range(5)))
    per_position = Speculation("ngram", 3, (0.9, 0.5, 0.5))
    assert per_position.expected_tokens_per_step == pytest.approx(1 + 0.9 + 0.45 + 0.225)
    lengths = Speculation("ngram", 2, (1.0,), (0.5, 0.0, 0.5))      # half the steps propose nothing
    assert lengths.expected_tokens_per_step == pytest.approx(0.5 * 1 + 0.5 * 3)


def test_parse_and_refusals():
    assert Speculation.parse("mtp:1").acceptance == (MTP_ACCEPTANCE,)
    assert Speculation.parse("ngram:3", "0.9,0.7").acceptance == (0.9, 0.7)
    for text, acceptance, needle in (("ngram:3", None, "needs --acceptance"), ("eagle:2", "0.5", "method"),
                                     ("mtp", None, "METHOD:K"), ("mtp:1", "x", "--acceptance"),
                                     ("mtp:1", "1.2", "[0, 1]"), ("mtp:40", None, "1..16")):
        with pytest.raises(PlannerError, match=needle):
            Speculation.parse(text, acceptance)


def test_draws_follow_the_rates():
    speculation = Speculation("ngram", 3, (0.9, 0.6, 0.3), (0.2, 0.1, 0.1, 0.6))
    rng = random.Random(0)
    stats = DraftStats(3)
    for _ in range(50_000):
        drafts = speculation.draw_drafts(rng, room=10)
        if drafts:
            stats.record(0, [(drafts, speculation.draw_accepted(rng, drafts))])
        else:
            stats.record(1, [])
    assert stats.acceptance_by_position() == pytest.approx([0.9, 0.6, 0.3], abs=0.015)
    assert stats.draft_length_shares() == pytest.approx([0.2, 0.1, 0.1, 0.6], abs=0.01)
    assert speculation.draw_drafts(rng, room=1) <= 1


def memory_bound_step(batch: BatchShape) -> float:
    """A toy GPU: a step reads the weights once (10 ms) unless its tokens' compute (40 us each) takes longer."""
    return max(0.010, 4e-5 * batch.new_tokens) + 1e-3


def run(users: int, speculation: Speculation | None) -> dict:
    config = SchedulerConfig(num_pages=4000, page_size=16, max_num_seqs=256, max_num_batched_tokens=4096,
                             max_model_len=4096)
    workload = Workload("closed", users * 4, users=users, prompt=LengthDistribution("fixed", value=64),
                        output=LengthDistribution("fixed", value=64), seed=1)
    simulation = Simulation(config, model_step_time(memory_bound_step), speculation=speculation, record_steps=False)
    result = simulation.run(workload)
    for replica in simulation.replicas:
        replica.scheduler.block_manager.check_invariants()
        assert replica.scheduler.block_manager.num_used_pages == 0       # every rolled-back slot given back
    return {**result.report(), "output_tokens": sum(timing.output_tokens for timing in result.timings)}


def test_speculation_pays_at_low_concurrency_and_not_at_high():
    speculation = Speculation("mtp", 3, (0.8,))
    alone, drafted = run(2, None), run(2, speculation)
    assert drafted["output_tokens"] == alone["output_tokens"] == 2 * 4 * 64       # lengths are kept exactly
    speed_up = drafted["output_tokens_per_s"] / alone["output_tokens_per_s"]
    assert 1.8 < speed_up < speculation.expected_tokens_per_step + 0.2         # memory-bound: near E[tokens]
    busy, busy_drafted = run(200, None), run(200, speculation)
    assert busy_drafted["output_tokens_per_s"] < busy["output_tokens_per_s"]     # compute-bound: K+1 rows cost


def test_simulate_cli_takes_speculation():
    def simulate(*extra: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "planner.cli", "simulate", "--model", "deepseek-v3", "--hardware",
                               "h200", "--gpus", "8", "--workload", "closed", "--users", "2", "--requests", "12",
                               "--json", *extra], capture_output=True, text=True, cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    plain, mtp = simulate(), simulate("--speculative", "mtp:1")
    assert mtp["speculative"].startswith("mtp:1 (acceptance 0.875")
    assert mtp["tpot_p50_s"] < plain["tpot_p50_s"]
    refused = subprocess.run([sys.executable, "-m", "planner.cli", "simulate", "--model", "llama-3.1-8b", "--hardware",
                              "h100-sxm", "--gpus", "1", "--rate", "1", "--requests", "4", "--speculative", "mtp:1"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
    assert refused.returncode == 2 and "no multi-token-prediction layer" in refused.stderr


def test_plan_says_where_speculation_stops_paying():
    from planner.deployment.capacity import Deployment, evaluate
    from planner.deployment.speculative_plan import speculative_gain

    capacity = evaluate(Deployment(model="deepseek-v3", hardware="h200", gpus=8))
    gain = speculative_gain(capacity, Speculation.parse("mtp:1"))
    batch, plain, drafted = gain.by_batch[0]
    assert batch == 1 and 1.3 < drafted / plain < 1.875             # memory-bound: close to E[tokens], never above
    assert gain.stops_paying_at is not None
    for batch, plain, drafted in gain.by_batch:
        assert (drafted < plain) == (batch >= gain.stops_paying_at)    # one crossover
    done = subprocess.run([sys.executable, "-m", "planner.cli", "plan", "--model", "deepseek-v3", "--hardware", "h200",
                           "--gpus", "8", "--speculative", "mtp:1", "--json"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["speculative"]["stops_paying_at_batch"] == gain.stops_paying_at


def test_search_tries_speculation_beside_plain_decoding(tmp_path):
    done = subprocess.run([sys.executable, "-m", "planner.cli", "search", "--model", "llama-3.1-8b", "--hardware",
                           "h100-sxm", "--max-gpus", "1", "--weights", "bf16", "--kv", "fp8", "--max-num-seqs", "64",
                           "--chunks", "2048", "--requests", "40", "--speculative", "ngram:3", "--acceptance", "0.7",
                           "--slo", "tpot_p99_s=0.05", "--cache-dir", str(tmp_path), "--workers", "1", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    drafted = {row["speculative"] is not None for row in payload["ranked"]}
    assert drafted == {True, False}                  # every candidate with and without drafts
    commands = {item["configuration"]: item for item in payload["deploy"]}
    assert any('"method": "ngram", "num_speculative_tokens": 3' in item["vllm"]
               and "--speculative-algorithm NGRAM" in item["sglang"] for item in commands.values())
    verdict = payload["speculative"]
    assert verdict["configuration"].endswith("ngram:3") and verdict["single_stream_speedup"] > 1


def test_mtp_adds_its_layer_to_the_kv_cache_as_the_engine_does():
    from engine.core.memory import kv_bytes_per_token, kv_layout, with_draft_layers
    from planner.catalog.models import get_model
    from planner.deployment.capacity import Deployment, evaluate

    plain = evaluate(Deployment(model="deepseek-v3", hardware="h200", gpus=8)).plan
    drafted = evaluate(Deployment(model="deepseek-v3", hardware="h200", gpus=8,
                                  speculation=Speculation.parse("mtp:1"))).plan
    model = get_model("deepseek-v3")
    assert drafted.kv_bytes_per_token_per_gpu == kv_bytes_per_token(with_draft_layers(kv_layout(model, "fp8"), 1))
    assert drafted.kv_bytes_per_token_per_gpu * model.num_layers == plain.kv_bytes_per_token_per_gpu * (
        model.num_layers + 1)


def test_verify_takes_prompt_lookup_only():
    from planner.verification.verify import verify

    with pytest.raises(PlannerError, match="takes ngram:K"):
        verify("no-profile.json", Workload("poisson", 4, rate=1.0), speculative="mtp:1")


def test_served_steps_give_each_request_its_own_drafting():
    """Two requests of 10 prompt tokens: request 0 (12 output tokens) drafts 4 that all stand, then 4 of which 2
    stand, then has no room for drafts; request 1 (9 output tokens) never drafts. From the steps alone: their
    outcomes, their draft lengths and acceptance, and a simulation replaying them forms the same steps."""
    from engine.harness.served_run import ServedStep
    from planner.simulation.workload import RequestSpec
    from planner.verification.drafting import ReplayedDrafts, drafting_by_request, served_outcomes

    specs = [RequestSpec(0, 0.0, 10, 12), RequestSpec(1, 0.0, 10, 9)]
    batches = [[(0, 0, 10), (1, 0, 10)], [(0, 10, 5), (1, 10, 1)], [(0, 15, 5), (1, 11, 1)]]
    batches += [[(0, 18 + index, 1), (1, 12 + index, 1)] for index in range(3)] + [[(1, start, 1)] for start in (15, 16, 17)]
    steps = [ServedStep(float(index), 0.1, batch, 0, len(batch)) for index, batch in enumerate(batches)]
    outcomes = served_outcomes(steps, specs)
    assert outcomes == {0: [(4, 4), (4, 2), (0, 0), (0, 0), (0, 0)], 1: [(0, 0)] * 8}
    overall = Speculation("ngram", 4, (0.7,))
    drafting = drafting_by_request(outcomes, overall)
    assert drafting[0].acceptance == (1.0, 1.0, 0.5, 1.0) and drafting[0].draft_lengths == (0.6, 0, 0, 0, 0.4)
    assert drafting[1].acceptance == (0.7,) * 4 and drafting[1].draft_lengths == (1.0, 0, 0, 0, 0)
    config = SchedulerConfig(num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)
    replay = Speculation("ngram", 4, (0.7,), by_request={id_: ReplayedDrafts(done) for id_, done in outcomes.items()})
    simulated = Simulation(config, model_step_time(memory_bound_step), speculation=replay).run(specs)
    assert [sorted(step.batch) for step in simulated.steps] == batches
