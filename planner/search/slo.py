"""Latency SLOs: the limits a search's candidates must meet, by report metric."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner.errors import PlannerError

SLO_METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "e2e_p50_s",
               "e2e_p90_s")


@dataclass(frozen=True)
class Slo:
    """Latency limits in seconds by report metric, e.g. ttft_p99_s=2, tpot_p99_s=0.05."""

    limits: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        if not self.limits:
            raise PlannerError(f"give at least one SLO (metrics: {', '.join(SLO_METRICS)})")
        for metric, limit in self.limits:
            if metric not in SLO_METRICS:
                raise PlannerError(f"unknown SLO metric {metric!r} (choose from {', '.join(SLO_METRICS)})")
            if not (isinstance(limit, (int, float)) and limit > 0 and math.isfinite(limit)):
                raise PlannerError(f"the SLO {metric} must be a positive number of seconds, got {limit!r}")

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft_p99_s=2,tpot_p99_s=0.05`."""
        limits = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            metric, equals, value = item.partition("=")
            try:
                limits.append((metric.strip(), float(value)))
            except ValueError:
                raise PlannerError(f"bad SLO {item!r}: use METRIC=SECONDS, e.g. ttft_p99_s=2") from None
            if not equals:
                raise PlannerError(f"bad SLO {item!r}: use METRIC=SECONDS, e.g. ttft_p99_s=2")
        return cls(tuple(limits))

    def met(self, report: dict[str, Any]) -> bool:
        """Every limit holds; a TPOT of requests with one output token (None) meets any."""
        return all(report.get(metric) is None and metric.startswith("tpot") or
                   report.get(metric) is not None and report[metric] <= limit for metric, limit in self.limits)

    def tightest(self, prefix: str) -> float | None:
        """The smallest limit on a metric family ("ttft", "tpot", "e2e"); None when none is set."""
        return min((limit for metric, limit in self.limits if metric.startswith(prefix)), default=None)

    def text(self) -> str:
        return ",".join(f"{metric}={limit:g}" for metric, limit in self.limits)
