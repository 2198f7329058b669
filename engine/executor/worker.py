"""A tensor-parallel worker rank: its shard of the weights and of the KV pool, and the plans it runs."""
from __future__ import annotations

from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.core.errors import WorkerError
from engine.core.memory import kv_layout
from engine.executor.faults import WorkerFault, strike
from engine.executor.integrity import PageRecord, agree
from engine.executor.runner import forward_plan
from engine.executor.step_plan import StepPlan
from engine.model.kv_cache import PagedKVCache
from engine.model.loader import load_model
from engine.model.quantized_linear import allocated_bytes_by_component
from engine.parallel.group import join_group, rank_device, receive_object, resolve_device


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
        self.record = None if self.kv_cache is None or config.integrity == "off" else PageRecord(
            config.integrity, num_pages, self.kv_cache, config.integrity_sample_pages, config.seed)
        self.pending_fault: WorkerFault | None = None

    def memory(self) -> dict[str, Any]:
        return rank_memory(self.model, self.kv_cache)

    def run(self, plan: StepPlan) -> None:
        """Checks the plan's tables against this rank's own record (rank 0 sends the record's updates with the
        plan), agrees with the other ranks on what to drop, runs the rest, seals what it filled."""
        rank = self.group.rank
        if plan.fail_rank == rank:
            raise WorkerError(f"fault injected into rank {rank}")
        if plan.worker_fault is not None and plan.worker_fault.rank == rank:
            self.pending_fault = plan.worker_fault
        if plan.check:
            self.record.apply(plan.ownership_updates)
            if self.pending_fault is not None and strike(self.pending_fault, plan, self.record, self.kv_cache):
                self.pending_fault = None
            found = self.record.check_tables(list(zip(plan.seq_ids, plan.tables(), plan.leases)),
                                            plan.writes(self.page_size))
            plan = plan.without(set(agree(self.group, plan, found)))
        forward_plan(self.model, self.kv_cache, plan, self.page_size, self.device)
        if plan.check:
            self.record.seal_pages(plan.filled_pages(self.page_size))
            if plan.calibrate_kv:
                self.record.trust_scales()


def rank_memory(model: torch.nn.Module, kv_cache: PagedKVCache) -> dict[str, Any]:
    """What one rank holds: its weight bytes by component, and its KV pool's bytes."""
    return {"weight_bytes_by_component": allocated_bytes_by_component(model), "kv_cache_bytes": kv_cache.nbytes}
