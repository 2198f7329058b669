"""The planner's workloads with shared prefixes: a system prompt, multi-turn conversations, agent traces with
session ids; the simulator's hits through the engine's own block manager; plan, simulate and search with and
without prefix caching."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO

from engine.core.config import SchedulerConfig
from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.simulate import simulate
from planner.errors import PlannerError
from planner.search.deployments import SearchSpace, Slo, deploy_commands, run_search
from planner.simulation.simulator import Simulation
from planner.simulation.workload import LengthDistribution, Workload

CHAT = Workload("poisson", 60, rate=2.0, prompt=LengthDistribution("uniform", low=100, high=300),
                output=LengthDistribution("uniform", low=50, high=150), turns=4, shared_prefix_tokens=500,
                think_time_s=1.0, seed=2)


def planner_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def test_conversations_extend_their_transcript():
    requests = CHAT.requests()
    assert len(requests) == 60 and CHAT.shares_prefixes
    by_id = {r.request_id: r for r in requests}
    firsts = [r for r in requests if r.follows is None]
    assert len(firsts) == 15 and all(r.arrival_s is not None for r in firsts)
    assert len({r.prompt_ids[:500] for r in firsts}) == 1                   # one system prompt for all
    assert len({r.prompt_ids[500:520] for r in firsts}) == 15               # and each its own message
    for request in requests:
        if request.follows is not None:
            previous = by_id[request.follows]
            assert request.arrival_s is None and request.session == previous.session
            assert request.prompt_tokens == previous.prompt_tokens + previous.output_tokens + len(request.prompt_ids)
            assert request.think_s == 1.0
    assert replace(CHAT, turns=1, shared_prefix_tokens=0).requests()[0].prompt_ids is None
    with pytest.raises(PlannerError, match="turns"):
        replace(CHAT, turns=0)


def test_the_simulator_hits_what_the_block_manager_holds():
    """Every later turn finds its whole transcript but its last page (and a bit) cached; a first turn finds the
    system prompt once another conversation has published it. Without caching nothing is found and prefill
    costs more, so TTFT rises."""
    config = SchedulerConfig(num_pages=4000, page_size=16, max_num_seqs=64, enable_prefix_caching=True)

    def step_time(output):
        return 0.002 + 1e-5 * output.num_batched_tokens

    result = Simulation(config, step_time).run(CHAT)
    timings = {t.request_id: t for t in result.timings}
    requests = CHAT.requests()
    for request in requests:
        cached = timings[request.request_id].cached_tokens
        assert cached % 16 == 0 and cached < request.prompt_tokens
        if request.follows is not None:
            previous = next(r for r in requests if r.request_id == request.follows)
            transcript = previous.prompt_tokens + previous.output_tokens
            assert cached >= (transcript - 1) // 16 * 16 - 16, (request, cached)
    assert sum(1 for r in requests if r.follows is None and timings[r.request_id].cached_tokens >= 496) >= 13
    report = result.report()
    assert 0.5 < report["prefix_cache_hit_rate"] < 1
    without = Simulation(replace(config, enable_prefix_caching=False), step_time).run(CHAT).report()
    assert without["prefix_cache_hit_rate"] == 0 and without["cached_tokens_per_request"] == 0
    assert without["ttft_p50_s"] > report["ttft_p50_s"]


def test_an_agent_trace_with_sessions(tmp_path):
    trace = tmp_path / "agent.jsonl"
    lines = [{"session_id": "a", "arrival_s": 0.0, "prompt_tokens": 2000, "output_tokens": 100},
             {"session_id": "b", "arrival_s": 0.5, "prompt_tokens": 1500, "output_tokens": 80},
             {"session_id": "a", "new_tokens": 300, "output_tokens": 60, "think_s": 0.2},
             {"session_id": "a", "prompt_tokens": 2600, "output_tokens": 40},
             {"arrival_s": 1.0, "prompt_tokens": 700, "output_tokens": 20}]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    workload = Workload("trace", trace=str(trace), shared_prefix_tokens=100)
    requests = workload.requests()
    assert [r.prompt_tokens for r in sorted(requests, key=lambda r: r.request_id)] == [2100, 1600, 2500, 2600, 800]
    follow = [r for r in requests if r.follows is not None]
    assert [(r.follows, r.think_s) for r in follow] == [(0, 0.2), (2, 0.0)]
    config = SchedulerConfig(num_pages=2000, page_size=16, enable_prefix_caching=True)
    timings = {t.request_id: t for t in Simulation(config, lambda output: 0.01).run(workload).timings}
    assert timings[2].cached_tokens == (2200 - 1) // 16 * 16 and timings[1].cached_tokens == 96
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"session_id": "a", "prompt_tokens": 1000,
                                                              "output_tokens": 5}) + "\n")
    with pytest.raises(PlannerError, match="line 2"):
        Workload("trace", trace=str(bad)).requests()


def test_plan_holds_a_shared_prefix_once():
    plan = evaluate(Deployment("llama-3.1-8b", "h100-sxm", 1, context=8192)).plan
    alone = plan.max_concurrency(8192)
    shared = plan.max_concurrency(8192, 4096)
    assert shared > 1.9 * alone
    out = planner_cli("plan", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--gpus", "1", "--context", "8192",
                      "--shared-prefix", "4096", "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["max_concurrency_shared_prefix"] == shared and payload["max_concurrency"] == alone


def test_simulate_cli_takes_conversations_and_reports_hits():
    common = ["simulate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--gpus", "1", "--requests", "80",
              "--rate", "4", "--prompt-tokens", "200", "--output-tokens", "100", "--turns", "4", "--shared-prefix",
              "1000", "--think-time", "1", "--json"]
    cached, uncached = (json.loads(planner_cli(*common, *extra).stdout) for extra in ([], ["--no-prefix-caching"]))
    assert cached["prefix_cache_hit_rate"] > 0.7 and uncached["prefix_cache_hit_rate"] == 0
    assert cached["ttft_p50_s"] < uncached["ttft_p50_s"]
    assert cached["completed"] == uncached["completed"] == 80


def test_search_compares_with_and_without_caching():
    space = SearchSpace("llama-3.1-8b", ("h100-sxm",), max_gpus=1, weights=("fp8",), kv_dtypes=("fp8",),
                        max_num_seqs=(64,), chunk_budgets=(2048,))
    workload = replace(CHAT, num_requests=40)
    result = run_search(space, workload, Slo.parse("ttft_p99_s=0.5"), executor="serial", bisections=1)
    caching = {r.deployment.prefix_caching: r for r in result.ranked}
    assert set(caching) == {True, False}
    assert caching[True].rate >= caching[False].rate
    assert caching[True].row()["prefix_cache_hit_rate"] > 0.5
    off = deploy_commands(caching[False].deployment)
    assert "--no-enable-prefix-caching" in off["vllm"] and "--disable-radix-cache" in off["sglang"]
    plain = run_search(space, replace(workload, turns=1, shared_prefix_tokens=0), Slo.parse("ttft_p99_s=0.5"),
                       executor="serial", bisections=1)
    assert {r.deployment.prefix_caching for r in plain.ranked} == {True}


def test_simulated_conversations_match_with_and_without_fast_forward():
    deployment = Deployment("llama-3.1-8b", "h100-sxm", 1)
    fast = simulate(deployment, CHAT).report()
    slow = simulate(deployment, CHAT, record_steps=True).report()
    for key in ("ttft_p50_s", "tpot_p50_s", "prefix_cache_hit_rate", "cached_tokens_per_request"):
        assert fast[key] == pytest.approx(slow[key], rel=1e-9), key
