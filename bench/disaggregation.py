"""Aggregated against disaggregated serving, by the planner: DeepSeek-V3 and Kimi K2.6 on H200, a chat and a
long-prompt workload, the frontier of output tokens/s per GPU against tokens/s per user (1 / TPOT p50).

Candidates: one aggregated engine instance of 8 GPUs (experts parallel over the 8, attention data-parallel: each
GPU holds its own requests' KV and batch, as SGLang's DeepSeek and Kimi deployments run), and xPyD pools of such
instances (1P1D, 1P2D, 1P3D, 2P1D; each GPU sends its requests' pages over its own 400 Gb/s NIC). Each is
simulated at Poisson rates scaled to its GPUs (the same load per GPU), 0.25x to 4x of what the step model's
throughputs say an aggregated instance sustains (a conservative figure: it takes the prefill and the decode rates
one after the other); a point counts when its TTFT p99 stays under 10 s. At 20 and 50 tokens/s per user: the most
tokens/s per GPU of each kind. Published per-GPU figures of large disaggregated deployments are printed beside,
with their sources: they run expert parallelism over 32-144 GPUs per instance, which this planner's 8-GPU
instances do not, so they bound what the technique reaches rather than check these numbers.

Prints a table and writes bench/results/disaggregation.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.disaggregated import simulate_disaggregated, split_pools
from planner.deployment.simulate import simulate
from planner.simulation.workload import LengthDistribution, Workload

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"deepseek-v3": "fp8", "kimi-k2.6": "native"}          # as each ships: FP8 blocks, INT4 experts
WORKLOADS = {
    "chat": (LengthDistribution("lognormal", 1000, sigma=0.8, maximum=8192),
             LengthDistribution("lognormal", 256, sigma=0.5, maximum=1024)),
    "long-prompt": (LengthDistribution("lognormal", 8000, sigma=0.4, maximum=32768),
                    LengthDistribution("lognormal", 256, sigma=0.5, maximum=1024)),
}
POOLS = ((1, 1), (1, 2), (1, 3), (2, 1))
LOADS = (0.25, 0.5, 1.0, 2.0, 4.0)
USER_TARGETS = (20.0, 50.0)          # tokens/s per user: TPOT p50 of 50 and 20 ms
TTFT_P99_LIMIT_S = 10.0
PUBLISHED = [
    {"what": "DeepSeek-V3/R1 in production, H800, 24-hour average: decode nodes (EP144 over 18 nodes)",
     "output_tokens_per_s_per_gpu": 14800 / 8,
     "source": "https://github.com/deepseek-ai/open-infra-index/blob/main/202502OpenSourceWeek/"
               "day_6_one_more_thing_deepseekV3R1_inference_system_overview.md",
     "date": "2025-03-01 (read 2026-12-04)",
     "quote": "~73.7k tokens/s input (including cache hits) during prefilling or ~14.8k tokens/s output during "
              "decoding"},
    {"what": "DeepSeek-V3, SGLang PD disaggregation + large-scale EP, 12 nodes x 8 H100, 2000-token inputs",
     "output_tokens_per_s_per_gpu": 22300 / 8, "source": "https://lmsys.org/blog/2025-05-05-large-scale-ep/",
     "date": "2025-05-05 (read 2026-12-04)",
     "quote": "52.3k input tokens per second and 22.3k output tokens per second per node for 2000-token input "
              "sequences"},
    {"what": "Kimi K2, SGLang + Mooncake, 128 H200 (1P1D: 4 prefill nodes, 12 decode nodes), input 2000, output 100",
     "output_tokens_per_s_per_gpu": 24000 / 8, "source": "https://lmsys.org/blog/2025-07-20-k2-large-scale-ep/",
     "date": "2025-07-20 (read 2026-12-04)",
     "quote": "| **Kimi K2** | 384 | 128 × H200 | 56k / node | 24k / node |; Decode Throughput | "
              "**288k tokens/sec (12 D Nodes)**"},
]


def instance(model: str) -> Deployment:
    return Deployment(model=model, hardware="h200", gpus=8, weights=MODELS[model], kv_dtype="fp8", context=16384,
                      tensor_parallel=8, expert_parallel=True, attention_data_parallel=True)


def point(report: dict, gpus: int) -> dict:
    tpot = report["tpot_p50_s"]
    return {"tokens_per_s_per_gpu": round(report["output_tokens_per_s"] / gpus, 2),
            "tokens_per_s_per_user": round(1.0 / tpot, 2) if tpot else None,
            "ttft_p50_s": round(report["ttft_p50_s"], 4), "ttft_p99_s": round(report["ttft_p99_s"], 4),
            "tpot_p50_s": round(tpot, 5) if tpot else None}


def frontier(points: list[dict]) -> list[dict]:
    """The points no other beats on both tokens/s per GPU and per user."""
    kept = [p for p in points if p["tokens_per_s_per_user"] is not None and p["ttft_p99_s"] <= TTFT_P99_LIMIT_S]
    return sorted((p for p in kept if not any(
        q["tokens_per_s_per_gpu"] >= p["tokens_per_s_per_gpu"] and q["tokens_per_s_per_user"] >= p["tokens_per_s_per_user"]
        and q is not p and (q["tokens_per_s_per_gpu"], q["tokens_per_s_per_user"])
        != (p["tokens_per_s_per_gpu"], p["tokens_per_s_per_user"]) for q in kept)),
        key=lambda p: p["tokens_per_s_per_gpu"])


def sweep(model: str, workload_name: str, requests: int) -> dict:
    prompt, output = WORKLOADS[workload_name]
    base = instance(model)
    capacity = evaluate(base)
    workload = Workload("poisson", requests, rate=1.0, prompt=prompt, output=output, seed=0)
    sizes = [r for r in workload.requests()]
    mean_prompt = statistics.fmean(r.prompt_tokens for r in sizes)
    mean_output = statistics.fmean(r.output_tokens for r in sizes)
    per_instance = 1.0 / (mean_prompt / capacity.prefill_tokens_per_s + mean_output / capacity.decode_tokens_per_s)
    points: dict[str, list[dict]] = {}
    for load in LOADS:
        rate = per_instance * load
        report = simulate(base, replace(workload, rate=rate)).report()
        points.setdefault("aggregated 1x8", []).append({"load": load, **point(report, base.gpus)})
        for prefill, decode in POOLS:
            pools = split_pools(base, prefill, decode)
            run = simulate_disaggregated(pools, replace(workload, rate=rate * (prefill + decode)))
            report = run.report()
            points.setdefault(f"{pools.name} x8", []).append(
                {"load": load, **point(report, pools.gpus),
                 "handoff_p50_s": round(report["handoff_p50_s"], 5),
                 "handoff_mb_per_request": round(report["handoff_bytes_per_request"] / 1e6, 2)})
    aggregated = frontier(points["aggregated 1x8"])
    disaggregated = frontier([p for name, found in points.items() if name != "aggregated 1x8" for p in found])
    return {"model": model, "weights": MODELS[model], "workload": workload_name,
            "mean_prompt_tokens": round(mean_prompt), "mean_output_tokens": round(mean_output),
            "aggregated_instance_requests_per_s": round(per_instance, 3), "points": points,
            "frontier": {"aggregated": aggregated, "disaggregated": disaggregated},
            "at_user_targets": {f"{target:g}": {kind: at_target(points, target) for kind, points in
                                                (("aggregated", aggregated), ("disaggregated", disaggregated))}
                                for target in USER_TARGETS}}


def at_target(points: list[dict], tokens_per_s_per_user: float) -> float | None:
    """The most tokens/s per GPU among frontier points that give each user at least `tokens_per_s_per_user`."""
    return max((p["tokens_per_s_per_gpu"] for p in points if p["tokens_per_s_per_user"] >= tokens_per_s_per_user),
               default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests each simulation runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = sys.stderr if args.json else sys.stdout
    started = time.perf_counter()
    cases = [sweep(model, workload, args.requests) for model in MODELS for workload in WORKLOADS]
    for case in cases:
        print(f"\n{case['model']} ({case['weights']}) on H200, {case['workload']} (prompt ~{case['mean_prompt_tokens']}, "
              f"output ~{case['mean_output_tokens']} tokens): tokens/s per GPU at tokens/s per user", file=out)
        print(f"  {'configuration':16s} " + " ".join(f"{f'load {load:g}':>17s}" for load in LOADS), file=out)
        for name, found in case["points"].items():
            print(f"  {name:16s} " + " ".join(f"{p['tokens_per_s_per_gpu']:8.0f} @{p['tokens_per_s_per_user'] or 0:6.1f}"
                                             f"{'*' if p['ttft_p99_s'] > TTFT_P99_LIMIT_S else ' '}" for p in found),
                  file=out)
        for target, best in case["at_user_targets"].items():
            text = {kind: "-" if value is None else f"{value:.0f}" for kind, value in best.items()}
            print(f"  at >= {target} tokens/s per user: aggregated {text['aggregated']}, disaggregated "
                  f"{text['disaggregated']} tokens/s per GPU (TTFT p99 <= {TTFT_P99_LIMIT_S:g} s; * marks points "
                  f"over it)", file=out)
    print("\npublished (large expert-parallel deployments, per decode GPU):", file=out)
    for figure in PUBLISHED:
        print(f"  {figure['output_tokens_per_s_per_gpu']:7.0f} tok/s/GPU  {figure['what']}\n"
              f"           {figure['source']}", file=out)
    summary = {"cases": cases, "published": PUBLISHED, "loads": LOADS, "pools": POOLS,
               "ttft_p99_limit_s": TTFT_P99_LIMIT_S, "requests_per_simulation": args.requests,
               "wall_s": round(time.perf_counter() - started, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "disaggregation.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
