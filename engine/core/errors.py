"""Errors that carry a one-line message meant for the user; the CLI turns them into exit code 2."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class EngineError(ValueError):
    """A bad input: the message names the bad value."""


class ConfigError(EngineError):
    """An invalid configuration value."""


class LoaderError(EngineError):
    """A model that cannot be found or read."""


class RequestError(EngineError):
    """A request that cannot be served; rejected without touching the running ones."""


class WorkerError(EngineError):
    """A tensor-parallel worker process failed: the engine cannot go on (the message says which and why)."""


EXIT_BAD_INPUT = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), like every other bad input."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
