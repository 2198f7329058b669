"""Predictions checked against the engine: the same workload through the real engine and the simulator.

The engine runs on this machine with the profile's model and dtypes, requests arriving at the workload's
times with prompts of the requested lengths cut from real English text and outputs of exactly the
requested lengths. The simulator runs the same requests through the engine's scheduler with the step
times of a calibration fitted to the profile. Every metric follows `engine.metrics` on both sides.

Two predictions are exact by construction and reported as such: the KV capacity (both sides use
`engine.memory`), and, with the engine's own step durations replayed, the preemption count and the
sequence of batches. The timing metrics carry the step-time model's error.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from engine.memory import GIB, KVLayout, kv_pages_for_budget
from engine.metrics import summarize
from planner.calibration import calibrate, check_fingerprint, load_profile, profile_costs
from planner.errors import PlannerError
from planner.models import get_model
from planner.simulator import Simulation, model_step_time, replayed_step_time
from planner.step_model import Peaks, StepParameters, step_time
from planner.workload import Workload

TIMING_METRICS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "e2e_p50_s")


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return round(100 * (predicted - measured) / measured, 3)


def _metric(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    return {"predicted": predicted, "measured": measured, "error_pct": error_pct(predicted, measured)}


def predicted_kv_capacity(profile: dict[str, Any], kv_cache_gib: float, page_size: int) -> int:
    """The planner's own arithmetic for the engine's pool: the model's KV layout over the budget."""
    spec = get_model(profile["fingerprint"]["model"])
    layout = KVLayout(spec.num_layers, spec.attention.num_kv_heads, spec.attention.head_dim,
                      profile["fingerprint"]["kv_dtype"])
    return kv_pages_for_budget(int(kv_cache_gib * GIB), layout, page_size) * page_size


def english_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of the requested lengths cut one after another from a fixed English text."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode(" ".join(topics[key] for key in sorted(topics)))
    prompts, cursor = [], 0
    for length in lengths:
        if length > len(ids):
            raise PlannerError(f"a prompt of {length} tokens is longer than the text it is cut from ({len(ids)})")
        if cursor + length > len(ids):
            cursor = 0
        prompts.append(ids[cursor:cursor + length])
        cursor += length
    return prompts


def verify(profile_path: str, workload: Workload, kv_cache_gib: float = 0.25, max_num_seqs: int = 256,
           max_num_batched_tokens: int = 2048, max_mape: float = 1e9) -> dict[str, Any]:
    from engine.llm import LLM
    from engine.profile_format import engine_version
    from engine.serving import ServeRequest, serve

    profile = load_profile(profile_path)
    fingerprint = profile["fingerprint"]
    check_fingerprint(fingerprint, "profile", engine_version=engine_version())
    if fingerprint.get("device") != "cpu":
        raise PlannerError(f"verification runs the engine here, on a CPU; this profile is from "
                           f"{fingerprint.get('device_name')!r}")
    calibration = calibrate(profile, max_mape)
    params, peaks = StepParameters(**calibration["parameters"]), Peaks(**calibration["peaks"])
    costs = profile_costs(profile["model"])
    llm = LLM(model=fingerprint["model_source"], weights=fingerprint["weights"], kv_dtype=fingerprint["kv_dtype"],
              group_size=fingerprint.get("group_size") or 128, device="cpu", page_size=fingerprint["page_size"],
              kv_cache_gib=kv_cache_gib,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              integrity=fingerprint.get("integrity", "ownership"))
    specs = workload.requests()
    if any(spec.arrival_s is None for spec in specs):
        raise PlannerError("verification needs arrival times: use a poisson, gamma or trace workload")
    prompts = english_prompts(llm.tokenizer, [spec.prompt_tokens for spec in specs])
    requests = [ServeRequest(spec.arrival_s, prompt, spec.output_tokens) for spec, prompt in zip(specs, prompts)]
    served = serve(llm, requests, clock="wall")

    config = llm.scheduler_config
    simulated = Simulation(config, model_step_time(lambda batch: step_time(costs, peaks, params, batch)),
                           record_steps=True).run(list(specs))
    replayed = Simulation(config, replayed_step_time([s.duration_s for s in served.steps]),
                          record_steps=True).run(list(specs))
    measured = summarize(served.timings)
    predicted = simulated.report()
    metrics = {
        "kv_capacity_tokens": _metric(predicted_kv_capacity(profile, kv_cache_gib, config.page_size),
                                      llm.capacity_tokens),
        "peak_concurrency": _metric(predicted["max_concurrency_reached"], max(s.running for s in served.steps)),
        "preemptions": _metric(predicted["preemptions"], served.preemptions),
        **{name: _metric(predicted[name], measured[name]) for name in TIMING_METRICS},
    }
    replay = {"preemptions": _metric(replayed.preemptions, served.preemptions),
              "same_batches": [s.batch for s in replayed.steps] == [s.batch for s in served.steps],
              "steps": len(served.steps)}
    return {"metrics": metrics, "replay": replay, "workload": _workload_dict(workload),
            "fingerprint": fingerprint, "calibration": {k: v for k, v in calibration.items()
                                                        if k.startswith(("mape", "holdout")) or k == "parameters"},
            "engine": {"kv_cache_gib": kv_cache_gib, "max_num_seqs": max_num_seqs,
                       "max_num_batched_tokens": max_num_batched_tokens, "capacity_tokens": llm.capacity_tokens}}


def _workload_dict(workload: Workload) -> dict[str, Any]:
    out = asdict(workload)
    for key in ("prompt", "output"):
        out[key] = {k: v for k, v in out[key].items() if v not in ((), None)}
    return out


def markdown_report(result: dict[str, Any]) -> str:
    rows = ["| metric | predicted | measured | error |", "| --- | ---: | ---: | ---: |"]
    for name, metric in result["metrics"].items():
        error = "-" if metric["error_pct"] is None else f"{metric['error_pct']:+.1f}%"
        rows.append(f"| {name} | {_fmt(metric['predicted'])} | {_fmt(metric['measured'])} | {error} |")
    fp = result["fingerprint"]
    replay = result["replay"]
    return "\n".join([
        f"# Verification: {fp['model']} ({fp['weights']} weights, {fp['kv_dtype']} KV) on {fp['device_name']}",
        "", f"Workload: `{result['workload']}`", "", *rows, "",
        f"Replaying the engine's {replay['steps']} measured step times, the simulator formed "
        f"{'the same' if replay['same_batches'] else 'DIFFERENT'} batches; preemptions predicted "
        f"{replay['preemptions']['predicted']}, measured {replay['preemptions']['measured']}.",
        "", f"Calibration fit: {result['calibration']}", ""])


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
