"""Throughput, latency and cost of a deployment (its variants: `planner.deployment.comparisons`).

A deployment is a model on a number of GPUs of one kind, with weight and KV dtypes. Memory comes from
`planner.cost.memory_plan`; step times from `planner.cost.step_model`, with the efficiencies of a calibration when
one exists for that hardware and these dtypes, else the documented defaults of `StepParameters`
(`planner.calibration.parameters.step_parameters`). A workload on it is simulated by
`planner.deployment.simulate`; searching over deployments is `planner.search.deployments`.

Decode throughput at a context length: every replica runs its largest concurrency (the KV pool's, at
most `max_num_seqs`) as one decode batch. Prefill throughput: steps of `max_num_batched_tokens` new tokens, as many
prompts of the context as fit (a longer prompt's first chunk). Cost per million output tokens: GPU-hours of the whole deployment over its decode output.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

from engine.core.memory import dtype_bytes, indexer_bytes_per_token, kv_layout, tensor_parallel_traffic
from engine.core.spec import ModelSpec
from planner.calibration.parameters import FIGURE_ERRORS, step_parameters
from planner.catalog.engines import check_engine
from planner.catalog.hardware import HardwareSpec, get_hardware
from planner.catalog.models import get_model
from planner.cost.expert_parallel import all_to_all_traffic, rank_load_cv
from planner.cost.memory_plan import (
    DEFAULT_BATCHED_TOKENS,
    DEFAULT_CONTEXT,
    DEFAULT_MAX_SEQS,
    MemoryPlan,
    Parallelism,
    plan_memory,
    planned_weight_scheme,
)
from planner.cost.step_model import BatchShape, ModelCosts, Peaks, StepParameters, step_parts, step_terms, step_time
from planner.errors import PlannerError
from planner.simulation.simulator import BatchWait
from planner.simulation.speculation import Speculation

HOURS = 3600.0
MAX_GPUS_SEARCHED = 1024


@dataclass(frozen=True)
class Deployment:
    model: str
    hardware: str
    gpus: int
    weights: str = "native"
    kv_dtype: str = "fp8"
    context: int = DEFAULT_CONTEXT
    gpu_hour_usd: float | None = None
    group_size: int = 128
    tensor_parallel: int | None = None
    expert_parallel: bool = False
    attention_data_parallel: bool = False
    utilization: float = 0.9
    max_num_seqs: int = DEFAULT_MAX_SEQS
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    calibration: str | None = None
    cuda_graphs: bool | None = None         # decode steps captured in CUDA graphs (None: the catalogue's default)
    prefix_caching: bool = True             # the engine's default, and vLLM's and SGLang's
    speculation: Speculation | None = None  # speculative decoding (the simulator draws drafts and acceptance)
    gpus_per_node: int | None = None        # None: the hardware catalogue's (8 on HGX boards)
    redundant_experts: int = 0              # EPLB's extra expert copies per MoE layer
    dense_tensor_parallel: int | None = None    # under data-parallel attention (SGLang's --moe-dense-tp-size)
    two_batch_overlap: bool = False         # two micro-batches hide the all-to-alls (SGLang, DeepSeek)
    engine: str | None = None               # the serving engine whose fit prices it (None: every engine's fit)
    scheduler_recv_interval: int = 1        # SGLang's --scheduler-recv-interval: decode steps between polls
    batch_wait: BatchWait | None = None     # TensorRT-LLM's batch waiting: new prompts held for a fuller batch

    def __post_init__(self) -> None:
        if self.gpu_hour_usd is not None and not self.gpu_hour_usd >= 0:
            raise PlannerError(f"the GPU-hour price must be >= 0 USD, got {self.gpu_hour_usd!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "context", "scheduler_recv_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlannerError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")
        check_engine(self.engine)

    @property
    def draft_layers(self) -> int:
        """Layers an MTP draft module adds to the KV cache (its weights are not counted yet)."""
        return 1 if self.speculation is not None and self.speculation.method == "mtp" else 0

    @property
    def parallel(self) -> Parallelism:
        """The layout. Beyond one node no tensor-parallel group spans nodes: unless a TP size is given, a
        mixture-of-experts model spreads wide (data-parallel attention, experts over every GPU, dense layers
        replicated: how DeepSeek, SGLang and vLLM serve them on many nodes), a dense model runs a TP group per node."""
        node = self.gpus_per_node or get_hardware(self.hardware).gpus_per_node
        tp, expert, attention_dp, dense = (self.tensor_parallel, self.expert_parallel, self.attention_data_parallel,
                                           self.dense_tensor_parallel)
        if tp is None and self.gpus > node:
            if get_model(self.model).is_moe:
                expert = attention_dp = True
            if expert and attention_dp:
                dense = 1 if dense is None else dense
            else:
                tp = node
        return Parallelism(self.gpus, tp, expert, attention_dp, node, self.redundant_experts, dense)

    def layout(self) -> str:
        """The layout in words, as `planner plan` prints it."""
        parallel = self.parallel
        nodes = f"{parallel.nodes} nodes of {parallel.node_size}" if parallel.nodes > 1 else "one node"
        if parallel.all_to_all:
            redundant = f" (+{parallel.redundant_experts} redundant)" if parallel.redundant_experts else ""
            return (f"wide expert parallelism over {self.gpus} GPUs, {nodes}: attention data-parallel x"
                    f"{parallel.replicas}, routed experts{redundant} over all, dense layers TP {parallel.dense_tp}"
                    f"{', two-batch overlap' if self.two_batch_overlap else ''}")
        experts = ", experts over all GPUs" if parallel.expert_parallel else ""
        attention = ", attention data-parallel" if parallel.attention_data_parallel else ""
        return f"{parallel.dp} x TP {parallel.tp}{experts}{attention}, {nodes}"


def model_costs(model: ModelSpec, plan: MemoryPlan, two_batch_overlap: bool = False) -> ModelCosts:
    """Per-GPU step costs: this GPU's weights and KV, its share of the FLOPs (attention over its attention group,
    dense layers over theirs, the routed experts' pairs of every token that meets at them over the GPUs holding
    them), its collectives (bf16 activations: `engine.core.memory.tensor_parallel_traffic`), its all-to-alls under
    wide expert parallelism (`planner.cost.expert_parallel`) and the kernels it launches."""
    parallel = plan.parallel
    by_component = plan.weights_by_component
    head = by_component["head"] if not model.tie_word_embeddings else by_component["embeddings"]
    dense = sum(by_component[name] for name in ("attention", "dense_ffn", "shared_experts", "norms")) + head
    ffn = model.ffn
    expert_bytes, local = 0.0, None
    if ffn.moe_layers:
        if parallel.expert_parallel:
            local = parallel.local_expert_slots(ffn.num_experts)
            expert_bytes = by_component["routed_experts"] / (ffn.moe_layers * local)
        else:
            expert_bytes = by_component["routed_experts"] / (ffn.moe_layers * ffn.num_experts)
    attention_tp, dense_tp = parallel.attention_tp, parallel.dense_tp
    parts = model.component_parameters()
    routed_flops = 2.0 * ffn.moe_layers * ffn.experts_per_token * model.expert_parameters
    expert_flops = routed_flops * parallel.expert_token_sources / parallel.expert_ranks
    collective_ranks = dense_tp if parallel.all_to_all else parallel.tp
    traffic = tensor_parallel_traffic(model.num_layers, model.hidden_size, model.vocab_size, collective_ranks,
                                      dtype_bytes("bf16"), attention_parallel=not parallel.attention_data_parallel)
    expert_parallel = parallel.expert_parallel and bool(ffn.moe_layers)
    a2a = all_to_all_traffic(model.hidden_size, ffn.experts_per_token, ffn.moe_layers,
                             parallel.gpus if parallel.all_to_all else 1, parallel.node_size)
    return ModelCosts(
        dense_weight_bytes=dense,
        linear_flops_per_token=(2.0 * parts["attention"] / attention_tp
                                + 2.0 * (parts["dense_ffn"] + parts["shared_experts"]) / dense_tp + expert_flops),
        expert_flops_per_token=expert_flops,
        **{name: flops / attention_tp for name, flops in model.attention_flops().items()},
        kv_bytes_per_token=plan.kv_bytes_per_token_per_gpu,
        head_flops_per_sequence=2.0 * model.vocab_size * model.hidden_size / dense_tp,
        expert_weight_bytes=expert_bytes, num_moe_layers=ffn.moe_layers, num_experts=ffn.num_experts,
        experts_per_token=ffn.experts_per_token, local_experts=local,
        tensor_parallel=collective_ranks, collective_calls_per_step=traffic.calls_per_step,
        allreduce_bytes_per_token=traffic.allreduce_bytes_per_token,
        gather_bytes_per_sequence=traffic.gather_bytes_per_sequence,
        kernels_per_step=model.kernels_per_step(collective_ranks),
        expert_parallel_ranks=parallel.expert_ranks if expert_parallel else 1,
        expert_load_cv=rank_load_cv(local or 1, parallel.redundant_experts) if expert_parallel else 0.0,
        expert_token_sources=parallel.expert_token_sources,
        all_to_all_calls_per_step=a2a.calls_per_step, all_to_all_link_bytes_per_token=a2a.link_bytes_per_token,
        all_to_all_decode_network_bytes_per_token=a2a.decode_network_bytes_per_token,
        all_to_all_prefill_network_bytes_per_token=a2a.prefill_network_bytes_per_token,
        two_batch_overlap=two_batch_overlap and parallel.all_to_all,
        index_topk=model.attention.index_topk, indexer_flops_per_pair=model.indexer_flops_per_pair,
        indexer_bytes_per_token=indexer_bytes_per_token(kv_layout(model, plan.kv_dtype, attention_tp)))


@dataclass(frozen=True)
class Capacity:
    deployment: Deployment
    plan: MemoryPlan
    concurrency: int                    # requests of the deployment's context the KV pools hold, all replicas
    decode_batch: int                   # what each replica decodes at once: that, capped by max_num_seqs
    decode_tokens_per_s: float
    single_stream_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_step_s: float
    cost_per_million_tokens: float
    gpu_hour_usd: float
    parameters_source: str
    step_seconds: Callable[[BatchShape], float] = field(repr=False, compare=False)
    step_parts: Callable[[BatchShape], dict[str, float]] = field(repr=False, compare=False)    # seconds by part
    notes: list[str] = field(default_factory=list)
    minimum_gpus: int | None = None     # where it does not fit: the fewest GPUs of this kind that serve one request
    index_topk: int = 0                 # sparse attention: the tokens a query reads (0: dense); BatchShape.of needs it
    request_overhead_s: float = 0.0     # the API server's time per request (`StepParameters.request_overhead_s`)
    uncertainty: dict[str, float | None] | None = None  # error bar (%) by kind of figure (`Calibration.uncertainty`)

    def prompt_seconds(self, prompt_tokens: int) -> float:
        """One prompt alone: its chunks of the deployment's batched-token budget, one step each."""
        chunk = min(prompt_tokens, self.deployment.max_num_batched_tokens)
        return math.ceil(prompt_tokens / chunk) * self.step_seconds(BatchShape.of([], [(chunk, chunk)], self.index_topk))

    @property
    def fits(self) -> bool:
        """Whether the deployment serves at least one request of its context."""
        return self.concurrency > 0

    @property
    def note(self) -> str | None:
        """`all_notes` in one line; None when there is nothing to say."""
        return "; ".join(self.all_notes) or None

    @property
    def all_notes(self) -> list[str]:
        """Why it does not fit and how many GPUs would, else what limits it."""
        notes = self.plan.notes + self.notes
        if not self.fits:
            if not self.plan.notes:
                notes = [f"one request of {self.deployment.context} tokens needs more KV than the "
                         f"{self.plan.replica_capacity_tokens} tokens one replica holds"] + notes
            notes.append(f"{self.deployment.model} needs at least {self.minimum_gpus} x {self.deployment.hardware} "
                         f"for this layout and context" if self.minimum_gpus else
                         f"no count of {self.deployment.hardware} up to {MAX_GPUS_SEARCHED} serves it in this layout")
        return notes

    def summary(self) -> dict:
        """The `planner plan --json` object (../shared/DESIGN.md)."""
        return {
            "weights_bytes_per_gpu": self.plan.weights_bytes_per_gpu,
            "weights_by_component_per_gpu": self.plan.weights_by_component,
            "kv_bytes_per_token_per_gpu": self.plan.kv_bytes_per_token_per_gpu,
            "kv_capacity_tokens": self.plan.kv_capacity_tokens,
            "max_context_tokens": self.plan.max_context_tokens,
            "max_concurrency": self.concurrency,
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "cost_per_million_tokens": None if self.cost_per_million_tokens == float("inf")
            else round(self.cost_per_million_tokens, 4),
            "single_stream_decode_tokens_per_s": round(self.single_stream_tokens_per_s, 3),
            "fits": self.fits,
            "note": self.note,
        } | self.error_bars()

    def error_bars(self) -> dict:
        """Each throughput and cost figure's relative error bar (`uncertainty_pct`, from the calibration's
        cross-validation; null for uncalibrated defaults) and the band it spans, `*_low` .. `*_high`."""
        values = {"decode_tokens_per_s": self.decode_tokens_per_s, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                  "single_stream_decode_tokens_per_s": self.single_stream_tokens_per_s,
                  "cost_per_million_tokens": None if self.cost_per_million_tokens == float("inf")
                  else self.cost_per_million_tokens}
        bars = figure_uncertainty(self.uncertainty, values)
        out: dict = {"uncertainty_pct": bars or None}
        for name, pct in bars.items():
            if values[name] is not None and pct is not None:
                low, high = band(values[name], pct)
                out |= {f"{name}_low": round(low, 4), f"{name}_high": round(high, 4)}
        return out

    def details(self) -> dict:
        return {
            **self.summary(),
            "max_context_reason": self.plan.max_context_reason,
            "memory_breakdown_per_gpu": self.plan.breakdown(),
            "decode_step_s": self.decode_step_s,
            "gpu_hour_usd": self.gpu_hour_usd,
            "replicas": self.plan.parallel.replicas,
            "layout": self.deployment.layout(),
            "decode_batch_per_replica": self.decode_batch,
            "parameters_source": self.parameters_source,
            "deployment": asdict(self.deployment),
            "notes": self.all_notes,
            "minimum_gpus": self.minimum_gpus,
        }


