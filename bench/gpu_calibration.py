"""Every public measurement of the catalogue against the planner's prediction: with the uncalibrated defaults, with
the calibration fitted to the catalogue, and cross-validated (each model predicted from a fit without it).

The catalogue is `planner/data/benchmarks/*.csv` (every row with its source URL, date and an exact quote). Points
decoded speculatively (MTP, EAGLE) are listed and skipped: the simulator decodes one token a step. Kimi and GLM
points are never fitted: they are the catalogue's held-out check, reported apart. The fit is written as the
committed calibration (`planner/profiles/public-benchmarks.calibration.json`) that `planner plan`, `simulate`,
`search` and the dashboard use by default on the GPU kinds it covers.

Then one fit per serving engine family with enough points (`planner.benchmarks.engine_fit`: vLLM, SGLang,
TensorRT-LLM; another version joined only where it agrees with the fit of the newest version measured on two
models or more): the engine's own step overheads, bandwidth share and API time over the physics of the every-engine
fit in force (this run's, or the committed one where this run's is refused), each written beside it
(`planner/profiles/public-benchmarks-<engine>.calibration.json`, what `--engine` picks; a refused family's file is
removed, and `--engine` then prices with the every-engine fit and says so), with its leave-one-model-out medians beside
the every-engine fit's on the same points.

Prints a table (measured, defaults, calibrated, cross-validated error per figure) and the medians; writes
bench/results/gpu_calibration.json and a predicted-against-measured plot (bench/results/gpu_calibration.html).
Runs in about 20-30 minutes on 2 cores (every point is replayed in the simulator a few times, per fit).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import plotly.graph_objects as go

from planner.benchmarks.engine_fit import engine_calibrations
from planner.benchmarks.fit import (
    PointSetup,
    calibrate_benchmarks,
    error_rows,
    fit_report_lines,
    median_errors,
    predictions,
    refusal,
)
from planner.benchmarks.formats import HELD_OUT_FAMILIES, catalogue_points
from planner.calibration.parameters import PUBLIC_BENCHMARKS, load_calibration
from planner.catalog.engines import ENGINE_NAMES, engine_calibration
from planner.catalog.hardware import get_hardware
from planner.cost.step_model import StepParameters

# the catalogue mixes four engines (vLLM, SGLang, TensorRT-LLM, NIM) and two years of their versions: its fit is held
# to 30%, where one user's files (one engine) are held to `planner calibrate`'s 25% (MAX_CV_MEDIAN_PCT)
CATALOGUE_MAX_CV_PCT = 30.0
RESULTS = Path(__file__).resolve().parent / "results"


def default_parameters(hardware: str) -> StepParameters:
    """What `planner plan` used on this GPU before any calibration: the documented defaults, CUDA graphs (no launch
    cost) and the catalogue's all-reduce latency."""
    spec = get_hardware(hardware)
    return StepParameters(kernel_launch_s=spec.launch_cost(True), collective_latency_s=spec.collective_latency(True))


def with_defaults(setups: list[PointSetup]) -> list[dict]:
    rows = []
    for setup in setups:
        (values,) = predictions([setup], default_parameters(setup.point.hardware))
        rows += error_rows([setup], [values], "defaults")
    return rows


def figure(document: dict, default_rows: list[dict]) -> go.Figure:
    """Predicted against measured output throughput and time between tokens, log-log, with the y = x line."""
    plot = go.Figure()
    cross = {(row["point"], row["metric"]): row for row in document["cross_validated_rows"]}
    series = (("defaults", default_rows, "circle-open"), ("calibrated", document["rows"], "circle"),
              ("cross-validated", list(cross.values()), "diamond"), ("held out (Kimi, GLM)",
                                                                     document["held_out_rows"], "x"))
    for name, rows, symbol in series:
        for metric, color in (("tpot", "#1f77b4"), ("itl", "#17becf"), ("output_tokens_per_s", "#d62728"),
                              ("ttft", "#2ca02c")):
            chosen = [row for row in rows if row["metric"] == metric]
            if not chosen:
                continue
            ratio = [row["measured"] for row in chosen]
            plot.add_scatter(x=ratio, y=[row["predicted"] / row["measured"] for row in chosen], mode="markers",
                             marker=dict(symbol=symbol, color=color, size=8), name=f"{metric}, {name}",
                             text=[f"{row['deployment']}" for row in chosen])
    plot.add_hline(y=1.0, line_dash="dash")
    plot.update_layout(xaxis_type="log", yaxis_type="log", xaxis_title="measured (s or tokens/s)",
                       yaxis_title="predicted / measured", height=600,
                       title="GPU serving benchmarks: the planner's predictions against public measurements")
    return plot


