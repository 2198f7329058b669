"""One rank of the engine, rank 0 included: its shard of the weights, its share of the KV pool and its
`ModelRunner`. Rank 0's worker lives in the engine's process (`engine.executor.engine_core.EngineCore`); the
others are spawned (`engine.executor.rank_processes`) and run every plan rank 0 broadcasts through the same class.

Under integrity checks with tensor parallelism every rank checks a plan's tables before running it: rank 0 against
the engine's `IntegrityChecker` (before planning), the others against their own `PageRecord`, kept in step by the
record's updates that travel with the plan, so a fault on any rank is seen where it is."""
from __future__ import annotations

import logging
from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.core.errors import WorkerError
from engine.core.memory import kv_layout, with_draft_layers
from engine.executor.faults import strike
from engine.executor.integrity import PageRecord, Violation, agree
from engine.executor.model_runner import DecodeGraphs, ModelRunner, graph_batch_sizes, graphs_refused
from engine.executor.step_plan import StepPlan, WorkerFault
from engine.kernels.backend import use_triton
from engine.model.kv_cache import PagedKVCache
from engine.model.layers.moe import GroupedExperts
from engine.model.loader import load_model
from engine.model.quantized_linear import allocated_bytes_by_component
from engine.parallel.group import TensorGroup

log = logging.getLogger("engine.executor.worker")


class Worker:
    """A rank's model (loaded at construction) and, once `allocate_kv` sized it, its KV pool and runner."""

    def __init__(self, config: EngineConfig, group: TensorGroup, device: torch.device) -> None:
        self.config = config
        self.group = group
        self.device = device
        on_gpu = device.type == "cuda"
        loaded = load_model(config.model, config.resolved_compute_dtype(on_gpu), device, config.seed, config, group)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        layout = kv_layout(self.model_config, config.resolved_kv_dtype(on_gpu), config.tensor_parallel)
        self.kv_layout = with_draft_layers(layout, int(getattr(self.model, "mtp", None) is not None))
        self.kv_cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None
        self.graphs: DecodeGraphs | None = None
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.record: PageRecord | None = None           # ranks 1.. under integrity checks: their own record
        self.pending_fault: WorkerFault | None = None

    def kv_pool_pages(self) -> int:
        """The pool's pages as `EngineConfig.kv_pool_pages` sizes them on this device, the weights loaded (rank 0
        decides; every rank holds as many)."""
        memory = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else None
        return self.config.kv_pool_pages(self.kv_layout, memory)

    def graphs_refused(self) -> str | None:
        """Why this rank runs decode steps eagerly (None: it replays CUDA graphs)."""
        config = self.config
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if config.enforce_eager:
            return "--enforce-eager"
        if config.tensor_parallel > 1:
            return "tensor-parallel ranks run eagerly (collectives are not captured yet)"
        if config.speculative is not None:
            return "speculative steps verify drafts: they are not decode-only"
        experts = [module for module in self.model.modules() if isinstance(module, GroupedExperts)]
        return graphs_refused(self.model_config, getattr(self.model, "mtp", None) is not None,
                              all(module.fused_stacks() is not None for module in experts))

    def needs_pad_page(self, graphs_refused: str | None) -> bool:
        """Whether the pool keeps a page no request gets: graph replays pad their batches there, and the device
        integrity check sends a flagged request's writes there (one rank, integrity on, where Triton runs)."""
        config = self.config
        device_check = (config.integrity != "off" and config.tensor_parallel == 1
                        and use_triton(torch.empty(0, device=self.device)))
        return graphs_refused is None or device_check

    @property
    def schedulable_pages(self) -> int:
        """The pool's pages the block manager hands out: all but the padding page."""
        return self.kv_cache.num_pages - (self.runner.pad_page is not None)

    def allocate_kv(self, num_pages: int) -> None:
        """Builds the pool (its last page the padding page where one is needed) and, where graphs run, captures
        them."""
        page_size = self.config.page_size
        self.kv_cache = PagedKVCache(self.kv_layout, num_pages, page_size, self.device)
        refused = self.graphs_refused()
        pad_page = num_pages - 1 if self.needs_pad_page(refused) and num_pages > 1 else None
        if refused is None and pad_page is not None:
            sizes = graph_batch_sizes(self.config.max_num_seqs, self.config.max_graph_batch)
            self.graphs = DecodeGraphs(self.model, self.kv_cache, page_size, self.max_model_len, sizes, pad_page,
                                       capture=True)
            try:
                self.graphs.capture_all()
            except RuntimeError as error:       # a model whose step reads the device on the host: eager then
                log.warning("decode graphs could not be captured, decode steps run eagerly: %s",
                            str(error).splitlines()[0])
                self.graphs = None
                torch.cuda.synchronize(self.device)
        elif self.device.type == "cuda":
            log.info("decode steps run eagerly: %s", refused or "the pool has one page")
        self.runner = ModelRunner(self.model, self.kv_cache, page_size, self.graphs, pad_page)
        if self.group.rank and self.config.integrity != "off":
            self.record = PageRecord(self.config.integrity, num_pages, self.kv_cache,
                                     self.config.integrity_sample_pages, self.config.seed)

    def memory(self) -> dict[str, Any]:
        memory = rank_memory(self.model, self.kv_cache)
        if self.graphs is not None:
            memory |= {"graph_bytes": self.graphs.graph_bytes,
                       "graph_capture_s": round(self.graphs.capture_seconds, 3),
                       "graph_batch_sizes": self.graphs.sizes}
        return memory

    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, dict[int, Violation], torch.Tensor | None]:
        """Checks the plan (ranks 1.. against their own record), agrees with the other ranks on the items to drop,
        runs the rest and, on ranks 1.., seals the pages it filled. Returns the logits (None where the plan wants
        none), the dropped items' violations by item, and the device check's flags by item where the plan asked."""
        rank = self.group.rank
        if plan.fail_rank is not None and plan.fail_rank == rank:
            raise WorkerError(f"fault injected into rank {rank}")
        dropped: dict[int, Violation] = {}
        if plan.check:
            found = self._check(plan) if self.record is not None else []
            dropped = agree(self.group, plan, found)
            plan = plan.without(set(dropped))
        logits, flags = self.runner.forward(plan)
        if plan.check and self.record is not None:
            self.record.seal_pages(plan.filled_pages(self.config.page_size))
            if plan.calibrate_kv:
                self.record.trust_scales()
        return logits, dropped, flags

    def _check(self, plan: StepPlan) -> list[Violation]:
        if plan.worker_fault is not None and plan.worker_fault.rank == self.group.rank:
            self.pending_fault = plan.worker_fault
        self.record.apply(plan.ownership_updates)
        if self.pending_fault is not None and strike(self.pending_fault, plan, self.record, self.kv_cache):
            self.pending_fault = None
        return self.record.check_tables(list(zip(plan.seq_ids, plan.tables(), plan.leases)),
                                        plan.writes(self.config.page_size))

    def close(self) -> None:
        """Lets go of the weights, the pool and the runner (a closed engine holds no memory)."""
        self.model = self.kv_cache = self.runner = self.record = self.graphs = None


def rank_memory(model: torch.nn.Module, kv_cache: PagedKVCache) -> dict[str, Any]:
    """What one rank holds: its weight bytes by component, and its KV pool's bytes."""
    return {"weight_bytes_by_component": allocated_bytes_by_component(model), "kv_cache_bytes": kv_cache.nbytes}