@dataclass(frozen=True)
class Costing:
    """What a deployment's step times follow from: its hardware (priced, with measured peaks where calibrated),
    memory plan, peaks, step parameters (and where they came from) and per-GPU costs."""

    hardware: HardwareSpec
    plan: MemoryPlan
    peaks: Peaks
    params: StepParameters
    source: str
    costs: ModelCosts
    uncertainty: dict[str, float | None] | None = None  # error bar (%) by kind of figure; None: defaults, none known

    def step(self, batch: BatchShape) -> float:
        return step_time(self.costs, self.peaks, self.params, batch)

    def parts(self, batch: BatchShape) -> dict[str, float]:
        """The step's seconds by part (`planner.cost.step_model.STEP_PARTS`)."""
        return step_parts(step_terms(self.costs, batch), self.peaks, self.params)

    def single_stream_step(self, context: int) -> float:
        return self.step(BatchShape.of([context], [], self.costs.index_topk))


def costing(deployment: Deployment, model: ModelSpec) -> Costing:
    hardware = get_hardware(deployment.hardware)
    planned_weight_scheme(model, deployment.weights, deployment.group_size)
    fitted = step_parameters(hardware, deployment.model, deployment.weights, deployment.kv_dtype,
                             deployment.calibration, deployment.cuda_graphs, deployment.engine)
    params, measured = fitted.parameters, fitted.measured_peaks
    if measured is not None:
        hardware = hardware.with_measured_peaks(measured.bandwidth_bytes_per_s, measured.flops_per_s)
    hardware = hardware.with_price(deployment.gpu_hour_usd)
    plan = _memory_plan(deployment, model, hardware)
    peaks = _peaks(deployment, hardware, measured.link_bytes_per_s if measured is not None else None)
    return Costing(hardware, plan, peaks, params, fitted.source, model_costs(model, plan, deployment.two_batch_overlap),
                   fitted.uncertainty)


