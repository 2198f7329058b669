"""Predicted against measured, the same way for every verification (the engine's and a live endpoint's):
signed relative errors and the tables a report prints. Torch-free."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from planner.simulation.workload import Workload

TIMING_METRICS = ("output_tokens_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s",
                  "e2e_p50_s")
# Drift probes agree when they time the same reference step alike all run long: their scatter (the interquartile
# range of one probe's timings over their median, or an endpoint's probe before the workload against after it) at
# most this many percent. Then the drift they measured is one thing and the drift-corrected figures are the
# verification's; otherwise the figures as measured are. Beside one steady busy core the probes of a disaggregated
# verification scattered 10.8% (2026-12-04; corrected TTFT p50 -1.0%, TPOT p50 -11.1% where the raw figures were
# -28.5% and -37.7%); a neighbour that comes and goes moves one decode step 2x from minute to minute (0.42, 0.88,
# 0.80, 0.39 s: docs/engine.md), a scatter of tens of percent.
PROBES_AGREE_PCT = 20.0


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return round(100 * (predicted - measured) / measured, 3)


def compared(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    return {"predicted": predicted, "measured": measured, "error_pct": error_pct(predicted, measured)}


def gate(measured: dict[str, dict[str, Any]], drift_corrected: dict[str, dict[str, Any]],
         probe_scatter_pct: float | None) -> dict[str, Any]:
    """The one figure per timing metric a verification is judged by, declared: the drift-corrected one when the
    drift probes agree (scatter within `PROBES_AGREE_PCT`), as measured otherwise."""
    agree = probe_scatter_pct is not None and probe_scatter_pct <= PROBES_AGREE_PCT
    return {"basis": "drift_corrected" if agree else "measured", "probe_scatter_pct": probe_scatter_pct,
            "metrics": dict(drift_corrected if agree else {name: measured[name] for name in drift_corrected})}


def gate_line(judged: dict[str, Any]) -> str:
    scatter = judged["probe_scatter_pct"]
    return (f"judged on the {judged['basis'].replace('_', '-')} figures (drift probes scattered "
            + ("-" if scatter is None else f"{scatter:.1f}%") + f"; they agree within {PROBES_AGREE_PCT:g}%)")


def workload_dict(workload: Workload) -> dict[str, Any]:
    out = asdict(workload)
    for key in ("prompt", "output"):
        out[key] = {k: v for k, v in out[key].items() if v not in ((), None)}
    return out


def metrics_table(metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: each metric predicted, measured and the error."""
    rows = ["| metric | predicted | measured | error |", "| --- | ---: | ---: | ---: |"]
    for name, metric in metrics.items():
        error = "-" if metric["error_pct"] is None else f"{metric['error_pct']:+.1f}%"
        rows.append(f"| {name} | {_fmt(metric['predicted'])} | {_fmt(metric['measured'])} | {error} |")
    return rows


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
