"""Integrity checks on the real model: their step-time cost, and a fault campaign.

Overhead: three engines (integrity off, ownership, full) decode the same requests in lockstep; their
steps are timed interleaved in a shuffled order every repetition, and the medians are compared as
ratios. Besides that end-to-end ratio (noisy on a shared VM) the time spent inside the checks is timed
directly, as a share of the step. `full` is reported verifying every sealed page per step and a sample.

Campaign: every fault kind injected at a random moment into a mixed batch of 16 requests, many trials,
in the modes that cover it; counted: injected, detected, requests harmed (tokens differing from a
fault-free run, or a victim receiving a token after the fault), pages leaked.

`--tensor-parallel N`: the same on a random Llama-shaped model over N ranks (SmolLM2's 9 heads do not split
in two), one thread a rank: the overhead then includes every rank's own check and the all-reduce in which
the ranks agree on the violations, and the campaign strikes each fault on rank 1's own state (its record, its
copy of the plan, its KV shard, its scales) as well as on rank 0's.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.core.reference_text import reference_ids
from engine.core.sequence import SamplingParams
from engine.harness.fault_campaign import DETECTED_IN, FAULT_KINDS, WORKER_FAULTS, run_trial
from engine.llm import LLM

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_TOKENS = 128
SAMPLED_PAGES = 8
MODES = (("off", {}), ("ownership", {}), ("full", {}), ("full sampled", {"integrity_sample_pages": SAMPLED_PAGES}))
TP_BLOCKS = 3                   # tensor parallelism: blocks of steps per mode (one engine a process at a time)
PARALLEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                   "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": False, "eos_token_id": [1]}


def english_ids(llm: LLM) -> list[int]:
    """English text's tokens; a model without a tokenizer (random weights): fixed pseudo-random ids."""
    return reference_ids(llm.tokenizer, llm.model_config.vocab_size, 4096, slice(60))


class CheckTimer:
    """Times the checker's per-step work (check before, seal after) on one engine."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        for name in ("check", "seal"):
            method = getattr(llm.core.integrity, name)
            setattr(llm.core.integrity, name, self._timed(method))

    def _timed(self, method):
        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def _start_decoding(llm: LLM, prompts: list[list[int]], steps: int) -> None:
    """Queues the prompts and runs their prefills: the engine's next steps are all decodes."""
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in llm.core.scheduler.running) \
            or llm.core.scheduler.waiting:
        llm.step()


def _timed_step(llm: LLM) -> float:
    start = time.perf_counter()
    llm.step()
    return time.perf_counter() - start


def overhead(batch: int, steps: int, kv_gib: float, engine: dict) -> dict:
    """The modes' decode steps interleaved on one engine each; under tensor parallelism (one engine a process)
    in blocks of `steps` steps, each mode's engine in turn in a shuffled order, `TP_BLOCKS` times."""
    rng = random.Random(batch)
    times: dict[str, list[float]] = {label: [] for label, _ in MODES}
    check_seconds = dict.fromkeys(times, 0.0)

    def build(label: str, extra: dict) -> LLM:
        llm = LLM(**engine, kv_cache_gib=kv_gib, integrity=label.split()[0], **extra)
        ids = english_ids(llm)
        _start_decoding(llm, [ids[i * 97:i * 97 + PROMPT_TOKENS] for i in range(batch)], steps)
        return llm

    def finish(label: str, llm: LLM, timer: CheckTimer | None) -> None:
        check_seconds[label] += timer.seconds if timer else 0.0
        while llm.has_unfinished():
            llm.step()
        llm.close()

    if engine.get("tensor_parallel", 1) == 1:
        engines = {label: build(label, extra) for label, extra in MODES}
        timers = {label: CheckTimer(llm) for label, llm in engines.items() if llm.core.integrity is not None}
        order = list(engines)
        for _ in range(steps):
            rng.shuffle(order)
            for label in order:
                times[label].append(_timed_step(engines[label]))
        for label, llm in engines.items():
            finish(label, llm, timers.get(label))
    else:
        modes = list(MODES)
        for _ in range(TP_BLOCKS):
            rng.shuffle(modes)
            for label, extra in modes:
                llm = build(label, extra)
                timer = CheckTimer(llm) if llm.core.integrity is not None else None
                times[label] += [_timed_step(llm) for _ in range(steps)]
                finish(label, llm, timer)
    medians = {label: statistics.median(values) for label, values in times.items()}
    row = {"batch": batch, "steps": steps, "step_ms": {k: round(v * 1e3, 3) for k, v in medians.items()}}
    for label in times:
        if label == "off":
            continue
        key = label.replace(" ", "_")
        row[f"overhead_{key}_pct"] = round(100 * (medians[label] / medians["off"] - 1), 2)
        row[f"check_share_{key}_pct"] = round(100 * check_seconds[label] / sum(times[label]), 3)
    return row