def catalogue_costs(deployment: Deployment) -> tuple[ModelCosts, Peaks, MemoryPlan]:
    """The deployment's per-GPU step costs and its hardware's catalogued peaks, before any step parameters: what
    a black-box calibration (`planner.endpoint.calibrate`) fits the efficiencies against."""
    model, hardware = get_model(deployment.model), get_hardware(deployment.hardware)
    planned_weight_scheme(model, deployment.weights, deployment.group_size)
    plan = _memory_plan(deployment, model, hardware)
    return model_costs(model, plan, deployment.two_batch_overlap), _peaks(deployment, hardware), plan


def _peaks(deployment: Deployment, hardware: HardwareSpec, measured_link: float | None = None) -> Peaks:
    """The hardware's peaks for the deployment's weights; a link only under tensor or expert parallelism (a measured
    one where a calibration has it), a network only across nodes."""
    parallel = deployment.parallel
    link = None if parallel.tp == 1 and not parallel.all_to_all else measured_link or hardware.link_bytes_per_s
    network = hardware.network_bytes_per_s if parallel.nodes > 1 else None
    return Peaks(hardware.bandwidth_bytes_per_s, hardware.peak_flops(deployment.weights), link, network)


def _memory_plan(deployment: Deployment, model: ModelSpec, hardware: HardwareSpec) -> MemoryPlan:
    return plan_memory(model, hardware, deployment.parallel, deployment.weights, deployment.kv_dtype,
                       deployment.group_size, deployment.utilization,
                       max_batched_tokens=deployment.max_num_batched_tokens, max_seqs=deployment.max_num_seqs,
                       draft_layers=deployment.draft_layers)


