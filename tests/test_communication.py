"""The alpha-beta fit of collectives: it recovers a known link from noisy timings."""
from __future__ import annotations

import numpy as np
import pytest

from planner.communication import LinkFit, fit_alpha_beta, wire_bytes
from planner.errors import PlannerError

SIZES = [1 << k for k in range(10, 24, 2)]


@pytest.mark.parametrize("op,ranks", [("all_reduce", 2), ("all_reduce", 8), ("all_gather", 4)])
def test_fit_recovers_a_synthetic_link_within_5_percent(op, ranks):
    truth = LinkFit(op, ranks, alpha_s=25e-6, beta_bytes_per_s=4e9)
    rng = np.random.default_rng(ranks)
    rows = [{"op": op, "bytes": size, "ranks": ranks, "median_s": truth.seconds(size) * rng.uniform(0.97, 1.03)}
            for size in SIZES for _ in range(3)]
    rows.append({"op": "all_gather" if op == "all_reduce" else "all_reduce", "bytes": 1, "ranks": ranks,
                 "median_s": 1.0})                                # another op's row is not mixed in
    fit = fit_alpha_beta(rows, op)
    assert abs(fit.alpha_s / truth.alpha_s - 1) < 0.05
    assert abs(fit.beta_bytes_per_s / truth.beta_bytes_per_s - 1) < 0.05


def test_wire_bytes_of_a_ring():
    assert wire_bytes("all_reduce", 1000, 2) == 1000 and wire_bytes("all_reduce", 1000, 8) == 1750
    assert wire_bytes("all_gather", 1000, 4) == 3000 and wire_bytes("all_reduce", 1000, 1) == 0


def test_too_few_sizes_are_refused():
    with pytest.raises(PlannerError, match="two message sizes"):
        fit_alpha_beta([{"op": "all_reduce", "bytes": 1024, "ranks": 2, "median_s": 1e-5}] * 3, "all_reduce")
    with pytest.raises(PlannerError, match="unknown collective 'broadcast'"):
        wire_bytes("broadcast", 10, 2)
