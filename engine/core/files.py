"""Reading a JSON object from a file, with a one-line error that names the file: the engine's and the planner's
inputs alike (each raises its own error class). Torch-free."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: str | Path, what: str, error: type[Exception]) -> dict[str, Any]:
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as failure:
        raise error(f"{what} {str(path)!r} is not readable JSON: {failure}") from None
    if not isinstance(document, dict):
        raise error(f"{what} {str(path)!r} is not a JSON object")
    return document
