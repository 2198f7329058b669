"""A tensor-parallel worker rank: its shard of the weights and of the KV pool, and the plans it runs."""
from __future__ import annotations

from typing import Any

import torch

from engine.config import EngineConfig
from engine.distributed import StepPlan, join_group, rank_device, receive_object
from engine.errors import WorkerError
from engine.kv_cache import PagedKVCache
from engine.llm import rank_memory, resolve_device
from engine.loader import load_model
from engine.memory import kv_layout
from engine.runner import forward_plan


class ShardWorker:
    def __init__(self, config: EngineConfig, rank: int, size: int, address: str) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = rank_device(resolve_device(config.device), rank)
        self.group = join_group(rank, size, address, self.device)
        compute_dtype = config.resolved_compute_dtype(self.device.type == "cuda")
        loaded = load_model(config.model, compute_dtype, self.device, config.seed, config, self.group)
        self.model = loaded.model
        self.page_size = config.page_size
        num_pages = receive_object()        # rank 0 sized the pool, every rank holds as many pages; None: stop
        layout = kv_layout(loaded.config, config.resolved_kv_dtype(self.device.type == "cuda"), size)
        self.kv_cache = None if num_pages is None else PagedKVCache(layout, num_pages, config.page_size, self.device)

    def memory(self) -> dict[str, Any]:
        return rank_memory(self.model, self.kv_cache)

    def run(self, plan: StepPlan) -> None:
        if plan.fail_rank == self.group.rank:
            raise WorkerError(f"fault injected into rank {self.group.rank}")
        forward_plan(self.model, self.kv_cache, plan, self.page_size, self.device)
