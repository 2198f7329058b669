"""A live endpoint verified: a workload sent to it and simulated with its calibration, as the engine's
verification does; the machine's drift measured with the calibration's own probe timed again around it."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from engine.core.config import SchedulerConfig
from engine.core.memory import GIB, kv_layout, kv_pages_for_budget
from engine.core.metrics import RequestTiming, summarize
from planner.calibration.parameters import Calibration, load_calibration
from planner.catalog.models import get_model
from planner.cost.step_model import BatchShape, step_time
from planner.deployment.capacity import Deployment, catalogue_costs
from planner.endpoint.calibrate import RowResiduals, decode_gaps, prefill_ttfts
from planner.endpoint.client import (
    Client,
    ServerShape,
    base_url,
    serve_workload,
    served_model,
    server_shape,
    with_client,
)
from planner.errors import PlannerError
from planner.simulation.simulator import Simulation, SimulationResult, model_step_time
from planner.simulation.workload import RequestSpec, Workload
from planner.verification.comparison import TIMING_METRICS, compared, gate, gate_line, metrics_table, workload_dict

PROBE_REPEATS = 3                   # timings of the prefill probe of `slowdown`


def deployment_of(fingerprint: dict[str, Any]) -> Deployment:
    """The deployment an endpoint calibration was made for."""
    return Deployment(model=fingerprint["model"], hardware=fingerprint["hardware"], gpus=fingerprint["gpus"],
                      weights=fingerprint["weights"], kv_dtype=fingerprint["kv_dtype"],
                      tensor_parallel=fingerprint["tensor_parallel"], expert_parallel=fingerprint["expert_parallel"])


def predicted_capacity(deployment: Deployment, page_size: int, kv_cache_gib: float | None) -> int:
    """The planner's KV capacity for the server: its own arithmetic over a given KV budget (a CPU server's
    `--memory-gib`), else the memory plan of the deployment (per replica)."""
    _costs, _peaks, plan = catalogue_costs(deployment)
    if kv_cache_gib is None:
        return plan.kv_pages_per_replica * plan.page_size
    layout = kv_layout(get_model(deployment.model), deployment.kv_dtype, deployment.parallel.tp)
    return kv_pages_for_budget(int(kv_cache_gib * GIB), layout, page_size) * page_size


def verify_endpoint(url: str, calibration_path: str, workload: Workload, kv_cache_gib: float | None = None,
                    limits: dict[str, int] | None = None, served_name: str | None = None) -> dict[str, Any]:
    """The workload against the live endpoint and through the simulator calibrated on it: the error per
    metric, as `planner verify` reports for the engine here. `limits` gives the scheduler limits a server does
    not publish (max_num_seqs, max_num_batched_tokens, max_model_len, page_size, capacity_tokens)."""
    calibration = load_calibration(calibration_path)
    fingerprint = calibration.fingerprint
    if not calibration.from_endpoint:
        raise PlannerError(f"calibration {calibration_path!r} was not made against an endpoint: "
                           f"use `planner calibrate --endpoint`")
    deployment = deployment_of(fingerprint)
    if workload.shares_prefixes:
        raise PlannerError("verification against an endpoint sends prompts of their lengths alone: shared prefixes "
                           "and conversations (--shared-prefix, --turns, session traces) are verified with --profile")
    specs = workload.requests()
    if any(spec.arrival_s is None for spec in specs):
        raise PlannerError("verification needs arrival times: use a poisson, gamma or trace workload")
    shape = replace(server_shape(url), **{k: v for k, v in (limits or {}).items() if v is not None})
    missing = [name for name in ("capacity_tokens", "page_size", "max_num_seqs", "max_num_batched_tokens",
                                 "max_model_len") if getattr(shape, name) is None]
    if missing:
        raise PlannerError(f"the {shape.kind} server at {url} does not publish {', '.join(missing)}: give "
                           + ", ".join(f"--{name.replace('_', '-')}" for name in missing))
    name = served_name or served_model(url)
    vocab_size = get_model(deployment.model).vocab_size
    run = with_client(lambda client: probed_workload(client, calibration.document, specs, vocab_size), url, name)
    speed = (run.before + run.after) / 2
    predicted = simulate_endpoint(calibration, shape, specs).report()
    corrected = simulate_endpoint(calibration, shape, specs, speed).report()
    measured = summarize(run.timings)
    drift_corrected = {metric: compared(corrected[metric], measured[metric]) for metric in TIMING_METRICS}
    metrics = {"kv_capacity_tokens": compared(predicted_capacity(deployment, shape.page_size, kv_cache_gib),
                                             shape.capacity_tokens),
               **{metric: compared(predicted[metric], measured[metric]) for metric in TIMING_METRICS}}
    return {"metrics": metrics, "endpoint": base_url(url), "server": asdict(shape), "fingerprint": fingerprint,
            "workload": workload_dict(workload),
            "calibration": {key: value for key, value in calibration.document.items()
                            if key.startswith(("mape", "holdout")) or key == "parameters"},
            "completed": measured.get("completed", 0),
            "gate": gate(metrics, drift_corrected, round(100 * abs(run.after - run.before) / speed, 3)),
            "machine": {"slowdown_vs_profile_pct": round(100 * (speed - 1), 2),
                        "slowdown_before_pct": round(100 * (run.before - 1), 2),
                        "slowdown_after_pct": round(100 * (run.after - 1), 2),
                        "metrics_drift_corrected": drift_corrected}}


@dataclass(frozen=True)
class ProbedRun:
    """A workload as the endpoint served it, between two drift probes; `window_s` is when it ran (perf_counter)."""

    timings: list[RequestTiming]
    before: float
    after: float
    window_s: tuple[float, float]


async def probed_workload(client: Client, document: dict[str, Any], specs: list[RequestSpec],
                          vocab_size: int) -> ProbedRun:
    before = await slowdown(client, document, vocab_size)
    started = time.perf_counter()
    timings = await serve_workload(client, specs, vocab_size)
    window = (started, time.perf_counter())
    return ProbedRun(timings, before, await slowdown(client, document, vocab_size), window)


def calibrated_step(calibration: Calibration) -> tuple[Callable[[BatchShape], float], int]:
    """The server's step seconds as the calibration prices them, row residuals added; and its index_topk."""
    costs, _peaks, _plan = catalogue_costs(deployment_of(calibration.fingerprint))
    residuals = RowResiduals.of(calibration.document)

    def step_seconds(batch: BatchShape) -> float:
        return step_time(costs, calibration.peaks, calibration.parameters, batch) + residuals.at(batch.new_tokens)
    return step_seconds, costs.index_topk


