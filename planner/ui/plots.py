"""Plotly figures of the planner's results, for the dashboard and the reports. Plotly is imported here only."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

GIB = float(1 << 30)
MEMORY_COLORS = {"weights": "#4C78A8", "kv_cache": "#59A14F", "activations": "#F28E2B", "runtime": "#B07AA1",
                 "headroom": "#D3D3D3"}


def memory_breakdown(rows: dict[str, dict[str, int]]) -> go.Figure:
    """Stacked bars of per-GPU memory (GiB), one bar per configuration label."""
    labels = list(rows)
    figure = go.Figure()
    for part, color in MEMORY_COLORS.items():
        figure.add_bar(name=part.replace("_", " "), x=labels, y=[rows[label].get(part, 0) / GIB for label in labels],
                       marker_color=color)
    figure.update_layout(barmode="stack", yaxis_title="GiB per GPU", legend_orientation="h", height=420,
                         margin=dict(t=30, b=40))
    return figure


def throughput_curve(points: list[dict[str, float]], slo_tpot_s: float | None = None,
                     uncertainty_pct: dict[str, float | None] | None = None) -> go.Figure:
    """Output throughput and TPOT p99 against concurrency (closed-loop users), with the TPOT SLO line and, where the
    calibration has them, the error bands of both (within a factor of 1 + pct / 100 either way)."""
    users = [p["users"] for p in points]
    figure = go.Figure()
    for key, axis, color in (("output_tokens_per_s", "y", "rgba(31,119,180,0.15)"),
                             ("tpot_p99_s", "y2", "rgba(255,127,14,0.15)")):
        pct = (uncertainty_pct or {}).get(key)
        values = [p[key] for p in points]
        if pct is None or None in values:
            continue
        factor = 1 + pct / 100
        figure.add_scatter(x=users, y=[v * factor for v in values], mode="lines", line_width=0, yaxis=axis,
                           showlegend=False, hoverinfo="skip")
        figure.add_scatter(x=users, y=[v / factor for v in values], mode="lines", line_width=0, yaxis=axis,
                           fill="tonexty", fillcolor=color, name=f"±{pct:g}% ({key.split('_')[0]})",
                           hoverinfo="skip")
    figure.add_scatter(x=users, y=[p["output_tokens_per_s"] for p in points], name="output tokens/s",
                       mode="lines+markers")
    figure.add_scatter(x=users, y=[p["tpot_p99_s"] for p in points], name="TPOT p99 (s)", mode="lines+markers",
                       yaxis="y2")
    if slo_tpot_s is not None:
        figure.add_hline(y=slo_tpot_s, line_dash="dash", line_color="red", yref="y2",
                         annotation_text="TPOT SLO")
    figure.update_layout(xaxis_title="concurrent users", yaxis_title="output tokens/s",
                         yaxis2=dict(title="TPOT p99 (s)", overlaying="y", side="right"), height=420,
                         legend_orientation="h", margin=dict(t=30, b=40))
    return figure


def kv_utilization(steps: list[Any], num_pages: int) -> go.Figure:
    figure = go.Figure(go.Scatter(x=[s.start_s for s in steps], y=[s.pages_in_use / num_pages for s in steps],
                                  mode="lines", name="KV pages in use"))
    figure.update_layout(xaxis_title="simulated time (s)", yaxis_title="KV utilization", yaxis_range=[0, 1.05],
                         height=320, margin=dict(t=30, b=40))
    return figure


def prefix_cache_curve(points: list[dict[str, float]]) -> go.Figure:
    """TTFT (left axis) and the prefix-cache hit rate (right) against the share of the prompt found cached."""
    shares = [p["cached_share"] for p in points]
    figure = go.Figure()
    figure.add_scatter(x=shares, y=[p["ttft_p50_s"] for p in points], mode="lines+markers", name="TTFT p50")
    figure.add_scatter(x=shares, y=[p["ttft_p99_s"] for p in points], mode="lines+markers", name="TTFT p99")
    figure.add_scatter(x=shares, y=[p["hit_rate"] for p in points], mode="lines+markers", name="hit rate",
                       yaxis="y2", line={"dash": "dot"})
    figure.update_layout(xaxis_title="share of prompt tokens found cached", yaxis_title="seconds",
                         yaxis2={"title": "prefix-cache hit rate", "overlaying": "y", "side": "right",
                                 "range": [0, 1.05]},
                         height=360, margin=dict(t=30, b=40))
    return figure


def latency_percentiles(report: dict[str, Any]) -> go.Figure:
    names = ["TTFT", "TPOT", "end to end"]
    keys = [("ttft_p50_s", "ttft_p99_s"), ("tpot_p50_s", "tpot_p99_s"), ("e2e_p50_s", "e2e_p90_s")]
    figure = go.Figure()
    figure.add_bar(name="p50", x=names, y=[report.get(k[0]) or 0 for k in keys])
    figure.add_bar(name="p99 (e2e: p90)", x=names, y=[report.get(k[1]) or 0 for k in keys])
    figure.update_layout(barmode="group", yaxis_title="seconds", yaxis_type="log", height=360,
                         margin=dict(t=30, b=40))
    return figure


def predicted_vs_measured(result: dict[str, Any]) -> go.Figure:
    """Each metric as a point (measured, predicted), normalized to the measured value; the diagonal is exact."""
    names, ratios, texts = [], [], []
    for name, metric in result["metrics"].items():
        if metric["measured"] in (None, 0) or metric["predicted"] is None:
            continue
        names.append(name)
        ratios.append(metric["predicted"] / metric["measured"])
        texts.append(f"predicted {metric['predicted']:.4g}, measured {metric['measured']:.4g}")
    figure = go.Figure()
    figure.add_bar(x=names, y=ratios, text=[f"{100 * (r - 1):+.1f}%" for r in ratios], hovertext=texts,
                   marker_color=["#59A14F" if abs(r - 1) <= 0.15 else "#E15759" for r in ratios])
    figure.add_hline(y=1.0, line_dash="dash", annotation_text="exact")
    figure.update_layout(yaxis_title="predicted / measured", height=420, margin=dict(t=30, b=80),
                         title="Planner predictions against the engine")
    return figure


def pareto_front(points: list[dict[str, Any]], front: list[dict[str, Any]], chosen: dict[str, Any] | None) -> go.Figure:
    """Every configuration that met the SLOs (tokens/s per GPU against tokens/s per user), the Pareto front
    through them, and the chosen one (the cheapest per token) marked."""
    def scatter(rows: list[dict[str, Any]], **style: Any) -> None:
        figure.add_scatter(x=[r["tokens_per_s_per_user"] for r in rows], y=[r["tokens_per_s_per_gpu"] for r in rows],
                           text=[r["configuration"] for r in rows], hovertemplate="%{text}<br>%{x:.1f} tok/s per user"
                           "<br>%{y:.1f} tok/s per GPU<extra></extra>", **style)

    figure = go.Figure()
    scatter(points, mode="markers", name="meets the SLOs", marker=dict(color="#A0A0A0", size=7))
    ordered = sorted(front, key=lambda r: r["tokens_per_s_per_user"])
    scatter(ordered, mode="lines+markers", name="Pareto front", marker=dict(color="#4C78A8", size=9))
    if chosen is not None:
        scatter([chosen], mode="markers", name="cheapest per token",
                marker=dict(color="#E15759", size=16, symbol="star"))
    figure.update_layout(xaxis_title="tokens/s per user", yaxis_title="tokens/s per GPU", height=460,
                         legend_orientation="h", margin=dict(t=30, b=40))
    return figure


def concurrency_by_context(curves: dict[str, list[tuple[int, int]]]) -> go.Figure:
    """Max concurrency against context length, one line per KV dtype (log-log: each doubling of the context
    halves what the pool holds)."""
    figure = go.Figure()
    for kv, points in curves.items():
        figure.add_scatter(x=[c for c, _ in points], y=[n for _, n in points], mode="lines+markers",
                           name=f"KV {kv}")
    figure.update_layout(xaxis_title="context per request (tokens)", yaxis_title="max concurrent requests",
                         xaxis_type="log", yaxis_type="log", height=380, legend_orientation="h",
                         margin=dict(t=30, b=40))
    return figure
