"""Integrity checks on the real model: their step-time cost, and a fault campaign.

Overhead: three engines (integrity off, ownership, full) decode the same requests in lockstep; their
steps are timed interleaved in a shuffled order every repetition, and the medians are compared as
ratios. Besides that end-to-end ratio (noisy on a shared VM) the time spent inside the checks is timed
directly, as a share of the step. `full` is reported verifying every sealed page per step and a sample.

Campaign: every fault kind injected at a random moment into a mixed batch of 16 requests, many trials,
in the modes that cover it; counted: injected, detected, requests harmed (tokens differing from a
fault-free run, or a victim receiving a token after the fault), pages leaked.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.faults import DETECTED_IN, FAULT_KINDS, run_trial
from engine.llm import LLM
from engine.sequence import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_TOKENS = 128
SAMPLED_PAGES = 8
MODES = (("off", {}), ("ownership", {}), ("full", {}), ("full sampled", {"integrity_sample_pages": SAMPLED_PAGES}))


def english_ids(llm: LLM) -> list[int]:
    from pydoc_data.topics import topics

    return llm.tokenizer.encode(" ".join(topics[key] for key in sorted(topics)[:60]))


class CheckTimer:
    """Times the checker's per-step work (check before, seal after) on one engine."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        for name in ("check", "seal"):
            method = getattr(llm.integrity, name)
            setattr(llm.integrity, name, self._timed(method))

    def _timed(self, method):
        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def overhead(batch: int, steps: int, kv_gib: float) -> dict:
    engines = {label: LLM(model="smollm2-135m", kv_cache_gib=kv_gib, integrity=label.split()[0], **extra)
               for label, extra in MODES}
    ids = english_ids(next(iter(engines.values())))
    prompts = [ids[i * 97:i * 97 + PROMPT_TOKENS] for i in range(batch)]
    timers = {}
    for label, llm in engines.items():
        for prompt in prompts:
            llm.add_request(prompt, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in llm.scheduler.running) \
                or llm.scheduler.waiting:
            llm.step()
        if llm.integrity is not None:
            timers[label] = CheckTimer(llm)
    times: dict[str, list[float]] = {label: [] for label in engines}
    order = list(engines)
    rng = random.Random(batch)
    for _ in range(steps):
        rng.shuffle(order)
        for label in order:
            start = time.perf_counter()
            engines[label].step()
            times[label].append(time.perf_counter() - start)
    medians = {label: statistics.median(values) for label, values in times.items()}
    row = {"batch": batch, "steps": steps, "step_ms": {k: round(v * 1e3, 3) for k, v in medians.items()}}
    for label in engines:
        if label == "off":
            continue
        key = label.replace(" ", "_")
        row[f"overhead_{key}_pct"] = round(100 * (medians[label] / medians["off"] - 1), 2)
        row[f"check_share_{key}_pct"] = round(100 * timers[label].seconds / sum(times[label]), 3)
    for llm in engines.values():
        while llm.has_unfinished():
            llm.step()
    return row


def campaign(trials: int, seed: int) -> list[dict]:
    rows = []
    rng = random.Random(seed)
    logging.getLogger("engine.integrity").setLevel(logging.CRITICAL)     # thousands of expected violations
    for mode, kv_dtype in (("ownership", None), ("full", "fp8")):
        llm = LLM(model="smollm2-135m", device="cpu", page_size=8, num_pages=800, integrity=mode, kv_dtype=kv_dtype)
        ids = english_ids(llm)
        prompts = [ids[i * 150:i * 150 + rng.randrange(3, 130)] for i in range(16)]
        params = [SamplingParams(max_tokens=rng.randrange(4, 16), ignore_eos=True) for _ in prompts]
        reference = [result.token_ids for result in llm.generate(prompts, params)]
        for kind in FAULT_KINDS:
            if mode not in DETECTED_IN[kind]:
                continue
            results = [run_trial(llm, prompts, params, reference, kind, rng) for _ in range(trials)]
            injected = [r for r in results if r.fault is not None]
            rows.append({
                "mode": mode, "kind": kind, "injected": len(injected),
                "detected": sum(r.detected for r in injected),
                "requests_harmed": sum(r.harmed + (not r.victims_clean) for r in injected),
                "leaked_pages": sum(r.leaked_pages for r in results),
                "quarantined_pages": len(llm.block_manager.quarantined),
            })
            print(f"  {mode:9s} {kind:18s} injected {rows[-1]['injected']:3d} detected {rows[-1]['detected']:3d} "
                  f"harmed {rows[-1]['requests_harmed']}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per engine and batch")
    parser.add_argument("--trials", type=int, default=5, help="fault trials per kind and mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    out = sys.stderr if args.json else sys.stdout
    rows = [overhead(batch, args.steps, kv_gib=0.5) for batch in args.batches]
    print(f"{'batch':>5} {'off ms':>9} {'ownership':>10} {'full':>8} {'full/8pg':>9} {'check share own':>16}", file=out)
    for row in rows:
        print(f"{row['batch']:5d} {row['step_ms']['off']:9.2f} {row['overhead_ownership_pct']:9.2f}% "
              f"{row['overhead_full_pct']:7.1f}% {row['overhead_full_sampled_pct']:8.1f}% "
              f"{row['check_share_ownership_pct']:15.3f}%", file=out)
    faults = campaign(args.trials, args.seed)
    print(f"{'mode':9s} {'fault':18s} {'injected':>8} {'detected':>8} {'harmed':>6} {'leaked':>6}", file=out)
    for row in faults:
        print(f"{row['mode']:9s} {row['kind']:18s} {row['injected']:8d} {row['detected']:8d} "
              f"{row['requests_harmed']:6d} {row['leaked_pages']:6d}", file=out)
    summary = {
        "overhead_ownership_pct": max(row["overhead_ownership_pct"] for row in rows),
        "overhead_full_pct": max(row["overhead_full_pct"] for row in rows),
        "overhead_full_sampled_pct": max(row["overhead_full_sampled_pct"] for row in rows),
        "check_share_ownership_pct": max(row["check_share_ownership_pct"] for row in rows),
        "faults_injected": sum(row["injected"] for row in faults),
        "faults_detected": sum(row["detected"] for row in faults),
        "requests_harmed": sum(row["requests_harmed"] for row in faults),
        "pages_leaked": sum(row["leaked_pages"] for row in faults),
        "by_batch": rows,
        "faults": faults,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"integrity_{summary['device']}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps({key: value for key, value in summary.items() if key not in ("by_batch", "faults")}))


if __name__ == "__main__":
    main()
