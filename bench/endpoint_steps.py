"""Where an endpoint verification's error comes from: `engine serve` with a step trace is calibrated from the outside
and then serves a Poisson workload, as `tests/test_endpoint.py` does; the server's own steps, timed inside, are set
against the calibrated step model on the same batches (for the sweep and for the workload), the time between steps
against the steps, and the served steps against the simulated ones.

What the calibration fits is the gap a client sees between tokens: a step plus what the server does between steps.
If the model matches the gaps of the sweep but not the steps of the workload, the difference is in the steps (their
batches are priced wrong); if it matches the steps but the workload's time between steps is larger than the sweep's,
it is in the serving loop.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.core.metrics import RequestTiming, summarize
from engine.core.step_shape import regime_of
from engine.harness.launch import serve_subprocess
from planner.calibration.parameters import load_calibration
from planner.catalog.models import get_model
from planner.cost.step_model import BatchShape
from planner.deployment.capacity import Deployment
from planner.endpoint.calibrate import EndpointSweep, RowResiduals, calibrate_endpoint
from planner.endpoint.client import server_shape, with_client
from planner.endpoint.verify import calibrated_step, probed_workload, simulate_endpoint
from planner.simulation.workload import LengthDistribution, Workload
from planner.verification.comparison import TIMING_METRICS, compared
from planner.verification.verify import served_shape, step_model_errors

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
KV_GIB = 0.25
SERVE_FLAGS = ["--model", "smollm2-135m", "--device", "cpu", "--threads", "1", "--kv-dtype", "bf16",
               "--memory-gib", str(KV_GIB)]
DEPLOYMENT = Deployment(model="smollm2-135m", hardware="cpu", gpus=1, weights="bf16", kv_dtype="bf16")
SWEEP = EndpointSweep(prefill_tokens=(16, 32, 64, 128, 192), decode_batches=(1, 2, 3, 4, 6, 8), repeats=2)


def read_trace(path: Path, window: tuple[float, float]) -> list[dict[str, Any]]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [step for step in steps if window[0] <= step["start_s"] <= window[1]]


def between_steps(steps: list[dict[str, Any]]) -> list[float]:
    """The time from each step's end to the next one's start, where work was left (the serving loop's own time)."""
    return [later["start_s"] - earlier["start_s"] - earlier["duration_s"]
            for earlier, later in zip(steps, steps[1:]) if earlier["more"]]


def steps_against_model(steps: list[dict[str, Any]], price) -> dict[str, Any]:
    modelled = [(regime_of(step["batch"]), price(BatchShape(**step["batch"]))) for step in steps]
    gaps = between_steps(steps)
    busy = sum(step["duration_s"] for step in steps)
    return {"steps": len(steps), "by_regime": {kind: sum(1 for k, _ in modelled if k == kind)
                                               for kind in ("prefill", "decode", "mixed")},
            "busy_s": round(busy, 4),
            "model_vs_step": step_model_errors(modelled, [step["duration_s"] for step in steps]),
            "between_steps_median_ms": round(1e3 * statistics.median(gaps), 3) if gaps else None,
            "between_steps_total_s": round(sum(gaps), 4),
            "between_steps_share_pct": round(100 * sum(gaps) / busy, 2) if busy else None}


def per_request(measured: list[RequestTiming], simulated: list[RequestTiming]) -> list[dict[str, Any]]:
    """Each request's TTFT and TPOT as served and as simulated (ms)."""
    by_id = {timing.request_id: timing for timing in simulated}

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1e3 * value, 1)
    return [{"request": served.request_id, "prompt_tokens": served.prompt_tokens,
             "arrival_s": round(served.arrival_s, 3),
             "ttft_ms": [ms(served.ttft_s), ms(by_id[served.request_id].ttft_s)],
             "tpot_ms": [ms(served.tpot_s), ms(by_id[served.request_id].tpot_s)]}
            for served in sorted(measured, key=lambda timing: timing.request_id)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workload = Workload("poisson", args.requests, rate=args.rate, prompt=LengthDistribution("uniform", low=32, high=96),
                        output=LengthDistribution("fixed", args.output_tokens), seed=0)
    specs = workload.requests()
    vocab_size = get_model(DEPLOYMENT.model).vocab_size
    with tempfile.TemporaryDirectory() as folder:
        trace, calibration_path = Path(folder) / "steps.jsonl", Path(folder) / "endpoint.calibration.json"
        with serve_subprocess([*SERVE_FLAGS, "--step-trace", str(trace)]) as url:
            started = time.perf_counter()
            document = calibrate_endpoint(url, DEPLOYMENT, SWEEP, max_mape=100.0)
            sweep_window = (started, time.perf_counter())
            calibration_path.write_text(json.dumps(document))
            calibration = load_calibration(str(calibration_path))

            served = with_client(lambda client: probed_workload(client, document, specs, vocab_size), url,
                                 "smollm2-135m")
            shape = server_shape(url)
        sweep_steps, workload_steps = read_trace(trace, sweep_window), read_trace(trace, served.window_s)
    speed = (served.before + served.after) / 2
    price, _index_topk = calibrated_step(calibration)
    residuals = RowResiduals.of(document)

    simulated = simulate_endpoint(calibration, shape, specs, speed)
    simulated_regimes = [served_shape(step)[0] for step in simulated.steps]
    measured, predicted = summarize(served.timings), simulated.report()
    result = {
        "workload": {"requests": args.requests, "rate": args.rate, "prompt_tokens": "uniform:32:96",
                     "output_tokens": args.output_tokens},
        "fit": {key: value for key, value in document.items() if key.startswith("mape")},
        "row_residuals_ms": dict(zip(residuals.rows, (round(1e3 * value, 2) for value in residuals.seconds))),
        "drift": {"before": round(served.before, 4), "after": round(served.after, 4)},
        "sweep": steps_against_model(sweep_steps, price),
        "workload_steps": steps_against_model(workload_steps, lambda batch: speed * price(batch)),
        "simulated": {"steps": len(simulated.steps),
                      "by_regime": {kind: simulated_regimes.count(kind) for kind in ("prefill", "decode", "mixed")},
                      "busy_s": round(sum(step.duration_s for step in simulated.steps), 4)},
        "metrics_drift_corrected": {metric: compared(predicted[metric], measured[metric]) for metric in TIMING_METRICS},
        "requests": per_request(served.timings, simulated.timings),
    }
    out = sys.stderr if args.json else sys.stdout
    for phase in ("sweep", "workload_steps"):
        row = result[phase]
        errors = ", ".join(f"{kind} {e['median_error_pct']:+.1f}% (total {e['total_error_pct']:+.1f}%, "
                           f"{e['steps']} steps)" for kind, e in row["model_vs_step"].items())
        print(f"{phase}: model vs the server's steps: {errors}; between steps median "
              f"{row['between_steps_median_ms']} ms, {row['between_steps_share_pct']}% of busy time", file=out)
    print(f"served steps {result['workload_steps']['by_regime']} busy {result['workload_steps']['busy_s']} s; "
          f"simulated {result['simulated']['by_regime']} busy {result['simulated']['busy_s']} s", file=out)
    for row in result["requests"]:
        print(f"request {row['request']:>3} prompt {row['prompt_tokens']:>4} at {row['arrival_s']:7.3f} s: TTFT "
              f"{row['ttft_ms'][0]} ms served, {row['ttft_ms'][1]} simulated; TPOT {row['tpot_ms'][0]} ms served, "
              f"{row['tpot_ms'][1]} simulated", file=out)
    print("drift-corrected: " + ", ".join(f"{k} {m['error_pct']:+.1f}%" for k, m in
                                          result["metrics_drift_corrected"].items()), file=out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "endpoint_steps.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
