"""Tensor parallelism over `torch.distributed`: one process per rank on this node, gloo on CPU, NCCL on CUDA.

Rank 0 is the process that built the `LLM`: it owns the scheduler, the block manager and the integrity table,
and before every forward pass it broadcasts the step's plan (`engine.executor.step_plan.StepPlan`: token ids,
positions, cache slots, block tables; plain lists). With integrity checks on, every rank checks the plan's
tables against its own record and the ranks agree on the violations in one small all-reduce before the
forward pass (`engine.executor.integrity.agree`). Ranks 1..N-1 are worker processes the engine spawns itself (no
`torchrun`); each holds its shard of the weights and of the KV pool (its attention heads), runs the same
forward pass on the plan, and meets the others in the collectives: one all-reduce after attention and one
after the feed-forward of every layer, one after the vocab-parallel embedding, one all-gather of the
vocab-parallel logits.

The worker ranks themselves, and their start-up, are `engine.executor.workers`: this module is the group as
every layer sees it (a leaf under the model).
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.core.errors import ConfigError, EngineError

COLLECTIVE_TIMEOUT_S = 120          # a collective a peer never joins ends in an error, not a hang


@dataclass
class CollectiveStats:
    """What this rank's collectives took so far: the profiler reads the change over a step. On a GPU a collective
    only queues work, so its time is known only by waiting for the device after it: `timed` (the profiler sets it)
    pays that wait; serving does not (and a CUDA graph cannot be captured around a wait)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    timed: bool = False


@dataclass(frozen=True)
class TensorGroup:
    """This process's place in the tensor-parallel group; size 1 is the single-device engine (no collective)."""

    rank: int = 0
    size: int = 1
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)

    def _timed(self, x: torch.Tensor, collective: Callable[[], Any]) -> None:
        start = time.perf_counter()
        collective()
        if x.is_cuda and self.stats.timed:
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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but no CUDA GPU is available")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}") from None


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


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
