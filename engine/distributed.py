"""Tensor parallelism over `torch.distributed`: one process per rank on this node, gloo on CPU, NCCL on CUDA.

Rank 0 is the process that built the `LLM`: it owns the scheduler, the block manager and the integrity table,
and before every forward pass it broadcasts the step's plan (`engine.step_plan.StepPlan`: token ids,
positions, cache slots, block tables; plain lists). With integrity checks on, every rank checks the plan's
tables against its own record and the ranks agree on the violations in one small all-reduce before the
forward pass (`engine.integrity.agree`). Ranks 1..N-1 are worker processes the engine spawns itself (no
`torchrun`); each holds its shard of the weights and of the KV pool (its attention heads), runs the same
forward pass on the plan, and meets the others in the collectives: one all-reduce after attention and one
after the feed-forward of every layer, one after the vocab-parallel embedding, one all-gather of the
vocab-parallel logits.

Several nodes, or `torchrun`, would launch the same `worker_main` with their own rank and a shared address
(`MASTER_ADDR:MASTER_PORT`); this module starts every rank on one node, on a free local port.

A worker that fails puts one line on the error queue and exits; rank 0's next collective then fails (gloo
sees the peer gone; every collective has a timeout, so nothing hangs) and the engine raises that line.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.errors import EngineError, WorkerError

if TYPE_CHECKING:
    from engine.config import EngineConfig

MEMORY_QUERY = "memory"            # rank 0 asks every rank for the bytes it holds (`Workers.gather`)
COLLECTIVES = "collectives"         # ("collectives", sizes, repeats): every rank times the collectives together
TILE_KV = "tile_kv"                 # ("tile_kv", pages): every rank copies those pages of its pool over the rest
COLLECTIVE_TIMEOUT_S = 120          # a collective a peer never joins ends in an error, not a hang
FAILURE_WAIT_S = 5.0                # how long rank 0 waits for a failed worker's own account of what went wrong

log = logging.getLogger("engine.distributed")


@dataclass
class CollectiveStats:
    """What this rank's collectives took so far: the profiler reads the change over a step."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class TensorGroup:
    """This process's place in the tensor-parallel group; size 1 is the single-device engine (no collective)."""

    rank: int = 0
    size: int = 1
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)

    def _timed(self, x: torch.Tensor, collective: Callable[[], Any]) -> None:
        start = time.perf_counter()
        collective()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        self.stats.bytes += x.nbytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of partial results (a row-parallel matmul's, a vocab shard's embeddings)."""
        if self.size > 1:
            self._timed(x, lambda: dist.all_reduce(x))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's slice of the last dimension (its vocab shard's logits), concatenated in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        x = x.contiguous()
        self._timed(x, lambda: dist.all_gather(parts, x))
        return torch.cat(parts, dim=-1)

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The integrity checks' agreement; not in `stats`, which count the model's own collectives."""
        if self.size > 1:
            if dist.get_backend() == "nccl":
                x = x.cuda()            # this rank's device (`join_group` set it)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x


SINGLE = TensorGroup()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(rank: int, size: int, address: str, device: torch.device) -> TensorGroup:
    if dist.is_initialized():
        raise EngineError("this process already belongs to a torch.distributed group: one tensor-parallel "
                          "engine per process")
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend_for(device), init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TensorGroup(rank, size)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def worker_main(rank: int, size: int, address: str, config: EngineConfig, errors: Any) -> None:
    """A worker rank: builds its shard, then runs every plan rank 0 broadcasts until it sends None."""
    from engine.worker import ShardWorker

    group = None
    try:
        worker = ShardWorker(config, rank, size, address)
        group = worker.group
        while worker.kv_cache is not None:
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


COLLECTIVE_OPS = ("all_reduce", "all_gather")


def time_collectives(group: TensorGroup, sizes: list[int], repeats: int, device: torch.device) -> list[dict[str, Any]]:
    """Every rank runs this together: the median seconds of each collective on fp32 messages of each size in
    bytes (the all-gather's size is one rank's part), after a barrier and one untimed call."""
    rows = []
    for op in COLLECTIVE_OPS:
        for size in sizes:
            x = torch.ones(max(1, size // 4), device=device)
            parts = [torch.empty_like(x) for _ in range(group.size)]
            run = (lambda: dist.all_reduce(x)) if op == "all_reduce" else (lambda: dist.all_gather(parts, x))
            run()
            dist.barrier()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            rows.append({"op": op, "bytes": x.nbytes, "ranks": group.size, "median_s": sorted(times)[len(times) // 2],
                         "times_s": [round(t, 7) for t in times]})
    return rows


def broadcast_object(value: Any) -> None:
    """From rank 0 to every rank: a step's plan, the KV pool's page count at start-up, None to stop."""
    dist.broadcast_object_list([value], src=0)


def receive_object() -> Any:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Workers:
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

    def tile_kv(self, pages: list[int]) -> None:
        """`PagedKVCache.tile` on every worker's shard (rank 0 tiles its own)."""
        self.send((TILE_KV, pages))

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
