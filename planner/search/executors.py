"""Runs a search's simulations, each an independent task: in a local process pool (the default: nothing to set
up), in this process, or on a Ray cluster. Results are cached on disk by a hash of the task (configuration,
workload, SLOs, bisection) and of the planner's version, and come back in the tasks' order whichever executor ran
them: a simulation is a pure function of its task (seeded workloads), so the executors agree exactly."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from engine.core.step_shape import engine_version
from planner.errors import PlannerError

EXECUTORS = ("local", "serial")         # and "ray:auto", "ray:local", "ray:ADDRESS"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvplan" / "search"


class ResultCache:
    """One JSON file per task under `folder`, named by the task's hash."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @staticmethod
    def digest(key: dict[str, Any]) -> str:
        text = json.dumps({"planner": engine_version(), **key}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        path = self.folder / f"{self.digest(key)}.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def put(self, key: dict[str, Any], result: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.digest(key)}.json"
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(result))
        temporary.replace(path)                 # atomic: a concurrent reader never sees half a file


def check_executor(executor: str) -> None:
    if executor not in EXECUTORS and not (executor.startswith("ray:") and len(executor) > 4):
        raise PlannerError(f"unknown executor {executor!r} (choose from local, serial, ray:auto, ray:local, "
                           f"ray:ADDRESS)")


def run_tasks(tasks: list[Any], run: Callable[[Any], dict[str, Any]], executor: str = "local",
              workers: int | None = None, cache: ResultCache | None = None,
              progress: bool = False) -> tuple[list[dict[str, Any]], list[bool]]:
    """`run(task)` for every task (each must have `key()`), in order; and whether each came from the cache."""
    check_executor(executor)
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    todo = []
    for index, task in enumerate(tasks):
        hit = cache.get(task.key()) if cache else None
        if hit is None:
            todo.append(index)
        else:
            results[index] = hit
    bar = _progress(len(todo)) if progress and todo else None

    def done(index: int, result: dict[str, Any]) -> None:
        results[index] = result
        if cache:
            cache.put(tasks[index].key(), result)
        if bar:
            bar.update()

    if executor == "serial" or (executor == "local" and len(todo) <= 1):
        for index in todo:
            done(index, run(tasks[index]))
    elif executor == "local":
        with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            futures = {pool.submit(run, tasks[index]): index for index in todo}
            for future in as_completed(futures):
                done(futures[future], future.result())
    else:
        _run_on_ray(tasks, todo, run, executor.removeprefix("ray:"), workers, done)
    if bar:
        bar.close()
    waiting = set(todo)
    return results, [index not in waiting for index in range(len(tasks))]


def _run_on_ray(tasks: list[Any], todo: list[int], run: Callable[[Any], dict[str, Any]], address: str,
                workers: int | None, done: Callable[[int, dict[str, Any]], None]) -> None:
    """`local` starts Ray on this machine (with `workers` CPUs); `auto` joins the cluster this machine belongs to;
    anything else is a cluster's address."""
    try:
        import ray
    except ImportError:
        raise PlannerError("--ray needs Ray: pip install 'kvplan[search]'") from None
    if not ray.is_initialized():
        if address == "local":
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    remote = ray.remote(run)
    pending = {remote.remote(tasks[index]): index for index in todo}
    while pending:
        finished, _ = ray.wait(list(pending), num_returns=1)
        for ref in finished:
            done(pending.pop(ref), ray.get(ref))


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="simulating", unit="config", file=sys.stderr, leave=False)
