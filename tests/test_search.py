"""`planner search`: what it ranks meets the SLOs, what it prunes really cannot work, the Pareto front is the
front, the executors agree, and bad input gets one line."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.catalog.hardware import get_hardware
from planner.catalog.models import get_model
from planner.cost.memory_plan import plan_memory
from planner.deployment.capacity import Deployment
from planner.deployment.simulate import simulate
from planner.search.deployments import Ranked, SearchResult, SearchSpace, Slo, cheapest_fleet, run_search
from planner.search.executors import ResultCache
from planner.simulation.workload import LengthDistribution, Workload

SLO = Slo.parse("ttft_p99_s=1.5,tpot_p99_s=0.04")
WORKLOAD = Workload("poisson", 60, rate=1.0, prompt=LengthDistribution("lognormal", 800, sigma=0.5, maximum=4096),
                    output=LengthDistribution("lognormal", 128, sigma=0.5, maximum=512), seed=3)
# Llama-3.1-70B on H100s of 1, 2 and 4: BF16 does not fit one (141 GB of weights), FP8 on one is tight
SPACE = SearchSpace("llama-3.1-70b", ("h100-sxm",), max_gpus=4, weights=("bf16", "fp8"), kv_dtypes=("fp8",),
                    max_num_seqs=(64,), chunk_budgets=(2048,))


def planner_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


@pytest.fixture(scope="module")
def searched():
    return run_search(SPACE, WORKLOAD, SLO, executor="local", workers=2, bisections=3)


def test_every_ranked_configuration_meets_the_slos_alone_at_its_rate(searched):
    assert searched.enumerated == 3 * 2 and searched.simulated + len(searched.pruned) == 6
    assert searched.ranked, searched.closest()
    costs = [r.usd_per_million_tokens for r in searched.ranked]
    assert costs == sorted(costs)
    for ranked in searched.ranked:
        report = simulate(ranked.deployment, replace(WORKLOAD, rate=ranked.rate)).report()
        assert SLO.met(report), (ranked.name(), report["ttft_p99_s"], report["tpot_p99_s"])
        assert report["output_tokens_per_s"] == pytest.approx(ranked.output_tokens_per_s)


def test_what_it_drops_as_not_fitting_does_not_fit(searched):
    dropped = [(d, reason) for d, reason in searched.pruned if reason.startswith("does not fit")]
    assert any(d.weights == "bf16" and d.gpus == 1 for d, _ in dropped)
    for deployment, _ in dropped:
        plan = plan_memory(get_model(deployment.model), get_hardware(deployment.hardware), deployment.parallel,
                           deployment.weights, deployment.kv_dtype)
        assert plan.replica_capacity_tokens < deployment.context, deployment


def test_a_fleet_for_a_target_rate_is_the_cheapest_set_of_replicas(searched):
    fleet = cheapest_fleet(searched.ranked, 10.0)
    options = {r.name(): -(-10.0 // r.rate) * r.usd_per_hour for r in searched.ranked}
    assert fleet["usd_per_hour"] == pytest.approx(min(options.values()), abs=0.01)
    assert fleet["rate_rps"] >= 10.0


def point(gpu: float, user: float) -> Ranked:
    report = {"output_tokens_per_s": gpu, "tpot_p50_s": 1.0 / user, "ttft_p99_s": 0.1, "tpot_p99_s": 1.0 / user}
    return Ranked(Deployment("llama-3.1-8b", "h100-sxm", 1), 1.0, report, 2.5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=25))
def test_the_pareto_front_is_non_dominated_and_made_of_searched_points(pairs):
    ranked = [point(float(gpu), float(user)) for gpu, user in pairs]
    front = SearchResult(SPACE, WORKLOAD, SLO, ranked, [], [], len(ranked)).pareto()
    assert front and all(any(f is r for r in ranked) for f in front)

    def dominates(a: Ranked, b: Ranked) -> bool:
        better_or_equal = (a.tokens_per_s_per_gpu >= b.tokens_per_s_per_gpu
                           and a.tokens_per_s_per_user >= b.tokens_per_s_per_user)
        return better_or_equal and (a.tokens_per_s_per_gpu, a.tokens_per_s_per_user) != (
            b.tokens_per_s_per_gpu, b.tokens_per_s_per_user)
    assert not any(dominates(r, f) for f in front for r in ranked)
    assert all(r in front or any(dominates(f, r) for f in front) for r in ranked)


def test_the_executors_and_the_cache_give_the_same_ranking(searched, tmp_path):
    """In this process, in a pool of processes, on a local Ray with 2 CPUs, and from the cache: same rates."""
    def ranking(result: SearchResult) -> list[tuple[str, float]]:
        return [(r.name(), r.rate) for r in result.ranked]

    cache = ResultCache(tmp_path)
    serial = run_search(SPACE, WORKLOAD, SLO, executor="serial", cache=cache, bisections=3)
    assert ranking(serial) == ranking(searched) and serial.cached == 0
    again = run_search(SPACE, WORKLOAD, SLO, executor="serial", cache=cache, bisections=3)
    assert ranking(again) == ranking(searched) and again.cached == again.simulated
    import ray

    try:
        on_ray = run_search(SPACE, WORKLOAD, SLO, executor="ray:local", workers=2, bisections=3)
    finally:
        ray.shutdown()
    assert ranking(on_ray) == ranking(searched)


def test_search_cli_writes_the_front_and_the_deploy_commands(tmp_path):
    made = planner_cli("search", "--model", "llama-3.1-8b", "--slo", "ttft_p99_s=2,tpot_p99_s=0.05", "--hardware",
                       "h100-sxm,b200", "--max-gpus", "2", "--weights", "fp8,nvfp4", "--kv", "fp8", "--max-num-seqs",
                       "64", "--chunks", "2048", "--requests", "40", "--no-cache", "--target-rate", "30", "--out",
                       str(tmp_path), "--json")
    assert made.returncode == 0, made.stderr
    result = json.loads(made.stdout)
    assert result["enumerated"] == 2 * 1 + 2 * 2 and result["met_slo"] == len(result["ranked"]) > 0
    assert not any(r["weights"] == "nvfp4" and r["hardware"] != "b200" for r in result["ranked"])
    best = result["deploy"][0]
    assert best["vllm"].startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size")
    assert "--kv-cache-dtype fp8" in best["vllm"] and "--max-running-requests 64" in best["sglang"]
    assert result["fleet"]["rate_rps"] >= 30
    assert (tmp_path / "pareto.csv").read_text().startswith("configuration,")
    assert "plotly" in (tmp_path / "pareto.html").read_text()


@pytest.mark.parametrize("args, message", [
    (["--slo", "ttft_p42_s=1"], "unknown SLO metric 'ttft_p42_s'"),
    (["--slo", "tpot_p99_s=-1"], "the SLO tpot_p99_s must be a positive number of seconds, got -1.0"),
    (["--slo", "ttft_p99_s=2", "--target-rate", "-3"], "--target-rate must be a positive number of requests/s"),
    (["--slo", "ttft_p99_s=2", "--hardware", "h100-sxm", "--weights", "nvfp4"],
     "NVFP4 needs Blackwell's FP4 tensor cores; none of h100-sxm has them"),
])
def test_bad_search_input_is_one_line(args, message):
    made = planner_cli("search", "--model", "llama-3.1-8b", *args)
    assert made.returncode == 2 and message in made.stderr and len(made.stderr.strip().splitlines()) == 1, made.stderr


def test_nothing_meeting_the_slos_says_what_came_closest():
    made = planner_cli("search", "--model", "llama-3.1-70b", "--slo", "ttft_p99_s=0.001", "--hardware", "h100-sxm",
                       "--max-gpus", "2", "--weights", "fp8", "--kv", "fp8", "--max-num-seqs", "64", "--chunks",
                       "2048", "--requests", "20", "--no-cache", "--json")
    assert made.returncode == 0, made.stderr
    result = json.loads(made.stdout)
    assert result["ranked"] == [] and result["note"].startswith("nothing meets these SLOs; the closest:")
    assert "cannot meet ttft" in result["note"] or "does not fit" in result["note"]
