"""Prefills over a cached prefix, measured and predicted: does the step model, fitted to a profile's fresh prompts,
decodes and mixed steps, price a prompt's chunk whose attention also reads cached KV (a prefix-cache hit, a long
prompt's later chunk)? TTFT under a shared system prompt or a chunked long prompt rests on it.

One profile of SmolLM2-135M on this CPU, made here and now (a profile from another hour of a shared VM would carry
that hour's speed): the usual sweep plus `prefix` points (N new tokens after C cached ones, `engine profile`'s
sample kind). The step model is fitted to every sample but the prefix ones, then predicts each prefix sample; the
table sets measured beside predicted, and what the cached tokens add to a fresh prompt of the same N tokens. Then
the fit over every sample, prefix ones included: its error by kind says whether one step model holds for both.

    python bench/prefix_prefill.py          # ~5 minutes on a 2-core VM; writes bench/results/prefix_prefill.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from engine.harness.profiler import Profiler, SweepPlan
from engine.llm import LLM
from planner.calibration.parameters import Calibration
from planner.calibration.profile_fit import calibrate
from planner.cost.step_model import BatchShape
from planner.verification.verify import profile_step_time

RESULTS = Path(__file__).resolve().parent / "results"
PREFIXES = ((64, 1024), (64, 4096), (256, 2048), (512, 512), (512, 4096), (1024, 1024))
SWEEP = SweepPlan(prefill_tokens=(16, 64, 128, 256, 512, 1024), multi_prefills=((256, 4),),
                  decode_batches=(1, 4, 16), decode_contexts=(128, 512, 2048, 4096),
                  mixed=((4, 256, 64), (8, 512, 256), (16, 128, 512)), prefix_prefills=PREFIXES, warmup=1, repeats=3)


def compare(profile: dict[str, Any]) -> dict[str, Any]:
    """Fits the non-prefix samples; predicts the prefix ones and the fresh prompts of the same new tokens."""
    fitted = {**profile, "samples": [s for s in profile["samples"] if s["kind"] != "prefix"]}
    model = profile_step_time(Calibration.of(calibrate(fitted, 1e9)), fitted)
    fresh = {s["batch"]["prefill_tokens"]: s["median_s"] for s in fitted["samples"]
             if s["kind"] == "prefill" and s["batch"]["num_prefills"] == 1}
    rows = []
    for sample in (s for s in profile["samples"] if s["kind"] == "prefix"):
        tokens, cached = Profiler.point_of(sample)
        predicted = model.step_seconds(BatchShape(**sample["batch"]))
        fresh_predicted = model.step_seconds(BatchShape(num_prefills=1, prefill_tokens=tokens,
                                                        prefill_pairs=tokens * (tokens + 1) // 2,
                                                        prefill_context_tokens=tokens))
        rows.append({"new_tokens": tokens, "cached_tokens": cached, "measured_s": sample["median_s"],
                     "predicted_s": round(predicted, 6), "error_pct": round(100 * (predicted / sample["median_s"] - 1), 1),
                     "measured_over_fresh": round(sample["median_s"] / fresh[tokens], 3) if tokens in fresh else None,
                     "predicted_over_fresh": round(predicted / fresh_predicted, 3)})
    errors = [abs(row["error_pct"]) for row in rows]
    together = calibrate(profile, 1e9)
    return {"rows": rows, "median_abs_error_pct": round(float(np.median(errors)), 1),
            "largest_abs_error_pct": max(errors), "fitted_samples": len(fitted["samples"]),
            "fitted_with_prefix_points": {key: value for key, value in together.get("measured_linears",
                                                                                    together).items()
                                          if key.startswith(("mape", "holdout"))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()
    with LLM(model="smollm2-135m", weights="fp32", kv_dtype="bf16", device="cpu", num_pages=640, page_size=16,
             max_num_seqs=16, max_num_batched_tokens=1024, integrity="off") as llm:
        profile = Profiler(llm, SWEEP).run()
    result = {"engine": "smollm2-135m fp32 / KV bf16, CPU", **compare(profile)}
    print(f"{'new':>6s} {'cached':>7s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s} "
          f"{'x fresh (meas / pred)':>22s}", file=sys.stderr)
    for row in result["rows"]:
        ratio = f"{row['measured_over_fresh']} / {row['predicted_over_fresh']}"
        print(f"{row['new_tokens']:6d} {row['cached_tokens']:7d} {row['measured_s'] * 1e3:12.2f} "
              f"{row['predicted_s'] * 1e3:13.2f} {row['error_pct']:+6.1f}% {ratio:>22s}", file=sys.stderr)
    print(f"median |error| {result['median_abs_error_pct']}%, largest {result['largest_abs_error_pct']}%",
          file=sys.stderr)
    print("fitted with the prefix points too, mean |error| by kind: " + ", ".join(
        f"{key} {value}%" for key, value in result["fitted_with_prefix_points"].items()), file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_prefill.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
