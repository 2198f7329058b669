"""Verification suite: several workloads through the engine here and through the simulator calibrated
from a CPU profile; per-metric errors and a summary (median and largest absolute error).

By default each workload's weights/KV combination is profiled again just before it runs (a short sweep,
covering the steps these workloads form): this shared VM's speed drifts by up to 1.7x over hours, and
differently for different shapes, so a profile from another hour mostly measures the drift. Those
profiles, and so the engines that serve the workloads, run on one thread (`SUITE_THREADS`): a step that
waits for two threads on a 2-core VM is at the mercy of anything else that runs. `--profiles committed`
verifies the committed profiles as they are (with their own thread count).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from engine.harness.profiler import SweepPlan
from planner.simulation.workload import LengthDistribution, Workload
from planner.verification.comparison import TIMING_METRICS
from planner.verification.engine_run import engine_of
from planner.verification.verify import verify

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "planner" / "profiles"
RESULTS = REPO / "bench" / "results"
L = LengthDistribution
# (name, profile, workload, KV pool GiB). Below saturation but for the two meant to saturate: a prefill of
# 64-512 tokens takes ~0.6 s on one thread, so two such arrivals a second queue without end and a request's
# TTFT becomes the sum of every step before it, which amplifies a few percent of step-time error (and of the
# machine's drift) into tens of percent; at one a second TTFT measures the steps themselves.
SUITE = [
    ("light load", "fp32-kvbf16", Workload("poisson", 20, rate=0.5, prompt=L("fixed", 128), output=L("fixed", 32)), 0.25),
    ("saturating load", "fp32-kvbf16",
     Workload("poisson", 40, rate=8.0, prompt=L("uniform", low=64, high=256), output=L("fixed", 32), seed=1), 0.25),
    ("short prompts", "fp32-kvbf16", Workload("poisson", 30, rate=2.0, prompt=L("fixed", 16), output=L("fixed", 48)), 0.25),
    ("long prompts", "fp32-kvbf16", Workload("poisson", 16, rate=0.15, prompt=L("fixed", 1024), output=L("fixed", 16)),
     0.25),
    ("fp8 KV", "fp32-kvfp8", Workload("poisson", 30, rate=1.0, prompt=L("uniform", low=64, high=512),
                                      output=L("fixed", 32), seed=2), 0.25),
    ("native INT4 weights and fp8 KV", "native-kvfp8",
     Workload("poisson", 30, rate=1.0, prompt=L("uniform", low=64, high=512), output=L("fixed", 32), seed=3), 0.25),
    ("int4 weights", "int4-kvfp32", Workload("poisson", 30, rate=1.0, prompt=L("uniform", low=64, high=512),
                                             output=L("fixed", 32), seed=4), 0.25),
    ("memory-starved (preemptions)", "fp32-kvbf16",
     Workload("poisson", 30, rate=6.0, prompt=L("uniform", low=128, high=512), output=L("fixed", 64), seed=5), 0.05),
]
# Covers the steps the workloads form: prefills of one prompt of 16-1024 tokens and of several prompts that
# queued up behind a long step (up to the 2048-token budget), decode batches of every size class the batched
# matmul treats differently (its time per row is not smooth in the row count on this CPU), and decodes
# beside one prompt's or several prompts' prefill, as Poisson arrivals make them.
FRESH_SWEEP = SweepPlan(prefill_tokens=(16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024),
                        multi_prefills=((512, 2), (1024, 4), (1536, 8), (2048, 12)),
                        decode_batches=(1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48),
                        decode_contexts=(64, 128, 256, 512, 1024),
                        mixed=((1, 256, 128), (2, 256, 256), (4, 128, 64), (4, 512, 256), (8, 256, 128),
                               (8, 512, 512), (16, 256, 256), (16, 512, 128), (32, 256, 64),
                               (8, 256, 768, 3), (16, 256, 1024, 4), (24, 128, 2000, 12)),
                        warmup=1, repeats=3, max_kv_tokens=16384)
SUITE_THREADS = 1
SUMMARY_METRICS = ("peak_concurrency", "preemptions", "output_tokens_per_s", "ttft_p50_s", "ttft_p90_s",
                   "tpot_p50_s", "tpot_p90_s", "e2e_p50_s")


def summarize_errors(runs: list[dict], metrics_of, names) -> dict[str, dict[str, float]]:
    """Median and largest absolute error per metric over the runs."""
    summary = {}
    for metric in names:
        errors = [abs(m[metric]["error_pct"]) for m in map(metrics_of, runs) if m[metric]["error_pct"] is not None]
        if errors:
            summary[metric] = {"median_abs_error_pct": round(statistics.median(errors), 2),
                               "max_abs_error_pct": round(max(errors), 2)}
    return summary


def fresh_profile(committed: Path, out: Path) -> Path:
    """The committed profile's engine configuration, profiled again now."""
    from engine.harness.profiler import Profiler

    llm = engine_of(json.loads(committed.read_text())["fingerprint"], 1.0, max_num_batched_tokens=2048,
                    num_threads=SUITE_THREADS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(Profiler(llm, FRESH_SWEEP).run(), indent=1) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated workload names to run (default: all)")
    parser.add_argument("--profiles", choices=("fresh", "committed"), default="fresh",
                        help="profile each combination again just before its workload (default), or use the committed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [name for name, *_ in SUITE]
    chosen = names if args.only is None else [name.strip() for name in args.only.split(",")]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        parser.error(f"unknown workload {unknown[0]!r} (choose from {', '.join(names)})")
    out = sys.stderr if args.json else sys.stdout
    runs = []
    for name, profile, workload, gib in SUITE:
        if name not in chosen:
            continue
        path = PROFILES / f"cpu-smollm2-135m-{profile}.profile.json"
        if args.profiles == "fresh":
            slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
            path = fresh_profile(path, RESULTS / "verify_suite_profiles" / f"{slug}.profile.json")
        result = verify(str(path), workload, kv_cache_gib=gib)
        result["name"] = name
        result["profile"] = str(path.relative_to(REPO))
        runs.append(result)
        errors = {k: m["error_pct"] for k, m in result["metrics"].items()}
        print(f"{name:30s} " + " ".join(f"{k}={v:+.1f}%" if v is not None else f"{k}=-" for k, v in errors.items())
              + f" replay_same_batches={result['replay']['same_batches']}"
              + f" machine_slowdown={result['machine']['slowdown_vs_profile_pct']:+.1f}%"
              + " (locally {:+.1f}..{:+.1f}%)".format(*result["machine"]["local_slowdown_pct"])
              + f" step_model_at_that_speed={result['replay']['step_model_drift_corrected']['all']['total_error_pct']:+.1f}%"
              + f" cpu_steal={result['machine']['cpu_steal_pct']}%", file=out)
    summary = {"as calibrated": summarize_errors(runs, lambda r: r["metrics"], ("kv_capacity_tokens", *SUMMARY_METRICS)),
               "drift-corrected": summarize_errors(runs, lambda r: r["machine"]["metrics_drift_corrected"],
                                                   TIMING_METRICS)}
    slowdowns = [r["machine"]["slowdown_vs_profile_pct"] for r in runs]
    print(f"\nthe machine ran the profiles' steps {min(slowdowns):+.1f}%..{max(slowdowns):+.1f}% slower than when "
          "they were profiled", file=out)
    print(f"\n{'metric':22s} {'median |error|':>15s} {'max |error|':>12s} {'drift-corrected: median':>24s} {'max':>7s}",
          file=out)
    for metric, row in summary["as calibrated"].items():
        fixed = summary["drift-corrected"].get(metric)
        tail = f" {fixed['median_abs_error_pct']:23.1f}% {fixed['max_abs_error_pct']:6.1f}%" if fixed else ""
        print(f"{metric:22s} {row['median_abs_error_pct']:14.1f}% {row['max_abs_error_pct']:11.1f}%" + tail, file=out)
    RESULTS.mkdir(exist_ok=True)
    # a partial run (--only) does not overwrite the whole suite's record
    (RESULTS / ("verify_suite_partial.json" if args.only else "verify_suite.json")).write_text(json.dumps({"profiles": args.profiles, "summary": summary,
                                                           "runs": runs}, indent=1) + "\n")
    if args.json:
        print(json.dumps({"summary": summary, "workloads": [r["name"] for r in runs]}))


if __name__ == "__main__":
    main()
