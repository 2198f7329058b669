"""Throughput, latency and cost of a deployment, and the comparisons the mission is about.

A deployment is a model on a number of GPUs of one kind, with weight and KV dtypes. Memory comes from
`planner.cost.memory_plan`; step times from `planner.cost.step_model`, with the efficiencies of a calibration when
one exists for that hardware and these dtypes, else the documented defaults of `StepParameters`
(`planner.calibration.profile_fit.step_parameters`). The simulation of a workload on it is here too; searching over
deployments is `planner.search.deployments`.

Decode throughput at a context length: every replica runs its largest concurrency (the KV pool's, at
most `max_num_seqs`) as one decode batch. Prefill throughput: one chunk of `max_num_batched_tokens` new
tokens per step. Cost per million output tokens: GPU-hours of the whole deployment over its decode output.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.core.config import SchedulerConfig
from engine.core.memory import dtype_bytes, indexer_bytes_per_token, kv_layout, tensor_parallel_traffic
from engine.core.metrics import RequestTiming
from engine.core.spec import ModelSpec
from planner.calibration.profile_fit import FIGURE_ERRORS, step_parameters
from planner.catalog.hardware import HardwareSpec, get_hardware
from planner.catalog.models import get_model
from planner.cost.memory_plan import (
    DEFAULT_BATCHED_TOKENS,
    DEFAULT_CONTEXT,
    DEFAULT_MAX_SEQS,
    MemoryPlan,
    Parallelism,
    plan_memory,
    weight_scheme,
)
from planner.cost.step_model import BatchShape, ModelCosts, Peaks, StepParameters, step_parts, step_terms, step_time
from planner.errors import PlannerError
from planner.simulation.simulator import Simulation, SimulationResult, StepTime, model_step_time
from planner.simulation.workload import Workload

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

    def __post_init__(self) -> None:
        if self.gpu_hour_usd is not None and not self.gpu_hour_usd >= 0:
            raise PlannerError(f"the GPU-hour price must be >= 0 USD, got {self.gpu_hour_usd!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlannerError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")

    @property
    def parallel(self) -> Parallelism:
        return Parallelism(self.gpus, self.tensor_parallel, self.expert_parallel, self.attention_data_parallel)


def model_costs(model: ModelSpec, plan: MemoryPlan) -> ModelCosts:
    """Per-GPU step costs: this GPU's weights and KV, its share of the FLOPs, its collectives (bf16 activations:
    `engine.core.memory.tensor_parallel_traffic`) and the kernels it launches."""
    parallel = plan.parallel
    by_component = plan.weights_by_component
    head = by_component["head"] if not model.tie_word_embeddings else by_component["embeddings"]
    dense = sum(by_component[name] for name in ("attention", "dense_ffn", "shared_experts", "norms")) + head
    ffn = model.ffn
    expert_bytes, local = 0.0, None
    if ffn.moe_layers:
        total_experts = ffn.moe_layers * ffn.num_experts
        if parallel.expert_parallel:
            local = -(-ffn.num_experts // parallel.gpus)
            expert_bytes = by_component["routed_experts"] / (ffn.moe_layers * local)
        else:
            expert_bytes = by_component["routed_experts"] / total_experts
    attention_tp = parallel.attention_tp
    traffic = tensor_parallel_traffic(model.num_layers, model.hidden_size, model.vocab_size, parallel.tp,
                                      dtype_bytes("bf16"), attention_parallel=not parallel.attention_data_parallel)
    return ModelCosts(
        dense_weight_bytes=dense,
        linear_flops_per_token=model.linear_flops_per_token / parallel.tp,
        expert_flops_per_token=2.0 * ffn.moe_layers * ffn.experts_per_token * model.expert_parameters / parallel.tp,
        **{name: flops / attention_tp for name, flops in model.attention_flops().items()},
        kv_bytes_per_token=plan.kv_bytes_per_token_per_gpu,
        head_flops_per_sequence=2.0 * model.vocab_size * model.hidden_size / parallel.tp,
        expert_weight_bytes=expert_bytes, num_moe_layers=ffn.moe_layers, num_experts=ffn.num_experts,
        experts_per_token=ffn.experts_per_token, local_experts=local,
        tensor_parallel=parallel.tp, collective_calls_per_step=traffic.calls_per_step,
        allreduce_bytes_per_token=traffic.allreduce_bytes_per_token,
        gather_bytes_per_sequence=traffic.gather_bytes_per_sequence,
        kernels_per_step=model.kernels_per_step(parallel.tp),
        expert_parallel_ranks=parallel.gpus if parallel.expert_parallel and ffn.moe_layers else 1,
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
    weight_scheme(model, deployment.weights, deployment.group_size)
    fitted = step_parameters(hardware, deployment.model, deployment.weights, deployment.kv_dtype,
                             deployment.calibration, deployment.cuda_graphs)
    params, measured = fitted.parameters, fitted.measured_peaks
    if measured is not None:
        hardware = hardware.with_measured_peaks(measured.bandwidth_bytes_per_s, measured.flops_per_s)
    hardware = hardware.with_price(deployment.gpu_hour_usd)
    plan = _memory_plan(deployment, model, hardware)
    peaks = _peaks(deployment, hardware, measured.link_bytes_per_s if measured is not None else None)
    return Costing(hardware, plan, peaks, params, fitted.source, model_costs(model, plan), fitted.uncertainty)


def catalogue_costs(deployment: Deployment) -> tuple[ModelCosts, Peaks, MemoryPlan]:
    """The deployment's per-GPU step costs and its hardware's catalogued peaks, before any step parameters: what
    a black-box calibration (`planner.endpoint.live`) fits the efficiencies against."""
    model, hardware = get_model(deployment.model), get_hardware(deployment.hardware)
    weight_scheme(model, deployment.weights, deployment.group_size)
    plan = _memory_plan(deployment, model, hardware)
    return model_costs(model, plan), _peaks(deployment, hardware), plan


def _peaks(deployment: Deployment, hardware: HardwareSpec, measured_link: float | None = None) -> Peaks:
    """The hardware's peaks for the deployment's weights; a link only under tensor parallelism (a measured one
    where a calibration has it)."""
    link = None if deployment.parallel.tp == 1 else measured_link or hardware.link_bytes_per_s
    return Peaks(hardware.bandwidth_bytes_per_s, hardware.peak_flops(deployment.weights), link)


def _memory_plan(deployment: Deployment, model: ModelSpec, hardware: HardwareSpec) -> MemoryPlan:
    return plan_memory(model, hardware, deployment.parallel, deployment.weights, deployment.kv_dtype,
                       deployment.group_size, deployment.utilization,
                       max_batched_tokens=deployment.max_num_batched_tokens, max_seqs=deployment.max_num_seqs)


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
    chunk = min(deployment.max_num_batched_tokens, plan.max_context_tokens)
    prefill = parallel.replicas * chunk / costed.step(BatchShape.of([], [(chunk, chunk)], topk)) if chunk else 0.0
    dollars_per_s = deployment.gpus * hardware.gpu_hour_usd / HOURS
    cost = dollars_per_s / decode * 1e6 if decode else float("inf")
    return Capacity(deployment, plan, plan.max_concurrency(deployment.context), batch, decode,
                    1.0 / single if single else 0.0, prefill, decode_step, cost, hardware.gpu_hour_usd, costed.source,
                    costed.step, costed.parts, notes,
                    None if per_replica else minimum_gpus(deployment, model, hardware), topk,
                    costed.params.request_overhead_s, costed.uncertainty)


def deployment_uncertainty(deployment: Deployment) -> dict[str, float | None] | None:
    """The error bars of the deployment's calibration, by kind of figure (None: uncalibrated defaults)."""
    return step_parameters(get_hardware(deployment.hardware), deployment.model, deployment.weights,
                           deployment.kv_dtype, deployment.calibration, deployment.cuda_graphs).uncertainty


