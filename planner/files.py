"""Reading the planner's JSON inputs, with one-line errors that name the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.files import read_json_object
from planner.errors import PlannerError

PACKAGE = Path(__file__).resolve().parent
DATA = PACKAGE / "data"               # the catalogues (model configs, hardware, public benchmarks): package data
PROFILES = PACKAGE / "profiles"       # the committed profiles and calibrations: package data
BENCHMARKS = DATA / "benchmarks"      # the public serving measurements (*.csv) and wide-EP pools


def read_json(path: str | Path, what: str) -> dict[str, Any]:
    return read_json_object(path, what, PlannerError)
