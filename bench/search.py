"""`planner search` speed: Llama-3.1-70B over H100, H200 and B200, up to 8 GPUs per replica, a chat workload,
TTFT p99 under 2 s and TPOT p99 under 50 ms, on this machine's cores (a local process pool, no cache).

Prints how many configurations were enumerated, pruned and simulated, the wall time, the best few, and writes
bench/results/search.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from planner.search.deployments import SearchSpace, Slo, run_search
from planner.simulation.workload import LengthDistribution, Workload

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests each simulation runs")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workload = Workload("poisson", args.requests, rate=1.0,
                        prompt=LengthDistribution("lognormal", 1000, sigma=0.8, maximum=8192),
                        output=LengthDistribution("lognormal", 256, sigma=0.5, maximum=1024), seed=0)
    slo = Slo.parse("ttft_p99_s=2,tpot_p99_s=0.05")
    space = SearchSpace("llama-3.1-70b", ("h100-sxm", "h200", "b200"), max_gpus=8)
    start = time.perf_counter()
    result = run_search(space, workload, slo, workers=args.workers)
    wall = time.perf_counter() - start
    best = [r.row() for r in result.ranked[:5]]
    summary = {"model": space.model, "hardware": list(space.hardware), "max_gpus": space.max_gpus,
               "requests_per_simulation": args.requests, "enumerated": result.enumerated,
               "pruned": len(result.pruned), "simulated": result.simulated, "met_slo": len(result.ranked),
               "wall_s": round(wall, 2), "target_s": TARGET_S, "within_target": wall <= TARGET_S,
               "pareto_points": len(result.pareto()), "best": best}
    out = sys.stderr if args.json else sys.stdout
    print(f"{space.model}: {result.enumerated} configurations enumerated, {len(result.pruned)} pruned, "
          f"{result.simulated} simulated, {len(result.ranked)} meet {slo.text()}; {wall:.1f} s "
          f"(target {TARGET_S:.0f} s)", file=out)
    for row in best:
        print(f"  {row['configuration']:58s} {row['max_rate_rps']:8.2f} req/s {row['usd_per_million_tokens']:8.4f} "
              f"USD/Mtok", file=out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "search.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