def simulate_endpoint(calibration: Calibration, shape: ServerShape, specs: list[RequestSpec],
                      speed: float = 1.0) -> SimulationResult:
    """The workload through the simulator with the server's limits and the calibrated steps (times `speed`)."""
    calibrated, index_topk = calibrated_step(calibration)
    config = SchedulerConfig(num_pages=shape.capacity_tokens // shape.page_size, page_size=shape.page_size,
                             max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens,
                             max_model_len=shape.max_model_len, enable_prefix_caching=True)     # servers' default
    return Simulation(config, model_step_time(lambda batch: speed * calibrated(batch), index_topk)).run(
        list(specs))


async def slowdown(client: Client, document: dict[str, Any], vocab_size: int) -> float:
    """How much slower the endpoint steps now than when it was calibrated: the calibration's longest prefill and
    its smallest decode batch timed again, against their calibrated times (the geometric mean of the two ratios).
    A server's speed drifts (a shared machine, thermals, other tenants); this tells drift from model error."""
    samples, sweep = document["samples"], document["sweep"]
    prefill = max((s for s in samples if s["kind"] == "prefill"), key=lambda s: s["batch"]["prefill_tokens"])
    decode = min((s for s in samples if s["kind"] == "decode"), key=lambda s: s["batch"]["num_decodes"])
    rng = np.random.default_rng()      # prompts no earlier run sent: a prefix cache must not answer them
    ttfts = await prefill_ttfts(client, prefill["batch"]["prefill_tokens"], PROBE_REPEATS, vocab_size, rng)
    gaps = await decode_gaps(client, decode["batch"]["num_decodes"], sweep["decode_prompt_tokens"],
                              sweep["decode_output_tokens"], vocab_size, rng)
    ratios = [statistics.median(ttfts) / prefill["median_s"],
              statistics.median(gap for _, gap in gaps) / decode["median_s"]]
    return float(np.sqrt(ratios[0] * ratios[1]))


def endpoint_report(result: dict[str, Any]) -> str:
    fp = result["fingerprint"]
    return "\n".join([
        f"# Verification against {result['endpoint']} ({result['server']['kind']} server): {fp['model']} "
        f"({fp['weights']} weights, {fp['kv_dtype']} KV) as {fp['gpus']} x {fp['hardware']}", "",
        f"Workload: `{result['workload']}`; {result['completed']} requests completed", "",
        *metrics_table(result["metrics"]), "",
        f"The calibration's own probes ran {result['machine']['slowdown_before_pct']:+.1f}% slower than when "
        f"calibrated before the workload, {result['machine']['slowdown_after_pct']:+.1f}% after it; with every "
        "predicted step scaled by their mean:", "", *metrics_table(result["machine"]["metrics_drift_corrected"]),
        "", gate_line(result["gate"]).capitalize() + ".", "", f"Calibration fit: {result['calibration']}", ""])
