"""Configuration dataclasses of the engine, validated on construction. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.errors import ConfigError
from engine.core.memory import FLOAT_DTYPES, GIB, INT4_GROUP_SIZES, kv_bytes_per_token, kv_pages_for_budget
from engine.core.speculative import SpeculativeConfig

KV_DTYPES = (*FLOAT_DTYPES, "fp8")
WEIGHT_DTYPES = (*FLOAT_DTYPES, "fp8", "int4", "native")
INTEGRITY_MODES = ("off", "ownership", "full")
CPU_DEFAULT_KV_GIB = 1.0

if TYPE_CHECKING:
    from engine.core.memory import KVLayout


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive_int(name: str, value: Any) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of continuous batching; shared by the engine and the simulator."""

    num_pages: int
    page_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False     # the simulator's default: its requests' tokens carry no identity

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive_int(name, getattr(self, name))
        _require(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                 f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                 f"must cover max_model_len ({self.max_model_len})")

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size


@dataclass(frozen=True)
class EngineConfig:
    """What `LLM` is built from: the model, its dtypes, the KV pool and the batching limits."""

    model: str = "smollm2-135m"
    num_layers: int | None = None           # keep the first N layers of a config too big for the machine
    num_experts: int | None = None          # keep the first E routed experts of each MoE layer
    weights: str = "fp32"
    kv_dtype: str | None = None
    compute_dtype: str | None = None
    group_size: int = 128
    int4_symmetric: bool = False
    device: str = "auto"
    page_size: int = 16
    kv_cache_gib: float | None = None
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    integrity: str = "ownership"
    integrity_sample_pages: int = 0         # sealed pages verified per step in `full` mode; 0 = all
    seed: int = 0
    # CPU threads for torch's kernels (process-wide); None keeps torch's default of one per core. On a shared
    # machine one thread per engine is what stays steady: a multi-threaded step waits for its slowest thread.
    num_threads: int | None = None
    # Ranks of tensor parallelism: this process is rank 0 and starts the others (engine.parallel.group).
    tensor_parallel: int = 1
    expert_parallel: bool = False           # routed experts dealt out whole over the tensor-parallel ranks
    speculative: str | None = None          # speculative decoding, "ngram:K" (engine.core.speculative)
    # CUDA: decode steps replay graphs captured at start-up for batches up to `max_graph_batch` (default
    # `max_num_seqs`); `enforce_eager` runs every step eagerly
    enforce_eager: bool = False
    max_graph_batch: int | None = None

    def __post_init__(self) -> None:
        _require(self.integrity in INTEGRITY_MODES,
                 f"unknown integrity mode {self.integrity!r} (choose from {', '.join(INTEGRITY_MODES)})")
        _require(isinstance(self.integrity_sample_pages, int) and self.integrity_sample_pages >= 0,
                 f"integrity_sample_pages must be a non-negative integer, got {self.integrity_sample_pages!r}")
        _require(self.weights in WEIGHT_DTYPES,
                 f"unknown weights dtype {self.weights!r} (choose from {', '.join(WEIGHT_DTYPES)})")
        _require(self.kv_dtype is None or self.kv_dtype in KV_DTYPES,
                 f"unknown kv dtype {self.kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
        _require(self.compute_dtype is None or self.compute_dtype in FLOAT_DTYPES,
                 f"unknown compute dtype {self.compute_dtype!r} (choose from {', '.join(FLOAT_DTYPES)})")
        _require(self.compute_dtype is None or self.weights not in FLOAT_DTYPES
                 or self.compute_dtype == self.weights,
                 f"float weights ({self.weights}) compute in their own dtype, not {self.compute_dtype!r}")
        _require(self.group_size in INT4_GROUP_SIZES,
                 f"group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {self.group_size!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel"):
            _positive_int(name, getattr(self, name))
        if self.num_pages is not None:
            _positive_int("num_pages", self.num_pages)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        for name in ("num_threads", "num_layers", "num_experts", "max_graph_batch"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        _require(isinstance(self.enable_prefix_caching, bool),
                 f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        _require(isinstance(self.enforce_eager, bool),
                 f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        _require(isinstance(self.expert_parallel, bool),
                 f"expert_parallel must be true or false, got {self.expert_parallel!r}")
        if self.speculative is not None:
            SpeculativeConfig.parse(self.speculative)
        _require(self.kv_cache_gib is None or self.kv_cache_gib > 0,
                 f"kv cache size must be positive GiB, got {self.kv_cache_gib!r}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return None if self.speculative is None else SpeculativeConfig.parse(self.speculative)

    def resolved_compute_dtype(self, on_gpu: bool) -> str:
        """Float weights compute in their dtype; quantized ones in bf16 on a GPU and fp32 on CPU."""
        if self.weights in FLOAT_DTYPES:
            return self.weights
        return self.compute_dtype or ("bf16" if on_gpu else "fp32")

    def resolved_kv_dtype(self, on_gpu: bool) -> str:
        """The KV cache is stored in the compute dtype unless told otherwise."""
        return self.kv_dtype or self.resolved_compute_dtype(on_gpu)

    def kv_pool_pages(self, layout: KVLayout, device_memory: tuple[int, int] | None = None) -> int:
        """The KV pool's size in pages, decided here and nowhere else (every rank holds as many): `num_pages` if
        given, else the pages of `kv_cache_gib`, else on a GPU (`device_memory`: its free and total bytes now, the
        weights loaded) what `gpu_memory_utilization` leaves beside what is in use, else `CPU_DEFAULT_KV_GIB`.
        ConfigError if that holds no page."""
        if self.num_pages is not None:
            return self.num_pages
        if self.kv_cache_gib is not None:
            budget = int(self.kv_cache_gib * GIB)
        elif device_memory is not None:
            free, total = device_memory
            budget = max(0, int(total * self.gpu_memory_utilization) - (total - free))
        else:
            budget = int(CPU_DEFAULT_KV_GIB * GIB)
        pages = kv_pages_for_budget(budget, layout, self.page_size)
        if pages <= 0:
            raise ConfigError(f"the KV budget holds no page of {self.page_size} tokens "
                              f"({kv_bytes_per_token(layout)} bytes per token)")
        return pages
