"""What the dashboard shows, as plain functions: `app.py` lays it out, this computes it."""
from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner.catalog.models import get_model, parse_model_config
from planner.cost.memory_plan import KV_DTYPES
from planner.deployment.capacity import Deployment, deployment_uncertainty, evaluate, figure_uncertainty
from planner.deployment.comparisons import kv_dtype_comparison, weight_dtype_comparison
from planner.deployment.simulate import simulate, simulation_setup
from planner.errors import PlannerError
from planner.search.deployments import SearchSpace, Slo, preset_workload, run_search
from planner.search.executors import DEFAULT_CACHE, ResultCache
from planner.simulation.workload import LengthDistribution, Workload
from planner.ui import plots

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
DEFAULT = Deployment(model="kimi-k2.6", hardware="h200", gpus=8, weights="native", kv_dtype="fp8", context=8192)
UPLOADS = Path(tempfile.gettempdir()) / "kvplan-uploads"


def model_from_upload(content: bytes) -> str:
    """Validates an uploaded config.json and returns a path the planner can load it from."""
    try:
        config = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlannerError(f"the uploaded file is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise PlannerError("the uploaded file is not a config.json object")
    digest = hashlib.sha256(content).hexdigest()[:12]
    parse_model_config(config, f"uploaded-{digest}")
    UPLOADS.mkdir(exist_ok=True)
    path = UPLOADS / f"uploaded-{digest}.json"
    path.write_bytes(content)
    return str(path)


def plan_view(deployment: Deployment) -> dict[str, Any]:
    result = evaluate(deployment)
    label = f"{deployment.weights} / KV {deployment.kv_dtype}"
    return {"summary": result.summary(), "details": result.details(),
            "figure": plots.memory_breakdown({label: result.plan.breakdown()}),
            "concurrency": plots.concurrency_by_context(concurrency_curves(deployment))}


def concurrency_curves(deployment: Deployment) -> dict[str, list[tuple[int, int]]]:
    """Max concurrency at contexts of 1K, 2K, ... up to the model's limit, for each KV dtype the GPU has."""
    limit = get_model(deployment.model).max_position_embeddings
    contexts = [1024 << i for i in range(32) if 1024 << i <= limit]
    curves = {}
    for kv in KV_DTYPES:
        try:
            plan = evaluate(replace(deployment, kv_dtype=kv)).plan
        except PlannerError:            # a format this GPU does not have
            continue
        curves[kv] = [(context, plan.max_concurrency(context)) for context in contexts]
    return curves


def search_view(deployment: Deployment, slo: str, hardware: list[str], max_gpus: int, workload: str,
                requests: int) -> dict[str, Any]:
    """A search for the sidebar's model: the ranked table, the Pareto figure with the cheapest marked, the deploy
    commands of the best three; simulated in this process, cached on disk."""
    space = SearchSpace(deployment.model, tuple(hardware), max_gpus, max_num_seqs=(64, 256), chunk_budgets=(2048,))
    result = run_search(space, preset_workload(workload, requests), Slo.parse(slo), executor="serial",
                        cache=ResultCache(DEFAULT_CACHE))
    summary = result.summary(top=3)
    rows = summary["ranked"]
    return {**summary, "figure": plots.pareto_front(rows, summary["pareto"], rows[0] if rows else None)}


def integrity_overhead() -> dict[str, Any] | None:
    path = RESULTS / "integrity_cpu.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    keys = ("check_share_ownership_pct", "overhead_ownership_pct", "overhead_full_pct", "overhead_full_sampled_pct",
            "faults_injected", "faults_detected", "requests_harmed")
    return {key: data.get(key) for key in keys}


def compare_view(deployment: Deployment) -> dict[str, Any]:
    kv = kv_dtype_comparison(deployment)
    weights = weight_dtype_comparison(deployment)
    rows = {f"{w} / KV {k}": evaluate(replace(deployment, weights=w, kv_dtype=k)).plan.breakdown()
            for w, k in (("fp8", "bf16"), ("fp8", "fp8"), ("int4", "fp8"), (deployment.weights, deployment.kv_dtype))}
    return {"kv": kv, "weights": weights, "integrity": integrity_overhead(),
            "figure": plots.memory_breakdown(rows)}


def simulate_view(deployment: Deployment, workload: Workload, slo_ttft_s: float | None,
                  slo_tpot_s: float | None, curve_users: list[int]) -> dict[str, Any]:
    result = simulate(deployment, workload, record_steps=True)
    report = result.report(slo_ttft_s, slo_tpot_s)
    setup = simulation_setup(deployment)
    bars = figure_uncertainty(deployment_uncertainty(deployment), report) or None
    curve = []
    for users in curve_users:
        closed = replace(workload, arrival="closed", users=users, num_requests=max(2 * users, 40))
        point = setup.simulation(record_steps=False).run(closed).report()
        curve.append({"users": users, "output_tokens_per_s": point["output_tokens_per_s"],
                      "tpot_p99_s": point["tpot_p99_s"]})
    return {"report": report, "latency": plots.latency_percentiles(report),
            "kv": plots.kv_utilization(result.steps, setup.config.num_pages),
            "curve": plots.throughput_curve(curve, slo_tpot_s, bars), "curve_points": curve, "uncertainty_pct": bars}


SHARED_SHARES = (0.0, 0.25, 0.5, 0.75, 0.9)


def prefix_cache_view(deployment: Deployment, workload: Workload) -> dict[str, Any]:
    """The workload with a growing share of each prompt a system prompt all requests share (the prompt length
    kept): the prefix-cache hit rate and TTFT against the share of prompt tokens found cached."""
    prompt = workload.prompt.value
    points = []
    for share in SHARED_SHARES:
        shared = int(share * prompt)
        shaped = replace(workload, shared_prefix_tokens=shared,
                         prompt=replace(workload.prompt, kind="fixed", value=max(1, prompt - shared)))
        report = simulate(deployment, shaped).report()
        points.append({"shared_prefix_tokens": shared, "hit_rate": report["prefix_cache_hit_rate"],
                       "cached_share": report["cached_tokens_per_request"] / prompt,
                       "ttft_p50_s": report["ttft_p50_s"], "ttft_p99_s": report["ttft_p99_s"]})
    return {"points": points, "figure": plots.prefix_cache_curve(points)}


def verification_reports() -> list[Path]:
    return sorted(RESULTS.glob("verify*.json"))


def load_verification(path: str | Path) -> list[dict[str, Any]]:
    """The runs of a report: one for `planner verify`, one per workload for the suite."""
    data = json.loads(Path(path).read_text())
    runs = data.get("runs", [data]) if isinstance(data, dict) else None
    if not runs or not all(isinstance(run, dict) and "metrics" in run for run in runs):
        raise PlannerError(f"{Path(path).name} is not a verification report")
    return runs


def verification_tables(run: dict[str, Any]) -> dict[str, Any]:
    """Rows as calibrated and, where the run measured the machine's drift, with it taken out."""
    machine = run.get("machine")
    return {"metrics": [{"metric": name, **metric} for name, metric in run["metrics"].items()],
            "slowdown_pct": machine["slowdown_vs_profile_pct"] if machine else None,
            "drift_corrected": [{"metric": name, **metric}
                                for name, metric in machine["metrics_drift_corrected"].items()] if machine else []}


def default_workload() -> Workload:
    return Workload("poisson", 200, rate=2.0, prompt=LengthDistribution("fixed", 2048),
                    output=LengthDistribution("fixed", 512))
