"""Per-GPU memory of a deployment, exactly: weights by component and dtype, the KV pool, the reserves.

Every byte count comes from `engine.core.memory`, the arithmetic the engine itself allocates by.

    GPU memory (as the device reports it)
    └─ usable = memory × utilization (default 0.9)
       ├─ weights        per component in its format, divided as parallelism divides it
       ├─ activations    the largest step's working set (max_num_batched_tokens) and the logits
       ├─ runtime        CUDA context, communication buffers, graphs: a fixed reserve
       └─ KV pool        the rest, in whole pages: capacity in tokens

Parallelism: tensor parallelism (TP) splits attention, dense layers, shared experts and the vocabulary
over the TP group; grouped-query K/V heads split over at most their number of heads (beyond it, each GPU
holds one head, replicated); the MLA latent is replicated on every TP rank (it has no heads to split)
unless attention is data-parallel, where each GPU holds all attention weights and the cache of its own
requests only; the dense layers, shared experts and head then split over `dense_tensor_parallel` GPUs (SGLang's
--moe-dense-tp-size; 1 in wide expert-parallel deployments: replicated). Routed experts split over the TP group, or
with expert parallelism over all GPUs, whole experts per GPU, EPLB's redundant copies included.
Data parallelism (gpus / TP replicas) replicates the rest. No tensor-parallel group spans nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.errors import ConfigError
from engine.core.memory import (
    GIB,
    WeightFormat,
    ceil_div,
    component_weight_bytes,
    kv_bytes_per_token,
    kv_layout,
    weight_bytes,
    weight_scheme,
    with_draft_layers,
)
from engine.core.spec import Linear, ModelSpec
from planner.catalog.hardware import HardwareSpec
from planner.errors import PlannerError

WEIGHT_SCHEMES = ("bf16", "fp8", "int4", "nvfp4", "native")
KV_DTYPES = ("bf16", "fp8", "nvfp4")
FLOAT_DTYPE = "bf16"                  # embeddings, norms, routers and every unquantized layer
RUNTIME_RESERVE_BYTES = 1 * GIB       # CUDA context, NCCL buffers, CUDA graphs, allocator slack
WORKSPACE_BYTES = 256 << 20           # GEMM and attention kernel workspaces
ACTIVATION_WIDTHS = 8                 # hidden-sized buffers alive at once per token (residual, norms, attention)
DEFAULT_PAGE_SIZE = 16
DEFAULT_BATCHED_TOKENS = 8192
DEFAULT_MAX_SEQS = 256
DEFAULT_CONTEXT = 8192


def planned_weight_scheme(model: ModelSpec, weights: str, group_size: int = 128) -> dict[str, WeightFormat]:
    """The format of each decoder component's linear layers (`engine.core.memory.weight_scheme`, bf16 scales).
    The output head and embeddings stay bf16."""
    if weights not in WEIGHT_SCHEMES:
        raise PlannerError(f"unknown weights {weights!r} (choose from {', '.join(WEIGHT_SCHEMES)})")
    try:
        return weight_scheme(model, weights, group_size, scale_dtype=FLOAT_DTYPE)
    except ConfigError as error:
        raise PlannerError(str(error)) from None


@dataclass(frozen=True)
class Parallelism:
    gpus: int
    tensor_parallel: int | None = None        # default: all GPUs in one TP group
    expert_parallel: bool = False
    attention_data_parallel: bool = False
    gpus_per_node: int | None = None          # GPUs one NVLink domain joins (None: all of them, one node)
    redundant_experts: int = 0                # extra expert copies per MoE layer (EPLB), dealt with the rest
    dense_tensor_parallel: int | None = None  # dense FFN, shared experts, head under DP attention (None: the TP group)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus <= 0:
            raise PlannerError(f"the number of GPUs must be a positive integer, got {self.gpus!r}")
        tp = self.tp
        if not isinstance(tp, int) or tp <= 0 or self.gpus % tp:
            raise PlannerError(f"tensor parallelism {tp!r} must divide the {self.gpus} GPUs")
        node = self.node_size
        if not isinstance(node, int) or node <= 0:
            raise PlannerError(f"GPUs per node must be a positive integer, got {self.gpus_per_node!r}")
        if self.gpus > node and self.gpus % node:
            raise PlannerError(f"{self.gpus} GPUs are not a whole number of nodes of {node}")
        dense = self.dense_tp
        if not isinstance(dense, int) or dense <= 0 or tp % dense:
            raise PlannerError(f"the dense layers' tensor parallelism {dense!r} must divide the TP group of {tp}")
        if dense != tp and not self.attention_data_parallel:
            raise PlannerError("a dense tensor parallelism apart from the TP group needs data-parallel attention")
        for what, size in (("attention", self.attention_tp), ("the dense layers", dense)):
            if size > node:
                raise PlannerError(f"{what} tensor-parallel over {size} GPUs would span nodes of {node}: keep it "
                                   f"within a node (data-parallel attention with --dense-tp 1 spreads wider)")
        if not isinstance(self.redundant_experts, int) or self.redundant_experts < 0:
            raise PlannerError(f"redundant experts must be a non-negative integer, got {self.redundant_experts!r}")
        if self.redundant_experts and not self.expert_parallel:
            raise PlannerError("redundant experts need expert parallelism")

    @property
    def tp(self) -> int:
        return self.gpus if self.tensor_parallel is None else self.tensor_parallel

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def node_size(self) -> int:
        return self.gpus if self.gpus_per_node is None else self.gpus_per_node

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.node_size)

    @property
    def attention_tp(self) -> int:
        return 1 if self.attention_data_parallel else self.tp

    @property
    def dense_tp(self) -> int:
        return self.tp if self.dense_tensor_parallel is None else self.dense_tensor_parallel

    @property
    def replicas(self) -> int:
        """Independent KV pools: TP groups, or every GPU when attention is data-parallel."""
        return self.gpus if self.attention_data_parallel else self.dp

    @property
    def expert_ranks(self) -> int:
        """GPUs a layer's routed experts are spread over: all of them under expert parallelism, else the TP group
        (each holds a slice of every expert)."""
        return self.gpus if self.expert_parallel else self.tp

    @property
    def expert_token_sources(self) -> int:
        """Groups of distinct tokens that meet at the experts: the attention replicas among their ranks."""
        return self.expert_ranks // self.attention_tp

    @property
    def all_to_all(self) -> bool:
        """Tokens travel to their experts' GPUs and back (DeepEP's dispatch and combine): data-parallel attention
        in front of expert parallelism."""
        return self.expert_parallel and self.attention_data_parallel and self.gpus > 1

    def local_expert_slots(self, num_experts: int) -> int:
        """Experts one GPU holds per MoE layer: whole ones (redundant copies included) under expert parallelism."""
        if not self.expert_parallel:
            return num_experts
        return -(-(num_experts + self.redundant_experts) // self.gpus)


def component_bytes_per_gpu(model: ModelSpec, scheme: dict[str, WeightFormat],
                            parallel: Parallelism) -> dict[str, int]:
    """Weight bytes each GPU holds, by component. Under expert parallelism each GPU holds whole experts of every
    MoE layer (`Parallelism.local_expert_slots`), EPLB's redundant copies included."""
    def split(component: str, linear: Linear | None) -> tuple[int, bool]:
        if linear is None:
            return (parallel.dense_tp if component == "embeddings" else 1), False
        if component == "routed_experts":
            return (1, False) if parallel.expert_parallel else (parallel.tp, False)
        tp = parallel.attention_tp if component == "attention" else parallel.dense_tp
        if linear.shard == "replicated":
            return 1, False
        if linear.shard == "kv_heads":
            return min(tp, model.attention.num_kv_heads), False
        return tp, False

    try:
        by_component = component_weight_bytes(model, scheme, FLOAT_DTYPE, split)
    except ConfigError as error:
        raise PlannerError(f"{model.name}: {error}") from None
    experts = model.ffn.num_experts
    if parallel.expert_parallel and experts:
        routed = model.components()["routed_experts"]
        fmt = scheme.get("routed_experts", WeightFormat(FLOAT_DTYPE))
        linear_bytes = sum(fmt.linear_bytes(one.out_features, one.in_features) * one.count for one in routed.linears)
        other = by_component["routed_experts"] - linear_bytes
        by_component["routed_experts"] = linear_bytes // experts * parallel.local_expert_slots(experts) + other
    return by_component