def evaluate(deployment: Deployment) -> Capacity:
    model = get_model(deployment.model)
    if deployment.context > model.max_position_embeddings:
        raise PlannerError(f"a context of {deployment.context} tokens is above {model.name}'s limit of "
                           f"{model.max_position_embeddings}")
    costed = costing(deployment, model)
    hardware, plan, topk = costed.hardware, costed.plan, costed.costs.index_topk
    parallel = deployment.parallel
    per_replica = plan.max_concurrency(deployment.context) // parallel.replicas
    batch = min(per_replica, deployment.max_num_seqs)
    notes = []
    if per_replica > deployment.max_num_seqs:
        notes.append(f"the KV pool holds {per_replica} requests per replica; max_num_seqs caps the batch at {batch}")
    decode_step = costed.step(BatchShape.of([deployment.context] * batch, [], topk))
    single = costed.single_stream_step(deployment.context) if per_replica else 0.0
    decode = parallel.replicas * batch / decode_step if batch else 0.0
    chunks = prefill_chunks(deployment.context, deployment.max_num_batched_tokens, plan.max_context_tokens,
                            deployment.max_num_seqs)
    new_tokens = sum(size for size, _ in chunks)
    prefill = parallel.replicas * new_tokens / costed.step(BatchShape.of([], chunks, topk)) if chunks else 0.0
    dollars_per_s = deployment.gpus * hardware.gpu_hour_usd / HOURS
    cost = dollars_per_s / decode * 1e6 if decode else float("inf")
    return Capacity(deployment, plan, plan.max_concurrency(deployment.context), batch, decode,
                    1.0 / single if single else 0.0, prefill, decode_step, cost, hardware.gpu_hour_usd, costed.source,
                    costed.step, costed.parts, notes,
                    None if per_replica else minimum_gpus(deployment, model, hardware), topk,
                    costed.params.request_overhead_s, costed.uncertainty)