def summary_table(document: dict, default_rows: list[dict]) -> list[str]:
    defaults = median_errors(default_rows)
    single_defaults = median_errors([row for row in default_rows if row["single_stream"]])
    fitted_defaults = median_errors([row for row in default_rows if row["model"] not in HELD_OUT_FAMILIES])
    lines = ["", f"{'median |error| %':44s} {'all':>7s} {'TPOT':>7s} {'ITL':>7s} {'TTFT':>7s} {'tok/s':>7s}"]
    for label, values in (("defaults, fitted models", fitted_defaults), ("defaults, all points", defaults),
                          ("calibrated", document["median_error_pct"]),
                          (document["cross_validation"], document["cross_validated_median_error_pct"]),
                          ("single streams, defaults", single_defaults),
                          ("single streams, calibrated", document["single_stream_median_error_pct"]),
                          (f"single streams, {document['cross_validation']}",
                           document["single_stream_cross_validated_median_error_pct"]),
                          ("held out Kimi/GLM, calibrated", document["held_out_median_error_pct"] or {})):
        cells = [values.get(key) for key in ("all", "tpot", "itl", "ttft", "output_tokens_per_s")]
        lines.append(f"{label:44s} " + " ".join("      -" if v is None else f"{v:7.1f}" for v in cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--calibration-out", default=str(PUBLIC_BENCHMARKS),
                        help="where to write the fitted calibration (default: the committed one)")
    args = parser.parse_args()
    started = time.perf_counter()
    points = catalogue_points()
    document = calibrate_benchmarks(points, held_out=HELD_OUT_FAMILIES, max_cv_median_pct=math.inf,
                                    described_as="public measurements")
    refused = refusal(document, CATALOGUE_MAX_CV_PCT)
    document["max_cv_median_pct"] = CATALOGUE_MAX_CV_PCT
    setups = [PointSetup.of(point) for point in points if not point.speculative]
    default_rows = with_defaults(setups)
    if not refused:
        Path(args.calibration_out).write_text(json.dumps(document, indent=1) + "\n")
    # every engine's own fit keeps the physics of the every-engine fit in force: this one, else the committed one
    shared = StepParameters(**document["parameters"]) if not refused else load_calibration(PUBLIC_BENCHMARKS).parameters
    engines = engine_calibrations(points, document, CATALOGUE_MAX_CV_PCT, shared)
    if args.calibration_out == str(PUBLIC_BENCHMARKS):
        for engine, fitted in engines.items():
            if fitted["document"] is not None:
                engine_calibration(engine).write_text(json.dumps(fitted["document"], indent=1) + "\n")
            else:           # a refused fit must not leave the last catalogue's pricing `--engine`
                engine_calibration(engine).unlink(missing_ok=True)
    RESULTS.mkdir(exist_ok=True)
    figure(document, default_rows).write_html(RESULTS / "gpu_calibration.html", include_plotlyjs="cdn")
    defaults = {(row["point"], row["metric"]): row for row in default_rows}
    result = {"catalogue_points": len(points), "skipped": document["skipped"], "refused": refused,
              "parameters": document["parameters"], "free_parameters": document["free_parameters"],
              "defaults_median_error_pct": median_errors(default_rows),
              "defaults_single_stream_median_error_pct": median_errors([r for r in default_rows
                                                                         if r["single_stream"]]),
              **{key: document[key] for key in ("median_error_pct", "cross_validation",
                                                "cross_validated_median_error_pct", "single_stream_median_error_pct",
                                                "single_stream_cross_validated_median_error_pct",
                                                "held_out_median_error_pct", "uncertainty_pct")},
              "rows": [row | {"defaults_predicted": defaults[(row["point"], row["metric"])]["predicted"],
                              "defaults_error_pct": defaults[(row["point"], row["metric"])]["error_pct"]}
                       for row in document["rows"] + document["held_out_rows"]],
              "cross_validated_rows": document["cross_validated_rows"],
              "engines": {engine: {key: value for key, value in fitted.items() if key != "document"}
                          | ({"parameters": fitted["document"]["parameters"]} if fitted["document"] else {})
                          for engine, fitted in engines.items()},
              "wall_s": round(time.perf_counter() - started, 1)}
    (RESULTS / "gpu_calibration.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return
    lines = fit_report_lines(document)
    outcome = (f"REFUSED, not written: {refused}" if refused else f"calibration written to {args.calibration_out}")
    print("\n".join(lines + summary_table(document, default_rows) + engine_table(engines)
                    + [f"{outcome}; {time.perf_counter() - started:.0f} s"]), file=sys.stdout)


def engine_table(engines: dict) -> list[str]:
    """Each engine's leave-one-model-out medians beside the every-engine fit's on the same points."""
    lines = ["", f"{'per engine, leave-one-model-out |error| %':44s} {'TPOT':>7s} {'ITL':>7s} {'TTFT':>7s} "
                 f"{'tok/s':>7s}   (every engine's fit on the same points)"]
    for engine, fitted in engines.items():
        if "cross_validated_median_error_pct" not in fitted:
            lines.append(f"{ENGINE_NAMES[engine]:44s} not fitted: {fitted['why']}")
            continue
        own, every = fitted["cross_validated_median_error_pct"], fitted["every_engine_cross_validated_median_error_pct"]
        cells = " ".join("      -" if own.get(key) is None else f"{own[key]:7.1f}"
                         for key in ("tpot", "itl", "ttft", "output_tokens_per_s"))
        beside = " ".join("-" if every.get(key) is None else f"{every[key]:.1f}"
                          for key in ("tpot", "itl", "ttft", "output_tokens_per_s"))
        apart = "; kept apart: " + ", ".join(f"{item['version']} ({item['median_error_pct']}%)"
                                            for item in fitted["kept_apart"]) if fitted["kept_apart"] else ""
        refused = f"; refused, not written: {fitted['why']}" if fitted["document"] is None else ""
        choice = fitted["compute_share_choice"]
        medians = ", ".join(f"{rate} {value}%" for rate, value in choice["cross_validated_median_error_pct_all"].items())
        lines.append(f"{ENGINE_NAMES[engine] + ' (' + str(fitted['points']) + ' points)':44s} "
                     f"{cells}   ({beside}){apart}{refused}; dense GEMM rate: {choice['chosen']} ({medians})")
    return lines


if __name__ == "__main__":
    main()
