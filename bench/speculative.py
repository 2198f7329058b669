"""Speculative decoding: the engine's tokens/s with and without prompt-lookup drafts, and the planner's curve.

Engine (SmolLM2-135M, fp32, CPU): B requests whose prompts say a text twice (prompt lookup finds what comes
next), 48 greedy tokens each, generated with and without `ngram:4`, both engines timed alternately, best of
`--repeats`; the same tokens both ways (checked). Planner: DeepSeek-V3 and GLM 5.2 (fp8 weights) on 8 x H200
with MTP drafts (the DeepSeek-V3 report's 0.875 acceptance for one draft; 0.8 a position for three), decode
tokens/s by batch with and without, and the batch at which speculation stops paying.

    python bench/speculative.py --json      # ~3 minutes on a 2-core VM; writes bench/results/speculative.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.core.reference_text import cut_prompts, reference_ids
from engine.core.sequence import SamplingParams
from engine.llm import LLM
from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.speculative_plan import speculative_gain
from planner.simulation.speculation import Speculation

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUT_TOKENS = 48
PLANNER_CASES = (("deepseek-v3", "native", "mtp:1", None), ("deepseek-v3", "native", "mtp:3", "0.8"),
                 ("glm-5.2", "fp8", "mtp:1", None), ("glm-5.2", "fp8", "mtp:3", "0.8"))


def repeating_prompts(llm: LLM, count: int) -> list[list[int]]:
    """Prompts of 40-100 tokens, each a piece of English text said twice."""
    ids = reference_ids(llm.tokenizer, llm.model_config.vocab_size, 200 * count)
    halves = cut_prompts(ids, [20 + (index * 7) % 31 for index in range(count)])
    return [half + half for half in halves]


def timed(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    return time.perf_counter() - started, [result.token_ids for result in results]


def engine_rows(batches: list[int], repeats: int) -> list[dict]:
    plain = LLM(model="smollm2-135m", device="cpu")
    drafted = LLM(model="smollm2-135m", device="cpu", speculative="ngram:4")
    rows = []
    for batch in batches:
        prompts = repeating_prompts(plain, batch)
        timed(plain, prompts[:1]), timed(drafted, prompts[:1])       # warm-up
        before = drafted.stats()
        best = {"plain": float("inf"), "drafted": float("inf")}
        for _ in range(repeats):
            seconds, tokens = timed(plain, prompts)
            best["plain"] = min(best["plain"], seconds)
            seconds, drafted_tokens = timed(drafted, prompts)
            best["drafted"] = min(best["drafted"], seconds)
            if drafted_tokens != tokens:
                raise SystemExit(f"batch {batch}: drafted tokens differ from plain decoding")
        drafts = drafted.stats().draft_tokens - before.draft_tokens
        generated = batch * OUTPUT_TOKENS
        rows.append({"batch": batch, "plain_tokens_per_s": round(generated / best["plain"], 2),
                     "drafted_tokens_per_s": round(generated / best["drafted"], 2),
                     "speedup": round(best["plain"] / best["drafted"], 3),
                     "acceptance_rate": round((drafted.stats().accepted_tokens - before.accepted_tokens) / drafts, 3) if drafts else None})
    return rows


def planner_rows() -> list[dict]:
    rows = []
    for model, weights, speculative, acceptance in PLANNER_CASES:
        capacity = evaluate(Deployment(model=model, hardware="h200", gpus=8, weights=weights, kv_dtype="fp8"))
        gain = speculative_gain(capacity, Speculation.parse(speculative, acceptance))
        rows.append({"model": model, "weights": weights, **gain.summary()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = sys.stderr if args.json else sys.stdout
    engine = engine_rows(args.batches, args.repeats)
    print("engine, SmolLM2-135M fp32 on CPU, prompt lookup ngram:4, 48 tokens a request", file=out)
    print(f"{'batch':>6} {'plain tok/s':>12} {'drafted tok/s':>14} {'speed-up':>9} {'acceptance':>11}", file=out)
    for row in engine:
        print(f"{row['batch']:>6} {row['plain_tokens_per_s']:>12} {row['drafted_tokens_per_s']:>14} "
              f"{row['speedup']:>9} {row['acceptance_rate']!s:>11}", file=out)
    planner = planner_rows()
    print("\nplanner, 8 x H200, MTP drafts: decode tokens/s per replica by batch (plain -> speculative)", file=out)
    for row in planner:
        curve = ", ".join(f"{point['batch']}: {point['plain']:.0f}->{point['speculative']:.0f}"
                          for point in row["decode_tokens_per_s_by_batch"])
        print(f"{row['model']} {row['weights']} {row['config']}: single stream x{row['single_stream_speedup']}, stops "
              f"paying at batch {row['stops_paying_at_batch']}; {curve}", file=out)
    result = {"engine": engine, "planner": planner}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculative.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
