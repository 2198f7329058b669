"""Starting a server for tests and benchmarks: in a thread of this process, or as an `engine serve` process."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from engine.core.errors import ConfigError
from engine.parallel.group import free_port

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> Iterator[str]:
    """An app from `build_app` served on a background thread of this process; yields its base URL (port 0: a
    free one)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="engine-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ConfigError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


class ServerProcess:
    """`engine serve FLAGS` as a process of its own on a free port of 127.0.0.1 (its steps then share nothing with
    the caller's interpreter), with its stderr kept: a soak signals it and reads how it drained."""

    def __init__(self, flags: list[str], timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *flags, "--port", str(self.port)],
                                        cwd=REPO, stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(f"engine serve {' '.join(flags)} did not come up: "
                                      f"{self.stderr[-500:]!r}") from None
                time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stderr(self) -> str:
        self._log.seek(0)
        return self._log.read().strip()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a graceful drain), then its exit code; killed if it is not gone within `timeout_s`."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def close(self) -> None:
        self.stop()
        self._log.close()


@contextmanager
def serve_subprocess(flags: list[str], timeout_s: float = 300.0) -> Iterator[str]:
    """A `ServerProcess` for the duration of the block; yields its base URL."""
    server = ServerProcess(flags, timeout_s)
    try:
        yield server.url
    finally:
        server.close()
