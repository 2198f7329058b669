"""The chaos soak at test size: a live `engine serve` process under a few hundred requests of a hostile mix
(bench/soak.py runs the full 2,000)."""
from __future__ import annotations

from engine.server.soak import SoakConfig, run_soak
from engine.server.soak_verdict import table

SMALL = SoakConfig(requests=256, clients=32, faults=4, prompts=6, max_tokens=(4, 8, 16), last_wave_tokens=16,
                   memory_gib=0.05, bad_share=0.08, seed=3)


def test_a_small_soak_loses_nothing():
    report = run_soak(SMALL)
    counts = report["counts"]
    assert report["failures"] == [], table(report)
    assert counts["requests"] == SMALL.requests
    assert counts["exact"] >= SMALL.requests * 0.7            # most requests were well-formed and checked
    assert counts["hung_up"] > 0 and counts["bad"] == counts["bad_right_status"] > 0
    assert len(report["faults"]) == SMALL.faults and counts["victims"] >= SMALL.faults
    assert report["pages_used_idle"] == 0 and report["pages_quarantined"] > 0    # faults quarantine, nothing leaks
    assert report["shutdown"]["exit_code"] == 0 and report["shutdown"]["probe_statuses"] == [503] * 3