def prefill_chunks(context: int, batched_tokens: int, max_context: int, max_seqs: int) -> list[tuple[int, int]]:
    """A prefill step at full budget: as many whole prompts of the context as the token budget (and max_num_seqs)
    holds, or, for a prompt longer than the budget, its first chunk."""
    prompt = min(context, max_context)
    if prompt <= 0:
        return []
    if prompt >= batched_tokens:
        return [(batched_tokens, batched_tokens)]
    return [(prompt, prompt)] * min(batched_tokens // prompt, max_seqs)


def deployment_uncertainty(deployment: Deployment) -> dict[str, float | None] | None:
    """The error bars of the deployment's calibration, by kind of figure (None: uncalibrated defaults)."""
    return step_parameters(get_hardware(deployment.hardware), deployment.model, deployment.weights,
                           deployment.kv_dtype, deployment.calibration, deployment.cuda_graphs,
                           deployment.engine).uncertainty


def figure_uncertainty(uncertainty: dict[str, float | None] | None, figures: Iterable[str]) -> dict[str, float | None]:
    """The error bar (%) of each named figure (`planner.calibration.parameters.FIGURE_ERRORS`); empty without a calibration."""
    if uncertainty is None:
        return {}
    return {name: uncertainty.get(FIGURE_ERRORS[name]) for name in figures if name in FIGURE_ERRORS}


def band(value: float, pct: float) -> tuple[float, float]:
    """The range a figure with a relative error bar of `pct` spans: within a factor of 1 + pct / 100 either way."""
    factor = 1 + pct / 100
    return value / factor, value * factor


def minimum_gpus(deployment: Deployment, model: ModelSpec, hardware: HardwareSpec) -> int | None:
    """The fewest GPUs of the deployment's kind, in its layout (its TP group size, if it sets one; expert and
    attention parallelism as it has them; whole nodes beyond one), whose memory holds the weights and one request of
    its context."""
    step = deployment.tensor_parallel or 1
    for gpus in range(step, MAX_GPUS_SEARCHED + 1, step):
        try:
            parallel = replace(deployment, gpus=gpus).parallel
        except PlannerError:                    # not a whole number of nodes
            continue
        plan = plan_memory(model, hardware, parallel, deployment.weights, deployment.kv_dtype, deployment.group_size,
                           deployment.utilization, max_batched_tokens=deployment.max_num_batched_tokens,
                           max_seqs=deployment.max_num_seqs, draft_layers=deployment.draft_layers)
        if plan.max_concurrency(deployment.context):
            return gpus
    return None
