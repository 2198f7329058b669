"""The closing-the-loop bench: a planner calibrated on our engine's GPU profile against the public measurements."""
from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import REPO

PROFILE = "planner/profiles/cuda-llama-3.1-8b-4layers-bf16-kvbf16.profile.json"


def test_engine_and_public_calibrations_are_set_against_the_same_points(tmp_path):
    done = subprocess.run([sys.executable, "bench/engine_calibrated_planner.py", "--profile", PROFILE, "--json",
                           "--out", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert json.loads((tmp_path / "out.json").read_text()) == result
    rows = result["rows"]
    assert result["points"] >= 1 and len(rows) >= result["points"]
    for row in rows:
        assert row["model"] == "llama-3.1-8b" and row["hardware"] in ("h100-sxm", "h200")
        for predicted, error in (("predicted", "error_pct"), ("public_predicted", "public_error_pct")):
            assert math.isfinite(row[predicted]) and row[predicted] > 0
            assert math.isclose(row[error], 100 * (row[predicted] / row["measured"] - 1))
    assert result["median_error_pct"]["engine"]["all"] != result["median_error_pct"]["public"]["all"]


def test_a_missing_profile_is_one_line():
    done = subprocess.run([sys.executable, "bench/engine_calibrated_planner.py", "--profile", "no/such.json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode != 0 and "no/such.json" in done.stderr and "Traceback" not in done.stderr
