"""Errors that carry a one-line message meant for the user; the CLI turns them into exit code 2."""


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
