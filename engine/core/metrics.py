"""Request latency metrics, defined once for the engine and the simulator. Torch-free.

    arrival ──── queue, prefill ────► first token ── decode ... ──► last token (finish)
            └──────── TTFT ─────────┘└──── TPOT × (output tokens - 1) ─┘
            └──────────────────────────── end to end ──────────────────┘

A token exists at the end of the step that sampled it. TPOT is undefined for one output token (None).
Percentiles are nearest-rank, over the requests that define the metric.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RequestTiming:
    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0          # prompt tokens found in the prefix cache at admission

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(timings: list[RequestTiming], slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict[str, float | int | None]:
    """Totals and percentiles over finished requests; goodput counts those meeting both SLOs (if given)."""
    done = [t for t in timings if t.finish_s is not None]
    if not done:
        return {"completed": 0}
    start = min(t.arrival_s for t in timings)
    end = max(t.finish_s for t in done)
    span = max(end - start, 1e-12)
    output = sum(t.output_tokens for t in done)
    total = output + sum(t.prompt_tokens for t in done)
    ttft = [t.ttft_s for t in done if t.ttft_s is not None]
    tpot = [t.tpot_s for t in done if t.tpot_s is not None]
    e2e = [t.e2e_s for t in done]
    good = [t for t in done if (slo_ttft_s is None or (t.ttft_s is not None and t.ttft_s <= slo_ttft_s))
            and (slo_tpot_s is None or t.tpot_s is None or t.tpot_s <= slo_tpot_s)]
    return {
        "completed": len(done),
        "duration_s": span,
        "throughput_tokens_per_s": total / span,
        "output_tokens_per_s": output / span,
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90), "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p90_s": percentile(e2e, 90),
        "preemptions": sum(t.preemptions for t in done),
        "goodput_requests_per_s": len(good) / span,
    }
