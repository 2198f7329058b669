"""The processes of ranks 1..N-1 of a tensor-parallel engine: spawned on this node by rank 0, each runs
`worker_main`, which builds its `Worker` (the class rank 0 builds too) and runs every plan rank 0 broadcasts until
it sends None.

Several nodes, or `torchrun`, would launch the same `worker_main` with their own rank and a shared address
(`MASTER_ADDR:MASTER_PORT`); `RankProcesses` starts every rank on one node, on a free local port.

A worker that fails puts one line on the error queue and exits; rank 0's next collective then fails (gloo
sees the peer gone; every collective has a timeout, so nothing hangs) and the engine raises that line.
"""
from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.core.config import EngineConfig
from engine.core.errors import WorkerError
from engine.executor.worker import Worker
from engine.parallel.group import (
    broadcast_object,
    free_port,
    join_group,
    rank_device,
    receive_object,
    resolve_device,
    time_collectives,
)

MEMORY_QUERY = "memory"            # rank 0 asks every rank for the bytes it holds (`RankProcesses.gather`)
COLLECTIVES = "collectives"         # ("collectives", sizes, repeats): every rank times the collectives together
TILE_KV = "tile_kv"                 # ("tile_kv", pages): every rank copies those pages of its pool over the rest
FAILURE_WAIT_S = 5.0                # how long rank 0 waits for a failed worker's own account of what went wrong
log = logging.getLogger("engine.parallel.group")


def worker_main(rank: int, size: int, address: str, config: EngineConfig, errors: Any) -> None:
    """A worker rank: builds its shard, sizes its pool as rank 0 says, then runs every plan rank 0 broadcasts until
    it sends None."""
    group = None
    try:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = rank_device(resolve_device(config.device), rank)
        group = join_group(rank, size, address, device)
        worker = Worker(config, group, device)
        num_pages = receive_object()        # rank 0 sized the pool; None: it failed before, stop
        if num_pages is not None:
            worker.allocate_kv(num_pages)
        while num_pages is not None:
            message = receive_object()
            if message is None:
                break
            if message == MEMORY_QUERY:
                dist.gather_object(worker.memory(), dst=0)
            elif isinstance(message, tuple) and message[0] == COLLECTIVES:
                time_collectives(worker.group, *message[1:], worker.device)
            elif isinstance(message, tuple) and message[0] == TILE_KV:
                worker.kv_cache.tile(message[1])
            else:
                worker.run(message)
    except BaseException as error:          # noqa: BLE001 - whatever ends a worker is reported, then re-raised
        errors.put((rank, f"{type(error).__name__}: {error}".splitlines()[0], traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if group is not None and dist.is_initialized():
            dist.destroy_process_group()


class RankProcesses:
    """Ranks 1..N-1 of a tensor-parallel engine, spawned on this node; rank 0 joins the group here."""

    def __init__(self, config: EngineConfig, size: int, device: torch.device) -> None:
        context = mp.get_context("spawn")
        self.errors = context.Queue()
        address = f"127.0.0.1:{free_port()}"
        self.processes = [context.Process(target=worker_main, args=(rank, size, address, config, self.errors),
                                          daemon=True, name=f"engine-rank-{rank}")
                          for rank in range(1, size)]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")     # one node: gloo talks over loopback, inherited
        for process in self.processes:
            process.start()
        self.failure: str | None = None
        try:
            self.group = join_group(0, size, address, device)
        except Exception as error:  # noqa: BLE001 - a worker that died while starting says why
            self.close()
            raise self.failed(error) from None

    def failed(self, error: BaseException) -> WorkerError:
        """The error that ends the engine after a collective failed: the worker's own line if one reported."""
        if self.failure is None:
            try:
                rank, line, trace = self.errors.get(timeout=FAILURE_WAIT_S)
                log.debug("tensor-parallel worker rank %d:\n%s", rank, trace)
                self.failure = f"tensor-parallel worker rank {rank} failed: {line}"
            except Exception:  # noqa: BLE001 - queue.Empty: no worker said anything
                dead = [p.name for p in self.processes if not p.is_alive()]
                cause = (f"{', '.join(dead)} exited before saying why (see its stderr; a script that starts a "
                         f"tensor-parallel engine needs the `if __name__ == \"__main__\":` guard)" if dead
                         else str(error).splitlines()[0])
                self.failure = f"tensor-parallel engine failed: {cause}"
        return WorkerError(self.failure)

    def send(self, value: Any) -> None:
        if self.failure is not None:
            raise WorkerError(self.failure)
        try:
            broadcast_object(value)
        except RuntimeError as error:
            raise self.failed(error) from None

    def gather(self, query: str, own: Any) -> list[Any]:
        """Every rank's answer to `query`, rank 0's (`own`) first."""
        self.send(query)
        answers: list[Any] = [None] * (len(self.processes) + 1)
        try:
            dist.gather_object(own, answers, dst=0)
        except RuntimeError as error:
            raise self.failed(error) from None
        return answers

    def time_collectives(self, sizes: list[int], repeats: int, device: torch.device) -> list[dict[str, Any]]:
        """`time_collectives` on every rank at once; rank 0's timings."""
        self.send((COLLECTIVES, sizes, repeats))
        try:
            return time_collectives(self.group, sizes, repeats, device)
        except RuntimeError as error:
            raise self.failed(error) from None

    def close(self) -> None:
        """Tells the workers to stop (if the group still stands), then makes sure they are gone."""
        if dist.is_initialized():
            if self.failure is None:
                try:
                    broadcast_object(None)
                except RuntimeError:        # a worker already gone: it is joined or killed below
                    self.failure = "tensor-parallel worker gone at shutdown"
            dist.destroy_process_group()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