def campaign(trials: int, seed: int, engine: dict) -> list[dict]:
    rows = []
    rng = random.Random(seed)
    logging.getLogger("engine.executor.integrity").setLevel(logging.CRITICAL)     # thousands of expected violations
    ranks = list(range(min(2, engine.get("tensor_parallel", 1))))
    for mode, kv_dtype in (("ownership", None), ("full", "fp8")):
        # a token budget of 64 admits the requests over several steps, so that the later ones share the pages of
        # the system prompt half of them open with, published by the earlier ones (the sharing faults need that)
        llm = LLM(**engine, device="cpu", page_size=8, num_pages=800, integrity=mode, kv_dtype=kv_dtype,
                  max_num_batched_tokens=64)
        ids = english_ids(llm)
        system = ids[5000:5024]
        prompts = [(system if i % 2 else []) + ids[i * 150:i * 150 + rng.randrange(3, 100)] for i in range(16)]
        params = [SamplingParams(max_tokens=rng.randrange(4, 16), ignore_eos=True) for _ in prompts]
        reference = [result.token_ids for result in llm.generate(prompts, params)]
        for kind, rank in ((kind, rank) for kind in FAULT_KINDS for rank in ranks):
            if mode not in DETECTED_IN[kind] or (rank and kind not in WORKER_FAULTS):
                continue
            results = [run_trial(llm, prompts, params, reference, kind, rng, rank=rank) for _ in range(trials)]
            injected = [r for r in results if r.fault is not None]
            rows.append({
                "mode": mode, "kind": kind, "rank": rank, "injected": len(injected),
                "detected": sum(r.detected for r in injected),
                "requests_harmed": sum(r.harmed + (not r.victims_clean) for r in injected),
                "leaked_pages": sum(r.leaked_pages for r in results),
                "quarantined_pages": llm.stats().quarantined_pages,
            })
            print(f"  {mode:9s} {kind:18s} rank {rank} injected {rows[-1]['injected']:3d} detected "
                  f"{rows[-1]['detected']:3d} harmed {rows[-1]['requests_harmed']}", file=sys.stderr)
        llm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per engine and batch")
    parser.add_argument("--trials", type=int, default=5, help="fault trials per kind and mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks (a random Llama-shaped model if > 1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    out = sys.stderr if args.json else sys.stdout
    engine: dict = {"model": "smollm2-135m"}
    if args.tensor_parallel > 1:
        config = Path(tempfile.mkdtemp()) / "config.json"
        config.write_text(json.dumps(PARALLEL_CONFIG))
        engine = {"model": str(config), "tensor_parallel": args.tensor_parallel, "num_threads": 1}
    rows = [overhead(batch, args.steps, 0.5, engine) for batch in args.batches]
    print(f"{'batch':>5} {'off ms':>9} {'ownership':>10} {'full':>8} {'full/8pg':>9} {'check share own':>16}", file=out)
    for row in rows:
        print(f"{row['batch']:5d} {row['step_ms']['off']:9.2f} {row['overhead_ownership_pct']:9.2f}% "
              f"{row['overhead_full_pct']:7.1f}% {row['overhead_full_sampled_pct']:8.1f}% "
              f"{row['check_share_ownership_pct']:15.3f}%", file=out)
    faults = campaign(args.trials, args.seed, engine)
    print(f"{'mode':9s} {'fault':18s} {'rank':>4} {'injected':>8} {'detected':>8} {'harmed':>6} {'leaked':>6}",
          file=out)
    for row in faults:
        print(f"{row['mode']:9s} {row['kind']:18s} {row['rank']:4d} {row['injected']:8d} {row['detected']:8d} "
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
        "tensor_parallel": args.tensor_parallel,
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = f"_tp{args.tensor_parallel}" if args.tensor_parallel > 1 else ""
    (RESULTS / f"integrity_{summary['device']}{suffix}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps({key: value for key, value in summary.items() if key not in ("by_batch", "faults")}))


if __name__ == "__main__":
    main()
