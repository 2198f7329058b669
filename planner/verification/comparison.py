"""Predicted against measured, the same way for every verification (the engine's and a live endpoint's):
signed relative errors and the tables a report prints. Torch-free."""
from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from planner.simulation.workload import Workload

if TYPE_CHECKING:
    pass


TIMING_METRICS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "e2e_p50_s")


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return round(100 * (predicted - measured) / measured, 3)


def compared(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    return {"predicted": predicted, "measured": measured, "error_pct": error_pct(predicted, measured)}


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
