"""The planner's one error type: bad input, reported by the CLI as one line and exit code 2."""
from __future__ import annotations


class PlannerError(ValueError):
    """A bad model, hardware, dtype, file or number; the message names the value."""
