"""Reading the planner's JSON inputs, with one-line errors that name the file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.errors import PlannerError

PACKAGE = Path(__file__).resolve().parent
DATA = PACKAGE / "data"               # the catalogues (model configs, hardware, public benchmarks): package data
PROFILES = PACKAGE / "profiles"       # the committed profiles and calibrations: package data


def read_json(path: str | Path, what: str) -> dict[str, Any]:
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlannerError(f"{what} {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlannerError(f"{what} {str(path)!r} is not readable JSON: {error}") from None
    if not isinstance(document, dict):
        raise PlannerError(f"{what} {str(path)!r} is not a JSON object")
    return document
