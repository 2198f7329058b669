"""Simulator speed: 10,000 requests of about 500 output tokens, batches up to 256, on one core.

Prints requests and steps per wall-second, and where the time goes (cProfile, top functions by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

from engine.core.config import SchedulerConfig
from planner.cost.step_model import BatchShape
from planner.simulation.simulator import Simulation, model_step_time
from planner.simulation.workload import LengthDistribution, Workload

RESULTS = Path(__file__).resolve().parent / "results"


def step_seconds(batch: BatchShape) -> float:
    """A Llama-8B-on-H100-like step: fixed overhead, per-sequence and per-token terms."""
    return 0.006 + 3e-5 * batch.num_seqs + 6e-6 * batch.prefill_tokens + 2e-9 * batch.decode_context_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = SchedulerConfig(num_pages=200_000, page_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                             max_model_len=8192)
    workload = Workload("poisson", args.requests, rate=60.0, prompt=LengthDistribution("uniform", low=100, high=900),
                        output=LengthDistribution("uniform", low=400, high=600), seed=0)
    simulation = Simulation(config, model_step_time(step_seconds), record_steps=False)
    timed = simulation.run(workload)
    profiler = cProfile.Profile()
    profiled = Simulation(config, model_step_time(step_seconds), record_steps=False)
    profiler.runcall(profiled.run, Workload(**{**workload.__dict__, "num_requests": min(args.requests, 2000)}))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(10)
    report = timed.report()
    result = {"requests_per_s": round(args.requests / timed.wall_s, 1), "steps_per_s": round(timed.num_steps / timed.wall_s, 1),
              "requests": args.requests, "steps": timed.num_steps, "wall_s": round(timed.wall_s, 3),
              "max_concurrency_reached": report["max_concurrency_reached"],
              "output_tokens": sum(t.output_tokens for t in timed.timings)}
    out = sys.stderr if args.json else sys.stdout
    print(f"{args.requests} requests, {timed.num_steps} steps (batches up to {report['max_concurrency_reached']}) "
          f"in {timed.wall_s:.2f} s: {result['requests_per_s']} requests/s, {result['steps_per_s']} steps/s", file=out)
    print(text.getvalue(), file=out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "simulator.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