def kv_bytes_per_token_per_gpu(model: ModelSpec, kv_dtype: str, parallel: Parallelism, draft_layers: int = 0) -> int:
    """What one cached token costs each GPU that holds it (with an MTP draft module's `draft_layers` too)."""
    if kv_dtype not in KV_DTYPES:
        raise PlannerError(f"unknown KV dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
    return kv_bytes_per_token(with_draft_layers(kv_layout(model, kv_dtype, parallel.attention_tp), draft_layers))


def kv_bytes_per_token_total(model: ModelSpec, kv_dtype: str) -> int:
    """One token's cache on one GPU holding everything (no parallelism)."""
    return kv_bytes_per_token_per_gpu(model, kv_dtype, Parallelism(1))


def activation_bytes_per_gpu(model: ModelSpec, parallel: Parallelism, max_batched_tokens: int,
                             max_seqs: int) -> int:
    """The largest step's working set: hidden-sized buffers, the widest FFN slice, fp32 logits of the samples."""
    ffn = model.ffn
    widest = max(ffn.dense_intermediate, ffn.shared_intermediate, ffn.experts_per_token * ffn.expert_intermediate)
    per_token = ACTIVATION_WIDTHS * model.hidden_size + 2 * ceil_div(widest, parallel.dense_tp)
    logits = max_seqs * ceil_div(model.vocab_size, parallel.dense_tp) * 4
    return weight_bytes(max_batched_tokens * per_token, FLOAT_DTYPE) + logits + WORKSPACE_BYTES


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    hardware: str
    parallel: Parallelism
    weights: str
    kv_dtype: str
    page_size: int
    memory_bytes_per_gpu: int
    usable_bytes_per_gpu: int
    weights_by_component: dict[str, int]
    activation_bytes_per_gpu: int
    runtime_bytes_per_gpu: int
    kv_pool_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_pages_per_replica: int
    max_position_embeddings: int
    notes: list[str] = field(default_factory=list)

    @property
    def weights_bytes_per_gpu(self) -> int:
        return sum(self.weights_by_component.values())

    @property
    def replica_capacity_tokens(self) -> int:
        return self.kv_pages_per_replica * self.page_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole deployment can keep cached at once."""
        return self.parallel.replicas * self.replica_capacity_tokens

    @property
    def max_context_tokens(self) -> int:
        return min(self.replica_capacity_tokens, self.max_position_embeddings)

    @property
    def max_context_reason(self) -> str:
        if self.replica_capacity_tokens >= self.max_position_embeddings:
            return f"the model's position limit ({self.max_position_embeddings} tokens)"
        return f"the KV pool of one replica ({self.replica_capacity_tokens} tokens)"

    def max_concurrency(self, context_tokens: int, shared_prefix_tokens: int = 0) -> int:
        """Requests of `context_tokens` each that the KV pools hold at once (whole pages per request); with a prefix
        cache, the full pages of a `shared_prefix_tokens` prefix every request opens with are held once per
        replica (short of a prompt's last token, which every request computes itself)."""
        if not isinstance(context_tokens, int) or context_tokens <= 0:
            raise PlannerError(f"the context must be a positive number of tokens, got {context_tokens!r}")
        if context_tokens > self.max_position_embeddings:
            raise PlannerError(f"a context of {context_tokens} tokens is above {self.model}'s limit of "
                               f"{self.max_position_embeddings}")
        if not 0 <= shared_prefix_tokens < context_tokens:
            raise PlannerError(f"a shared prefix must be shorter than the context ({context_tokens}), got "
                               f"{shared_prefix_tokens!r}")
        shared = shared_prefix_tokens // self.page_size
        per_request = ceil_div(context_tokens, self.page_size) - shared
        return self.parallel.replicas * (max(0, self.kv_pages_per_replica - shared) // per_request)

    def breakdown(self) -> dict[str, int]:
        """Where each GPU's memory goes; `headroom` is what the utilization fraction leaves unused
        (plus the part of a page that does not fit)."""
        parts = {"weights": self.weights_bytes_per_gpu, "kv_cache": self.kv_pool_bytes_per_gpu,
                 "activations": self.activation_bytes_per_gpu, "runtime": self.runtime_bytes_per_gpu}
        return parts | {"headroom": self.memory_bytes_per_gpu - sum(parts.values())}


def plan_memory(model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism, weights: str, kv_dtype: str,
                group_size: int = 128, utilization: float = 0.9, page_size: int = DEFAULT_PAGE_SIZE,
                max_batched_tokens: int = DEFAULT_BATCHED_TOKENS, max_seqs: int = DEFAULT_MAX_SEQS,
                max_model_len: int | None = None, draft_layers: int = 0) -> MemoryPlan:
    if not 0 < utilization <= 1:
        raise PlannerError(f"memory utilization must be in (0, 1], got {utilization!r}")
    if not isinstance(page_size, int) or page_size <= 0:
        raise PlannerError(f"the page size must be a positive number of tokens, got {page_size!r}")
    limit = model.max_position_embeddings
    if max_model_len is not None:
        if max_model_len <= 0 or max_model_len > limit:
            raise PlannerError(f"max model length {max_model_len} must be in 1..{limit} for {model.name}")
        limit = max_model_len
    for what, dtype in (("weights", weights), ("KV cache", kv_dtype)):
        if dtype == "nvfp4" and not hardware.supports_nvfp4:
            raise PlannerError(f"NVFP4 {what} need Blackwell's FP4 tensor cores; {hardware.key} has none "
                               f"(b200 has)")
    scheme = planned_weight_scheme(model, weights, group_size)
    by_component = component_bytes_per_gpu(model, scheme, parallel)
    usable = int(hardware.memory_bytes * utilization)
    activations = activation_bytes_per_gpu(model, parallel, max_batched_tokens, max_seqs)
    runtime = RUNTIME_RESERVE_BYTES
    pool = usable - sum(by_component.values()) - activations - runtime
    per_token = kv_bytes_per_token_per_gpu(model, kv_dtype, parallel, draft_layers)
    notes = []
    if pool <= 0:
        notes.append(f"the weights ({sum(by_component.values()) / GIB:.1f} GiB per GPU) and reserves do not fit "
                     f"in {usable / GIB:.1f} GiB usable per GPU: no room for a KV cache")
        pool = 0
    pages = pool // (per_token * page_size)
    return MemoryPlan(model.name, hardware.key, parallel, weights, kv_dtype, page_size, hardware.memory_bytes,
                      usable, by_component, activations, runtime, pool, per_token, pages, limit, notes)