def figure_uncertainty(uncertainty: dict[str, float | None] | None, figures: Iterable[str]) -> dict[str, float | None]:
    """The error bar (%) of each named figure (`planner.calibration.profile_fit.FIGURE_ERRORS`); empty without a calibration."""
    if uncertainty is None:
        return {}
    return {name: uncertainty.get(FIGURE_ERRORS[name]) for name in figures if name in FIGURE_ERRORS}


def band(value: float, pct: float) -> tuple[float, float]:
    """The range a figure with a relative error bar of `pct` spans: within a factor of 1 + pct / 100 either way."""
    factor = 1 + pct / 100
    return value / factor, value * factor


def minimum_gpus(deployment: Deployment, model: ModelSpec, hardware: HardwareSpec) -> int | None:
    """The fewest GPUs of the deployment's kind, in its layout (its TP group size, if it sets one; expert and
    attention parallelism as it has them), whose memory holds the weights and one request of its context."""
    step = deployment.tensor_parallel or 1
    for gpus in range(step, MAX_GPUS_SEARCHED + 1, step):
        parallel = Parallelism(gpus, deployment.tensor_parallel, deployment.expert_parallel,
                               deployment.attention_data_parallel)
        plan = plan_memory(model, hardware, parallel, deployment.weights, deployment.kv_dtype, deployment.group_size,
                           deployment.utilization, max_batched_tokens=deployment.max_num_batched_tokens,
                           max_seqs=deployment.max_num_seqs)
        if plan.max_concurrency(deployment.context):
            return gpus
    return None


def compare(deployment: Deployment, weights: list[str], kv_dtypes: list[str]) -> list[Capacity]:
    """Several dtype configurations of one deployment, side by side; one that does not fit still gets a row."""
    return [evaluate(replace(deployment, weights=w, kv_dtype=kv)) for w in weights for kv in kv_dtypes]


