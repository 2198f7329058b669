"""Which catalogue points hold the dense GEMMs' share of peak FLOP/s at its bound: the fit over every engine's points
(`bench/gpu_calibration.py`'s, without its cross-validation) with `compute_efficiency` free and with it pinned, side
by side in one run, and the figures whose |error| grows most when it is pinned.

Every fit to the catalogue puts the dense GEMMs at 100% of the dtype's peak, which H100 FP8 GEMMs do not reach. A
point that needs prefills faster than the GPU can run them is a point the simulator misreads, not a faster GPU: this
names those points.

    python bench/pinned_compute.py [--pin 0.6]     # ~10 minutes on 2 cores; writes bench/results/pinned_compute.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from planner.benchmarks.engine_fit import fittable
from planner.benchmarks.fit import (
    FREE,
    PointSetup,
    error_rows,
    fit_points,
    initial_parameters,
    median_errors,
    predictions,
)
from planner.benchmarks.formats import catalogue_points
from planner.errors import PlannerError

RESULTS = Path(__file__).resolve().parent / "results"
SHOWN = 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", type=float, default=0.6, help="the dense GEMMs' share of peak to pin (default 0.6)")
    args = parser.parse_args()
    if not 0 < args.pin <= 1:
        raise SystemExit(f"error: --pin must be in (0, 1], got {args.pin}")
    started = time.perf_counter()
    points = fittable(catalogue_points())
    try:
        setups = [PointSetup.of(point) for point in points]
    except PlannerError as error:
        raise SystemExit(f"error: {error}") from None
    free, _ = fit_points(setups)
    pinned, _ = fit_points(setups, replace(initial_parameters(), compute_efficiency=args.pin),
                           free=tuple(name for name in FREE if name != "compute_efficiency"))
    rows = {"free": error_rows(setups, predictions(setups, free), "fitted"),
            "pinned": error_rows(setups, predictions(setups, pinned), "fitted")}
    growth = sorted(zip(rows["free"], rows["pinned"]),
                    key=lambda pair: abs(pair[1]["error_pct"]) - abs(pair[0]["error_pct"]), reverse=True)
    result = {"pin": args.pin, "points": len(setups),
              "parameters": {"free": {name: getattr(free, name) for name in FREE},
                             "pinned": {name: getattr(pinned, name) for name in FREE}},
              "median_error_pct": {name: median_errors(found) for name, found in rows.items()},
              "grows_most": [{key: before[key] for key in ("point", "deployment", "concurrency", "metric", "measured")}
                             | {"free_predicted": before["predicted"], "free_error_pct": before["error_pct"],
                                "pinned_predicted": after["predicted"], "pinned_error_pct": after["error_pct"]}
                             for before, after in growth[:SHOWN]],
              "wall_s": round(time.perf_counter() - started, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pinned_compute.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'fitted median |error| %':28s} {'all':>6s} {'TPOT':>6s} {'ITL':>6s} {'TTFT':>6s} {'tok/s':>6s}  "
          f"compute_efficiency")
    for name, fitted in (("free", free), ("pinned", pinned)):
        medians = result["median_error_pct"][name]
        cells = " ".join("     -" if medians[key] is None else f"{medians[key]:6.1f}"
                         for key in ("all", "tpot", "itl", "ttft", "output_tokens_per_s"))
        print(f"{name:28s} {cells}  {fitted.compute_efficiency:.3f}")
    print(f"\n{'the figures whose |error| grows most when pinned':62s} {'metric':6s} {'free':>7s} {'pinned':>7s}")
    for item in result["grows_most"]:
        print(f"{item['point'] + ' ' + item['deployment']:62.62s} {item['metric'][:6]:6s} "
              f"{item['free_error_pct']:+6.1f}% {item['pinned_error_pct']:+6.1f}%")
    print(f"\n{result['wall_s']:.0f} s; parameters: "
          + json.dumps({name: round(value, 5) for name, value in result["parameters"]["pinned"].items()}))


if __name__ == "__main__":
    main()
