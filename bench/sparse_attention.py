"""Sparse attention (DSA) on CPU: decode time against context below and above `index_topk`, as the engine
measures it and as the calibrated step model predicts it.

The model has GLM 5.2's architecture (MLA + MoE + DSA, its first 8 layers' indexer types: 4 with their own
indexer) narrowed for a CPU (hidden 512, 16 heads, latent 512 + rope 64, 16 experts of 256, indexer 8 heads of
128) with `index_topk` 512, random fp32 weights, one thread. It is profiled at decode contexts 128-8192 (and
prefills and mixed steps around index_topk), the profile calibrated, and the decode steps of batch 1 and 4
reported: their growth per 1,000 tokens of context below and above index_topk, measured and modelled, and the
model's error in each of the two regimes. Run it on an otherwise idle machine (about 4 minutes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from engine.harness.profiler import Profiler, SweepPlan
from engine.llm import LLM
from planner.calibration.parameters import Calibration
from planner.calibration.profile_fit import calibrate, profile_costs
from planner.cost.step_model import BatchShape, step_time

RESULTS = Path(__file__).resolve().parent / "results"
INDEX_TOPK = 512
CONFIG = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 8192,
          "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 8,
          "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 16, "n_shared_experts": 1,
          "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 256,
          "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
          "max_position_embeddings": 16384, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
          "index_topk": INDEX_TOPK, "index_head_dim": 128, "index_n_heads": 8,
          "indexer_types": ["full", "full", "full", "shared", "shared", "shared", "full", "shared"],
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": [1]}
CONTEXTS = (128, 256, 384, 511, 1024, 2048, 4096, 8192)      # 511: a decode then sees index_topk tokens
BATCHES = (1, 4)
SWEEP = SweepPlan(prefill_tokens=(64, 256, 512, 1024, 2048), multi_prefills=((1024, 2),), decode_batches=BATCHES,
                  decode_contexts=CONTEXTS, mixed=((4, 256, 256), (4, 1024, 256), (2, 4096, 128), (8, 512, 512)),
                  warmup=1, repeats=3, max_kv_tokens=40000)


def profile(config_path: str) -> dict:
    llm = LLM(model=config_path, weights="fp32", num_threads=1, kv_cache_gib=1.0, max_num_batched_tokens=2048)
    return Profiler(llm, SWEEP).run()


def slope_ms_per_1k(points: list[tuple[int, float]]) -> float:
    """Least-squares growth of a step's seconds per 1,000 tokens of context, in milliseconds."""
    contexts, seconds = zip(*points)
    mean_c, mean_s = statistics.fmean(contexts), statistics.fmean(seconds)
    covariance = sum((c - mean_c) * (s - mean_s) for c, s in points)
    return 1e6 * covariance / sum((c - mean_c) ** 2 for c in contexts)


def report(document: dict, calibration: dict) -> dict:
    """The decode steps of the reported batches, measured and modelled (the physical fit, and the fit with the
    profile's measured linears, as verification uses it), their growth with context and the error by regime."""
    fitted = Calibration.of(calibration, "the fit")
    costs = profile_costs(document["model"])
    models = {"physical": (fitted.parameters, None)}
    if fitted.linears is not None:
        models["measured linears"] = (fitted.measured_parameters, fitted.linears)
    rows = []
    for sample in document["samples"]:
        batch = sample["batch"]
        if sample["kind"] == "decode" and batch["num_decodes"] in BATCHES:
            row = {"batch": batch["num_decodes"], "context": batch["decode_max_context"],
                   "measured_ms": round(1e3 * sample["median_s"], 2)}
            for name, (params, linears) in models.items():
                row[f"{name} ms"] = round(1e3 * step_time(costs, fitted.peaks, params, BatchShape(**batch), linears), 2)
            rows.append(row)
    regimes = {"below index_topk": lambda c: c <= INDEX_TOPK, "above index_topk": lambda c: c > INDEX_TOPK}
    growth, errors = {}, {}
    for regime, keep in regimes.items():
        chosen = [row for row in rows if keep(row["context"])]
        errors[regime] = {name: round(statistics.fmean(abs(row[f"{name} ms"] / row["measured_ms"] - 1) * 100
                                                       for row in chosen), 2) for name in models}
        for size in BATCHES:
            points = [row for row in chosen if row["batch"] == size]
            growth[f"batch {size} {regime}"] = {
                column: round(slope_ms_per_1k([(row["context"], row[column] / 1e3) for row in points]), 3)
                for column in ("measured_ms", *(f"{name} ms" for name in models))}
    return {"index_topk": INDEX_TOPK, "decode_steps": rows, "growth_ms_per_1k_tokens": growth,
            "mean_abs_error_pct_by_regime": errors,
            "calibration_mape_pct": {kind: calibration[f"mape_{kind}_pct"] for kind in ("prefill", "decode", "mixed")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "sparse_attention_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config_path = Path(folder) / "glm-5.2-narrow.json"
        config_path.write_text(json.dumps(CONFIG))
        document = profile(str(config_path))
    result = report(document, calibrate(document, max_mape=1e9))
    out = sys.stderr if args.json else sys.stdout
    columns = ("measured_ms", *(name for name in result["decode_steps"][0] if name.endswith(" ms")))
    print(f"{'batch':>5s} {'context':>8s} " + " ".join(f"{c:>20s}" for c in columns), file=out)
    for row in result["decode_steps"]:
        print(f"{row['batch']:5d} {row['context']:8d} " + " ".join(f"{row[c]:20.2f}" for c in columns), file=out)
    print(f"\n{'growth, ms per 1k tokens of context':40s} " + " ".join(f"{c:>20s}" for c in columns), file=out)
    for name, growth in result["growth_ms_per_1k_tokens"].items():
        print(f"{name:40s} " + " ".join(f"{growth[c]:20.3f}" for c in columns), file=out)
    print(f"\nmean |error| of the decode steps by regime: {result['mean_abs_error_pct_by_regime']}; "
          f"calibration MAPE {result['calibration_mape_pct']}", file=out)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
