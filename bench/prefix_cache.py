"""Prefix caching through `engine serve`, with and without, beside the planner's prediction of the same.

Two workloads of SmolLM2-135M on this CPU, each served by a server subprocess with prefix caching and by one
with `--no-prefix-caching`, driven by the official `openai` async client over loopback HTTP:

    multi-turn      conversations of several turns: each turn's prompt is the conversation so far (as text: the
                    earlier prompts and answers) plus a new message; the next turn is sent when the answer is in
    shared-system   Poisson arrivals of requests that open with the same long system prompt

For each: TTFT p50/p90, output tokens/s, and the prefix-cache hit rate from `/metrics`; then the planner's
simulator (the engine's scheduler and block manager, the step model calibrated on a profile of this engine made
first, here and now: a profile from another hour of a shared VM would carry that hour's speed) on requests of
the token counts the server reported, with the same sharing, with and without caching; and, cached, with the step
model fitted without the profile's prefills over a cached prefix (as profiles were before they had them).

    python bench/prefix_cache.py            # ~6 minutes on a 2-core VM; writes bench/results/prefix_cache.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from engine.core.config import SchedulerConfig
from engine.core.metrics import RequestTiming, summarize
from engine.core.reference_text import reference_text
from engine.harness.launch import serve_subprocess
from planner.calibration.parameters import Calibration
from planner.calibration.profile_fit import calibrate, load_profile
from planner.endpoint.client import server_shape
from planner.simulation.simulator import Simulation
from planner.simulation.workload import TOKEN_IDS, RequestSpec
from planner.verification.verify import profile_step_time

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MODEL = "smollm2-135m"
KV_GIB = 0.25
ENGINE_FLAGS = ["--model", MODEL, "--weights", "fp32", "--kv-dtype", "bf16", "--device", "cpu", "--threads", "1",
                "--page-size", "16"]
SERVE_FLAGS = ENGINE_FLAGS + ["--memory-gib", str(KV_GIB)]
PROFILE_FLAGS = ["--memory-gib", "1", "--prefill-tokens", "16", "64", "128", "256", "512", "1024",
                 "--batches", "1", "2", "4", "8", "16", "--contexts", "64", "128", "256", "512", "--repeats", "2"]
METRICS = ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s")


def texts(count: int, words: int, offset: int) -> list[str]:
    """`count` passages of about `words` words of real English, each its own."""
    all_words = reference_text().split()
    return [" ".join(all_words[offset + i * words:offset + (i + 1) * words]) for i in range(count)]


def cache_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        samples = {sample.name: sample.value for family in text_string_to_metric_families(response.read().decode())
                   for sample in family.samples}
    return samples["kvplan_prefix_cache_queries_total"], samples["kvplan_prefix_cache_hits_total"]


class Recorder:
    """Streams completions and keeps, per request, what the simulator needs and what a user saw."""

    def __init__(self, url: str) -> None:
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        self.origin = time.perf_counter()
        self.rows: list[dict[str, Any]] = []

    async def complete(self, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
        sent = time.perf_counter() - self.origin
        first, text, usage = None, [], None
        stream = await self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0.0, stream=True, extra_body={"ignore_eos": True},
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.text and first is None:
                    first = time.perf_counter() - self.origin
                text.append(choice.text)
        row = {"sent_s": sent, "first_s": first, "end_s": time.perf_counter() - self.origin,
               "prompt_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
               "cached_tokens": usage.prompt_tokens_details.cached_tokens}
        self.rows.append(row)
        return "".join(text), row

    def timings(self) -> list[RequestTiming]:
        return [RequestTiming(i, row["sent_s"], row["prompt_tokens"], row["output_tokens"], row["first_s"],
                              row["end_s"]) for i, row in enumerate(self.rows)]


async def multi_turn(url: str, conversations: int, turns: int, max_tokens: int) -> Recorder:
    recorder = Recorder(url)
    messages = texts(conversations * turns, 60, 0)

    async def converse(index: int) -> None:
        await asyncio.sleep(index * 0.5)
        transcript = ""
        for turn in range(turns):
            prompt = transcript + messages[index * turns + turn]
            answer, row = await recorder.complete(prompt, max_tokens)
            row.update(conversation=index, turn=turn)
            transcript = prompt + answer + "\n"
    await asyncio.gather(*(converse(i) for i in range(conversations)))
    await recorder.client.close()
    return recorder


async def shared_system(url: str, requests: int, rate: float, max_tokens: int, seed: int) -> Recorder:
    recorder = Recorder(url)
    system = texts(1, 250, 5000)[0] + "\n"
    questions = texts(requests, 20, 9000)
    gaps = np.random.default_rng(seed).exponential(1 / rate, requests)

    async def ask(index: int, at: float) -> None:
        await asyncio.sleep(at)
        await recorder.complete(system + questions[index], max_tokens)
    await asyncio.gather(*(ask(i, float(at)) for i, at in enumerate(np.cumsum(gaps))))
    await recorder.client.close()
    return recorder


def served(workload: str, caching: bool, args: argparse.Namespace) -> dict[str, Any]:
    flags = SERVE_FLAGS + ([] if caching else ["--no-prefix-caching"])
    with serve_subprocess(flags) as url:
        capacity = server_shape(url).capacity_tokens
        before = cache_counters(url)
        if workload == "multi-turn":
            recorder = asyncio.run(multi_turn(url, args.conversations, args.turns, args.max_tokens))
        else:
            recorder = asyncio.run(shared_system(url, args.requests, args.rate, args.max_tokens, args.seed))
        after = cache_counters(url)
    queried, hits = after[0] - before[0], after[1] - before[1]
    report = summarize(recorder.timings())
    return {"rows": recorder.rows, "capacity_tokens": capacity, "hit_rate": hits / queried if queried else 0.0,
            **{name: report[name] for name in METRICS}}


def specs_of(workload: str, rows: list[dict[str, Any]], seed: int) -> list[RequestSpec]:
    """The served requests for the simulator: their token counts as the server reported them, their sharing as
    the workload made it (a conversation's transcript; the system prompt, as its cached share says)."""
    rng = np.random.default_rng(seed)

    def ids(count: int) -> tuple[int, ...]:
        return tuple(rng.integers(*TOKEN_IDS, max(1, count)).tolist())

    specs: list[RequestSpec] = []
    if workload == "multi-turn":
        last: dict[int, RequestSpec] = {}
        previous_row: dict[int, dict[str, Any]] = {}
        for row in sorted(rows, key=lambda r: (r["conversation"], r["turn"])):
            index = len(specs)
            before = last.get(row["conversation"])
            if before is None:
                spec = RequestSpec(index, row["sent_s"], row["prompt_tokens"], row["output_tokens"],
                                   ids(row["prompt_tokens"]))
            else:
                transcript = before.prompt_tokens + before.output_tokens
                think = row["sent_s"] - previous_row[row["conversation"]]["end_s"]
                spec = RequestSpec(index, None, row["prompt_tokens"], row["output_tokens"],
                                   ids(row["prompt_tokens"] - transcript), before.request_id, max(0.0, think))
            last[row["conversation"]], previous_row[row["conversation"]] = spec, row
            specs.append(spec)
        return specs
    shared = max(row["cached_tokens"] for row in rows)      # the system prompt's full pages
    system = ids(shared)
    for index, row in enumerate(sorted(rows, key=lambda r: r["sent_s"])):
        specs.append(RequestSpec(index, row["sent_s"], row["prompt_tokens"], row["output_tokens"],
                                 system + ids(row["prompt_tokens"] - shared)))
    return specs


def make_profile(folder: Path) -> Path:
    path = folder / "profile.json"
    made = subprocess.run([sys.executable, "-m", "engine.cli", "profile", *ENGINE_FLAGS, *PROFILE_FLAGS,
                           "--out", str(path), "--json"], capture_output=True, text=True, cwd=REPO)
    if made.returncode != 0:
        raise SystemExit(f"engine profile failed: {made.stderr.strip()[-300:]}")
    return path


def predicted(specs: list[RequestSpec], caching: bool, capacity_tokens: int, profile_path: Path,
              prefix_points: bool = True) -> dict[str, Any]:
    """The simulator on the profile's calibration; `prefix_points` False: fitted without the profile's prefills over
    a cached prefix, as every profile was before they were timed."""
    profile = load_profile(profile_path)
    if not prefix_points:
        profile = {**profile, "samples": [s for s in profile["samples"] if s["kind"] != "prefix"]}
    model = profile_step_time(Calibration.of(calibrate(profile, 1e9)), profile)
    config = SchedulerConfig(num_pages=capacity_tokens // 16, page_size=16, max_model_len=8192,
                             enable_prefix_caching=caching)
    result = Simulation(config, model).run(specs)
    report = result.report()
    return {"hit_rate": report["prefix_cache_hit_rate"], "cached_tokens": sum(t.cached_tokens for t in result.timings),
            **{name: report[name] for name in METRICS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16, help="shared-system: requests")
    parser.add_argument("--rate", type=float, default=0.5, help="shared-system: requests per second")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None,
                        help="an `engine profile` of the same flags (default: made first, ~2.5 minutes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory()
    profile = args.profile or make_profile(Path(scratch.name))
    results: dict[str, Any] = {"engine": {"flags": SERVE_FLAGS}, "profile": str(args.profile or "made first"),
                               "workloads": {}}
    for workload in ("multi-turn", "shared-system"):
        runs = {label: served(workload, caching, args) for label, caching in (("cached", True), ("uncached", False))}
        specs = specs_of(workload, runs["cached"]["rows"], args.seed)
        planner = {label: predicted(specs, caching, runs["cached"]["capacity_tokens"], profile)
                   for label, caching in (("cached", True), ("uncached", False))}
        without = predicted(specs, True, runs["cached"]["capacity_tokens"], profile, prefix_points=False)
        results["workloads"][workload] = {
            "engine": {label: {k: v for k, v in run.items() if k != "rows"} for label, run in runs.items()},
            "planner": planner, "requests": len(specs),
            "planner_cached_fitted_without_prefix_points": {name: without[name] for name in METRICS},
            "cached_tokens": {"engine": sum(r["cached_tokens"] for r in runs["cached"]["rows"]),
                              "planner": planner["cached"].pop("cached_tokens")},
            "ttft_p50_speedup": {"engine": runs["uncached"]["ttft_p50_s"] / runs["cached"]["ttft_p50_s"],
                                 "planner": planner["uncached"]["ttft_p50_s"] / planner["cached"]["ttft_p50_s"]}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefix_cache.json").write_text(json.dumps(results, indent=1) + "\n")
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'workload':14s} {'run':9s} {'source':8s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'out tok/s':>9s} "
          f"{'hit rate':>8s}")
    for workload, result in results["workloads"].items():
        for label in ("cached", "uncached"):
            for source in ("engine", "planner"):
                row = result[source][label]
                print(f"{workload:14s} {label:9s} {source:8s} {row['ttft_p50_s']:9.3f} {row['ttft_p90_s']:9.3f} "
                      f"{row['output_tokens_per_s']:9.1f} {row['hit_rate']:8.1%}")
        without = result["planner_cached_fitted_without_prefix_points"]
        print(f"{workload:14s} {'cached':9s} {'planner, fitted without prefix points':37s} "
              f"{without['ttft_p50_s']:9.3f} {without['ttft_p90_s']:9.3f} {without['output_tokens_per_s']:9.1f}")
        speedup = result["ttft_p50_speedup"]
        print(f"{workload}: TTFT p50 {speedup['engine']:.2f}x faster with caching (planner: {speedup['planner']:.2f}x)")


if __name__ == "__main__":
    main()
