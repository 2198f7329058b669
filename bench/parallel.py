"""Tensor parallelism on CPU: one rank against two, the share of the step spent in collectives, and the
step model's prediction of each point.

The model is a random Llama-shaped config big enough that a step is more than its collectives (hidden 1024,
16 heads, 8 KV heads, 8 layers, vocabulary 32000; fp32, one thread a rank). Each engine is profiled with a
short sweep (prefill 64-512, decode batches 1-16 at contexts 128-512); the calibration of that profile (its
collectives fitted to the time spent inside them under TP=2) predicts the three points reported: decode
batch 1 and 16 at context 256, and a prefill of 512 tokens. On a 2-core machine the two ranks share the
cores with nothing else: run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from engine.harness.profiler import Profiler, SweepPlan
from engine.llm import LLM
from planner.calibration.parameters import Calibration
from planner.calibration.profile_fit import calibrate, profile_costs
from planner.cost.step_model import BatchShape, step_time

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": [1]}
SWEEP = SweepPlan(prefill_tokens=(64, 128, 256, 512), multi_prefills=(), decode_batches=(1, 2, 4, 8, 16),
                  decode_contexts=(128, 256, 512), mixed=((4, 256, 128), (8, 256, 256)), warmup=1, repeats=3)
REPORTED = {"decode batch 1": ("decode", 1, 0), "decode batch 16": ("decode", 16, 0),
            "prefill 512": ("prefill", 0, 512)}


def profile(config_path: str, ranks: int) -> dict:
    with LLM(model=config_path, num_threads=1, kv_cache_gib=0.25, tensor_parallel=ranks,
             max_num_batched_tokens=2048) as llm:
        return Profiler(llm, SWEEP).run()


def reported_points(document: dict) -> dict[str, dict]:
    """The reported points of a profile, each with the calibrated step model's prediction."""
    calibration = Calibration.of(calibrate(document, max_mape=1e9))
    costs = profile_costs(document["model"])
    rows = {}
    for label, (kind, decodes, prefill) in REPORTED.items():
        sample = next(s for s in document["samples"] if s["kind"] == kind and s["batch"]["num_decodes"] == decodes
                      and s["batch"]["prefill_tokens"] == prefill
                      and (kind != "decode" or s["batch"]["decode_max_context"] == 257))
        predicted = step_time(costs, calibration.peaks, calibration.parameters, BatchShape(**sample["batch"]))
        rows[label] = {"measured_s": sample["median_s"], "collective_s": sample.get("collective_s", 0.0),
                       "collective_share": sample.get("collective_s", 0.0) / sample["median_s"],
                       "predicted_s": predicted, "error_pct": round(100 * (predicted / sample["median_s"] - 1), 2)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "parallel.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(CONFIG))
        results = {ranks: reported_points(profile(str(path), ranks)) for ranks in (1, 2)}
    print(f"{'point':18s} {'TP=1 ms':>9s} {'TP=2 ms':>9s} {'speed-up':>9s} {'collectives':>12s} "
          f"{'model err TP=1':>15s} {'TP=2':>7s}", file=sys.stderr)
    for label in REPORTED:
        one, two = results[1][label], results[2][label]
        print(f"{label:18s} {one['measured_s'] * 1e3:9.2f} {two['measured_s'] * 1e3:9.2f} "
              f"{one['measured_s'] / two['measured_s']:8.2f}x {100 * two['collective_share']:11.1f}% "
              f"{one['error_pct']:+14.1f}% {two['error_pct']:+6.1f}%", file=sys.stderr)
    payload = {"model": CONFIG, "threads_per_rank": 1, "points": {f"tp{ranks}": rows for ranks, rows in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    if args.json:
        print(json.dumps(payload))


if __name__ == "__main__":
    main()
