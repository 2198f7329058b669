"""How close a planner calibrated on our own engine comes to what vLLM and SGLang measure (issue 46, closing the
loop): an `engine profile` of Llama-3.1-8B on a GPU is fitted (`planner calibrate`), and every public
Llama-3.1-8B point of the catalogue on that GPU family (H100, H200) is replayed in the simulator with those
parameters, beside the committed fit to the public measurements themselves. No threshold: the number sets the next
goal. Both sets of parameters are priced at the catalogue's peaks of each point's GPU, with CUDA graphs (the
serving engines' launch cost).

    .venv/bin/python bench/engine_calibrated_planner.py --profile planner/profiles/cuda-llama-3.1-8b-...profile.json

Prints a table (measured, engine-calibrated and public-calibrated predictions and errors) and the medians per
metric; writes bench/results/engine_calibrated_planner.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from planner.benchmarks.fit import PointSetup, error_rows, median_errors, predictions
from planner.benchmarks.formats import catalogue_points
from planner.calibration.parameters import PUBLIC_BENCHMARKS, Calibration, load_calibration
from planner.calibration.profile_fit import calibrate, load_profile
from planner.catalog.hardware import get_hardware
from planner.cost.step_model import StepParameters
from planner.errors import PlannerError

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "llama-3.1-8b"
HARDWARE = ("h100-sxm", "h200")


def with_graphs(params: StepParameters, hardware: str) -> StepParameters:
    """The serving engines run decode as CUDA graphs: no cost per kernel launched (as `planner plan` prices it)."""
    return replace(params, kernel_launch_s=get_hardware(hardware).launch_cost(True))


def compare(profile_path: str) -> dict:
    profile = load_profile(profile_path)
    engine = Calibration.of(calibrate(profile, max_mape=math.inf), profile_path)
    public = load_calibration(PUBLIC_BENCHMARKS)
    points = [point for point in catalogue_points()
              if point.model == MODEL and point.hardware in HARDWARE and not point.speculative]
    if not points:
        raise PlannerError(f"the catalogue has no {MODEL} point on {', '.join(HARDWARE)}")
    setups = [PointSetup.of(point) for point in points]
    rows = {}
    for label, calibration in (("engine", engine), ("public", public)):
        predicted = [predictions([setup], with_graphs(calibration.parameters, setup.point.hardware))[0]
                     for setup in setups]
        rows[label] = error_rows(setups, predicted, label)
    return {"profile": profile_path, "profiled_on": profile["fingerprint"].get("device_name"),
            "engine_version": profile["fingerprint"].get("engine_version"), "points": len(points),
            "median_error_pct": {label: median_errors(found) for label, found in rows.items()},
            "rows": [engine_row | {"public_predicted": public_row["predicted"],
                                   "public_error_pct": public_row["error_pct"]}
                     for engine_row, public_row in zip(rows["engine"], rows["public"])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="an `engine profile` of Llama-3.1-8B (or a cut of it)")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_calibrated_planner.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        result = compare(args.profile)
    except PlannerError as error:
        raise SystemExit(f"engine_calibrated_planner: {error}") from None
    print(f"{result['points']} public {MODEL} points on {', '.join(HARDWARE)}; engine calibration from "
          f"{result['profile']} ({result['profiled_on']})", file=sys.stderr)
    print(f"{'point':44s} {'metric':20s} {'measured':>10s} {'engine':>10s} {'err %':>7s} {'public':>10s} "
          f"{'err %':>7s}", file=sys.stderr)
    for row in result["rows"]:
        print(f"{row['point'][:44]:44s} {row['metric'] + ' ' + row['statistic']:20s} {row['measured']:10.4g} "
              f"{row['predicted']:10.4g} {row['error_pct']:+7.1f} {row['public_predicted']:10.4g} "
              f"{row['public_error_pct']:+7.1f}", file=sys.stderr)
    for label, medians in result["median_error_pct"].items():
        print(f"median |error| {label:7s} " + ", ".join(f"{metric} {value}%" for metric, value in medians.items()
                                                          if value is not None), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
