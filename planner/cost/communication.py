"""Collectives as the alpha-beta model: a fixed latency per call plus the bytes each rank puts on the wire
over the link's bandwidth, fitted to the profile's collectives timed alone (`engine.parallel.group`).

Bytes on the wire per rank, as ring algorithms move them (NCCL's and gloo's large-message choice):
all-reduce of a message of B bytes over n ranks 2 (n - 1) / n x B, all-gather of parts of B bytes (n - 1) x B.
Tree and NVLS algorithms move fewer bytes for small messages; their lower latency shows in the fitted alpha.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.errors import PlannerError


def wire_bytes(op: str, message_bytes: float, ranks: int) -> float:
    """Bytes each rank sends for one collective (for an all-gather, `message_bytes` is one rank's part)."""
    if ranks <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (ranks - 1) / ranks * message_bytes
    if op == "all_gather":
        return float((ranks - 1) * message_bytes)
    raise PlannerError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class LinkFit:
    op: str
    ranks: int
    alpha_s: float                  # seconds per call, whatever its size
    beta_bytes_per_s: float         # wire bytes per second per rank

    def seconds(self, message_bytes: float) -> float:
        return self.alpha_s + wire_bytes(self.op, message_bytes, self.ranks) / self.beta_bytes_per_s


def fit_alpha_beta(rows: list[dict[str, Any]], op: str) -> LinkFit:
    """Least squares on relative error (timings span microseconds to milliseconds) over one op's rows
    {"bytes", "ranks", "median_s"}; the latency is kept non-negative."""
    points = [row for row in rows if row["op"] == op]
    if len(points) < 2 or len({row["bytes"] for row in points}) < 2:
        raise PlannerError(f"fitting {op} needs timings at two message sizes at least, got {len(points)}")
    ranks = points[0]["ranks"]
    seconds = np.array([row["median_s"] for row in points])
    wire = np.array([wire_bytes(op, row["bytes"], ranks) for row in points])
    design = np.stack([np.ones_like(wire), wire], axis=1) / seconds[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if alpha < 0:                               # latency too small to see: the bandwidth term alone
        alpha, inverse_beta = 0.0, float(np.sum(wire / seconds) / np.sum((wire / seconds) ** 2))
    if inverse_beta <= 0:
        raise PlannerError(f"{op} timings do not grow with message size: no bandwidth to fit")
    return LinkFit(op, ranks, float(alpha), float(1.0 / inverse_beta))
