"""What the multi-GPU terms of the step model change: the reference models on 8 H200s, before and after.

For Llama-3.1-70B, DeepSeek-V3, Kimi K2.6 and GLM 5.2 (FP8 weights, FP8 KV, 8192-token requests, all eight GPUs
in one tensor-parallel group, the catalogue's defaults: no calibration exists for an H200 yet) it prints and
writes:
- single-stream decode and saturated decode (the largest batch the KV pool holds, at most 256) in tokens/s,
  before (no communication, one device's step on each GPU) and after (the step's collectives: latency with
  CUDA graphs, ring bytes over NVLink), and with CUDA graphs off (every kernel launched: `--cuda-graphs off`);
- each part's share of the step (`planner.cost.step_model.STEP_PARTS`) at batch 1 and at batch 64;
- the INT4-vs-FP8 single-stream speed-up, and DeepSeek-V3 with its experts spread over the GPUs (expert
  parallelism: the most-loaded GPU sets each layer's pace).
Before = after less the communication part: the other new terms are zero on one device and with CUDA graphs.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from planner.cost.step_model import STEP_PARTS, BatchShape
from planner.deployment.capacity import Capacity, Deployment, evaluate

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("llama-3.1-70b", "deepseek-v3", "kimi-k2.6", "glm-5.2")
CONTEXT = 8192
SHARE_BATCHES = (1, 64)


def decode_seconds(capacity: Capacity, batch: int) -> tuple[float, float]:
    """(after, before) seconds of a decode step of `batch` sequences at the deployment's context."""
    shape = BatchShape.of([capacity.deployment.context] * batch, [])
    parts = capacity.step_parts(shape)
    after = sum(parts.values())
    return after, after - parts["communication"]


def row(deployment: Deployment) -> dict:
    capacity = evaluate(deployment)
    eager = evaluate(replace(deployment, cuda_graphs=False))
    single, single_before = decode_seconds(capacity, 1)
    batch = capacity.decode_batch
    saturated, saturated_before = decode_seconds(capacity, batch)
    shares = {}
    for size in SHARE_BATCHES:
        parts = capacity.step_parts(BatchShape.of([deployment.context] * size, []))
        total = sum(parts.values())
        shares[size] = {part: round(100 * parts[part] / total, 1) for part in STEP_PARTS
                        if round(100 * parts[part] / total, 1)}
    return {"model": deployment.model, "weights": deployment.weights, "expert_parallel": deployment.expert_parallel,
            "decode_batch": batch,
            "single_stream_before": round(1 / single_before, 1), "single_stream_after": round(1 / single, 1),
            "single_stream_eager": round(eager.single_stream_tokens_per_s, 1),
            "saturated_before": round(batch / saturated_before, 1), "saturated_after": round(batch / saturated, 1),
            "communication_ms_batch_1": round(1e3 * capacity.step_parts(BatchShape.of([deployment.context], []))
                                              ["communication"], 3),
            "shares_pct": shares}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "multi_gpu_plan.json"))
    args = parser.parse_args(argv)
    rows = []
    for model in MODELS:
        base = Deployment(model=model, hardware=args.hardware, gpus=args.gpus, weights="fp8", kv_dtype="fp8",
                          context=CONTEXT)
        fp8, int4 = row(base), row(replace(base, weights="int4"))
        fp8["int4_single_stream_speedup"] = round(int4["single_stream_after"] / fp8["single_stream_after"], 3)
        rows += [fp8, int4]
    rows.append(row(Deployment(model="deepseek-v3", hardware=args.hardware, gpus=args.gpus, weights="fp8",
                               kv_dtype="fp8", context=CONTEXT, expert_parallel=True)))
    print(f"{'model':16s} {'weights':7s} {'EP':3s} {'1 stream before/after/eager tok/s':>34s} "
          f"{'saturated before/after tok/s (batch)':>38s}  shares at batch 1 | 64 (%)")
    for r in rows:
        shares = " | ".join(", ".join(f"{k} {v}" for k, v in r["shares_pct"][size].items()) for size in SHARE_BATCHES)
        print(f"{r['model']:16s} {r['weights']:7s} {'yes' if r['expert_parallel'] else 'no':3s} "
              f"{r['single_stream_before']:>10.1f} / {r['single_stream_after']:>6.1f} / {r['single_stream_eager']:>6.1f}"
              f"      {r['saturated_before']:>9.1f} / {r['saturated_after']:>8.1f} ({r['decode_batch']:>3d})"
              f"          {shares}")
    for r in rows:
        if "int4_single_stream_speedup" in r:
            print(f"{r['model']}: INT4 vs FP8 single stream {r['int4_single_stream_speedup']:.3f}x")
    Path(args.out).write_text(json.dumps({"hardware": args.hardware, "gpus": args.gpus, "context": CONTEXT,
                                          "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