def sparse_attention_crossover(deployment: Deployment) -> int | None:
    """The shortest context from which one stream decodes faster with the model's sparse attention (DSA) than
    with dense MLA over every cached token (the same model without its indexer and its keys' cache); None for
    a model without sparse attention, or where dense attention stays as fast up to the position limit."""
    model = get_model(deployment.model)
    attention = model.attention
    if not attention.index_topk:
        return None
    dense = replace(model, attention=replace(attention, indexer_layers=0, indexer_heads=0, indexer_head_dim=0,
                                             indexer_types=(), index_topk=0))
    sparse_step = costing(deployment, model).single_stream_step
    dense_step = costing(deployment, dense).single_stream_step
    low, high = 1, model.max_position_embeddings
    if dense_step(high) <= sparse_step(high):
        return None
    while low < high:           # dense minus sparse grows with the context: the first context where it is > 0
        middle = (low + high) // 2
        if dense_step(middle) > sparse_step(middle):
            high = middle
        else:
            low = middle + 1
    return low


def kv_dtype_comparison(deployment: Deployment) -> dict:
    """BF16 against FP8 KV: context, concurrency, throughput at each one's largest concurrency."""
    rows = {kv: evaluate(_with(deployment, kv_dtype=kv)) for kv in ("bf16", "fp8")}
    bf16, fp8 = rows["bf16"], rows["fp8"]
    return {kv: row.summary() for kv, row in rows.items()} | {
        "capacity_ratio": _ratio(fp8.plan.kv_capacity_tokens, bf16.plan.kv_capacity_tokens),
        "concurrency_ratio": _ratio(fp8.concurrency, bf16.concurrency),
        "decode_throughput_ratio": _ratio(fp8.decode_tokens_per_s, bf16.decode_tokens_per_s),
    }


def weight_dtype_comparison(deployment: Deployment, baseline: str = "fp8", candidate: str = "int4") -> dict:
    """FP8 against INT4 weights: size, single-stream decode speed, prefill speed."""
    rows = {w: evaluate(_with(deployment, weights=w)) for w in (baseline, candidate)}
    base, cand = rows[baseline], rows[candidate]
    return {w: row.summary() for w, row in rows.items()} | {
        "weight_bytes_ratio": _ratio(cand.plan.weights_bytes_per_gpu, base.plan.weights_bytes_per_gpu),
        "single_stream_speedup": _ratio(cand.single_stream_tokens_per_s, base.single_stream_tokens_per_s),
        "prefill_speedup": _ratio(cand.prefill_tokens_per_s, base.prefill_tokens_per_s),
    }


def _with(deployment: Deployment, **changes) -> Deployment:
    return replace(deployment, calibration=None, **changes) if deployment.calibration else replace(deployment, **changes)


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 4) if denominator else None


@dataclass(frozen=True)
class SimulationSetup:
    """What the simulator needs of a deployment: one replica's scheduler limits, its step time, the replicas, and
    the API server's time per request."""

    config: SchedulerConfig
    step_time: StepTime
    replicas: int
    request_overhead_s: float = 0.0

    def simulation(self, **options: Any) -> Simulation:
        """A simulation of the deployment (`Simulation`'s options: router, record_steps, progress, give_up)."""
        return Simulation(self.config, self.step_time, self.replicas, request_overhead_s=self.request_overhead_s,
                          **options)


def simulation_setup(deployment: Deployment) -> SimulationSetup:
    result = evaluate(deployment)
    plan = result.plan
    if plan.kv_pages_per_replica <= 0:
        raise PlannerError(f"{deployment.model} leaves no room for a KV cache on {deployment.gpus} x "
                           f"{deployment.hardware} with {deployment.weights} weights")
    return SimulationSetup(scheduler_config(plan, deployment), model_step_time(result.step_seconds, result.index_topk),
                           plan.parallel.replicas, result.request_overhead_s)


def scheduler_config(plan: MemoryPlan, deployment: Deployment) -> SchedulerConfig:
    """One replica's scheduler: its KV pool from the memory plan, its limits from the deployment."""
    return SchedulerConfig(num_pages=plan.kv_pages_per_replica, page_size=plan.page_size,
                           max_num_seqs=deployment.max_num_seqs,
                           max_num_batched_tokens=deployment.max_num_batched_tokens,
                           max_model_len=plan.max_position_embeddings)


def simulate(deployment: Deployment, workload: Workload, router: str = "least-loaded", progress: bool = False,
             record_steps: bool = False,
             give_up: Callable[[RequestTiming], bool] | None = None) -> SimulationResult:
    """The workload through the deployment's replicas, each running the engine's scheduler (stopped early where
    `give_up` says the outcome is settled)."""
    return simulation_setup(deployment).simulation(router=router, record_steps=record_steps, progress=progress,
                                                   give_up=give_up).run(workload)


def preemption_onset(deployment: Deployment, workload: Workload, max_users: int) -> int:
    """The KV-limited concurrency: the most closed-loop users the KV pool serves without one preemption."""
    def preempts(users: int) -> bool:
        return simulate(deployment, replace(workload, arrival="closed", users=users)).preemptions > 0

    if not preempts(max_users):
        return max_users
    low, high = 0, max_users            # invariant: low users never preempt, high users do
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if preempts(middle) else (middle, high)
    return low
