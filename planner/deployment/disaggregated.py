"""Disaggregated deployments (xPyD): a prefill pool and a decode pool of the same model, and the link between them.

Each pool is a `Deployment` of its own (its GPUs, parallelism, batch limits); both hold the same weights and KV
dtype, since the decode pool reads the pages the prefill pool wrote. A prompt's KV crosses from its prefill
replica to its decode replica: every page it touched, whole, in one copy of the model's cache
(`engine.core.memory.handoff_bytes`, the engine's own arithmetic), over NVLink when both pools sit in one node
and over the GPUs' NICs otherwise, each GPU of a replica sending its own share.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.core.memory import handoff_bytes, kv_layout, with_draft_layers
from planner.catalog.hardware import get_hardware
from planner.catalog.models import get_model
from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.simulate import SimulationSetup, simulation_setup
from planner.errors import PlannerError
from planner.simulation.disaggregated import DisaggregatedSimulation, HandoffLink
from planner.simulation.simulator import SimulationResult
from planner.simulation.workload import Workload

LINKS = ("auto", "nvlink", "network")


@dataclass(frozen=True)
class DisaggregatedDeployment:
    prefill: Deployment
    decode: Deployment
    link: str = "auto"                  # auto: NVLink when both pools fit in one node, else the NICs
    link_latency_s: float = 0.0         # per hand-off, before its bytes flow (a calibration's, on CPU)

    def __post_init__(self) -> None:
        for name in ("model", "hardware", "weights", "kv_dtype", "group_size", "context"):
            if getattr(self.prefill, name) != getattr(self.decode, name):
                raise PlannerError(f"the prefill and decode pools differ in {name} ({getattr(self.prefill, name)!r} "
                                   f"and {getattr(self.decode, name)!r}): the decode pool reads the prefill pool's "
                                   f"pages")
        if self.link not in LINKS:
            raise PlannerError(f"unknown hand-off link {self.link!r} (choose from {', '.join(LINKS)})")
        if self.prefill.speculation is not None or self.decode.speculation is not None:
            raise PlannerError("speculative decoding with disaggregated pools is not planned yet")

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    # what both pools share, or what a search reports of the pair: the decode pool's batch, the prefill pool's chunks
    model = property(lambda self: self.decode.model)
    hardware = property(lambda self: self.decode.hardware)
    gpu_hour_usd = property(lambda self: self.decode.gpu_hour_usd)
    weights = property(lambda self: self.decode.weights)
    kv_dtype = property(lambda self: self.decode.kv_dtype)
    context = property(lambda self: self.decode.context)
    expert_parallel = property(lambda self: self.decode.expert_parallel)
    prefix_caching = property(lambda self: self.prefill.prefix_caching)
    max_num_seqs = property(lambda self: self.decode.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.prefill.max_num_batched_tokens)
    speculation = None

    @property
    def resolved_link(self) -> str:
        if self.link != "auto":
            return self.link
        return "nvlink" if self.gpus <= self.decode.parallel.node_size else "network"

    @property
    def name(self) -> str:
        """xPyD: the engine instances (TP groups) of each pool."""
        return f"{self.prefill.parallel.dp}P{self.decode.parallel.dp}D"

    def handoff_bytes(self, prompt_tokens: int) -> int:
        """The bytes a prompt's hand-off moves: one copy of the model's cache of its pages."""
        plan = evaluate(self.decode).plan
        layout = with_draft_layers(kv_layout(get_model(self.decode.model), self.decode.kv_dtype),
                                   self.decode.draft_layers)
        return handoff_bytes(layout, prompt_tokens, plan.page_size)

    def handoff_link(self) -> HandoffLink:
        """The link the simulator prices hand-offs on: this deployment's bytes over its NVLink or NICs."""
        return HandoffLink(self.link_bytes_per_s(), self.link_latency_s, self.handoff_bytes)

    def link_bytes_per_s(self) -> float:
        """One prefill replica to one decode replica: each GPU of the narrower replica sends over its own link."""
        hardware = get_hardware(self.decode.hardware)
        per_gpu = hardware.link_bytes_per_s if self.resolved_link == "nvlink" else hardware.network_bytes_per_s
        gpus = min(pool.parallel.gpus // pool.parallel.replicas for pool in (self.prefill, self.decode))
        return per_gpu * gpus


@dataclass(frozen=True)
class DisaggregatedSetup:
    prefill: SimulationSetup
    decode: SimulationSetup
    link: HandoffLink

    def simulation(self, **options: Any) -> DisaggregatedSimulation:
        return DisaggregatedSimulation(self.prefill.config, self.prefill.step_time, self.prefill.replicas,
                                       self.decode.config, self.decode.step_time, self.decode.replicas, self.link,
                                       self.prefill.receive_interval, request_overhead_s=self.decode.request_overhead_s,
                                       receive_interval=self.decode.receive_interval, **options)


def disaggregated_setup(deployment: DisaggregatedDeployment) -> DisaggregatedSetup:
    return DisaggregatedSetup(simulation_setup(deployment.prefill), simulation_setup(deployment.decode),
                              deployment.handoff_link())


@dataclass(frozen=True)
class DisaggregatedRun:
    result: SimulationResult
    simulation: DisaggregatedSimulation

    def report(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict[str, Any]:
        """The simulation's report with the hand-offs: bytes per request, transfer time (queueing included)."""
        report = self.result.report(slo_ttft_s, slo_tpot_s)
        stats = self.simulation.stats
        seconds = sorted(stats.seconds)
        report.update({
            "handoffs": stats.transfers,
            "handoff_bytes": stats.bytes,
            "handoff_bytes_per_request": stats.bytes / stats.transfers if stats.transfers else 0.0,
            "handoff_p50_s": seconds[len(seconds) // 2] if seconds else 0.0,
            "handoff_max_s": seconds[-1] if seconds else 0.0,
            "prefill_kv_utilization_peak": stats.prefill_peak_pages / self.simulation.prefill_config.num_pages,
        })
        return report


def simulate_disaggregated(deployment: DisaggregatedDeployment, workload: Workload, progress: bool = False,
                           record_steps: bool = False, **options: Any) -> DisaggregatedRun:
    simulation = disaggregated_setup(deployment).simulation(progress=progress, record_steps=record_steps, **options)
    return DisaggregatedRun(simulation.run(workload), simulation)


def split_pools(deployment: Deployment, prefill_replicas: int, decode_replicas: int,
                decode_max_num_seqs: int | None = None, prefill_instance_gpus: int | None = None,
                decode_instance_gpus: int | None = None) -> DisaggregatedDeployment:
    """xPyD from an aggregated deployment's engine instance (a TP group, or a wide expert-parallel group over nodes):
    `prefill_replicas` and `decode_replicas` instances of it, or of the pools' own instance sizes (SGLang's DeepSeek
    run: a prefill instance of 4 nodes, a decode one of 9)."""
    for name, count in (("prefill", prefill_replicas), ("decode", decode_replicas)):
        if not isinstance(count, int) or count <= 0:
            raise PlannerError(f"the {name} replicas must be a positive integer, got {count!r}")
    for name, gpus in (("prefill", prefill_instance_gpus), ("decode", decode_instance_gpus)):
        if gpus is not None and (not isinstance(gpus, int) or gpus <= 0):
            raise PlannerError(f"the {name} instance's GPUs must be a positive integer, got {gpus!r}")

    def pool(replicas: int, instance_gpus: int | None, **changes: Any) -> Deployment:
        instance = replace(deployment, gpus=instance_gpus) if instance_gpus else deployment
        size = instance.parallel.tp
        return replace(deployment, gpus=replicas * size, tensor_parallel=size,
                       expert_parallel=instance.parallel.expert_parallel,
                       attention_data_parallel=instance.parallel.attention_data_parallel,
                       dense_tensor_parallel=instance.parallel.dense_tensor_parallel, **changes)

    decode = pool(decode_replicas, decode_instance_gpus,
                  **({"max_num_seqs": decode_max_num_seqs} if decode_max_num_seqs else {}))
    return DisaggregatedDeployment(pool(prefill_replicas, prefill_instance_gpus), decode)


def parse_pools(text: str) -> tuple[int, int]:
    """'1P3D' or '1:3' into (prefill replicas, decode replicas)."""
    cleaned = text.upper().replace("P", ":").replace("D", "").strip(":")
    try:
        prefill, decode = (int(part) for part in cleaned.split(":"))
    except ValueError:
        raise PlannerError(f"bad pools {text!r}: write prefill and decode replicas as 1P3D or 1:3") from None
    if prefill <= 0 or decode <= 0:
        raise PlannerError(f"bad pools {text!r}: both pools need at least one replica")
    return prefill, decode


def plan_summary(deployment: DisaggregatedDeployment) -> dict[str, Any]:
    """What `planner plan --disaggregate` reports: the pools, the hand-off at full context, each pool's own
    capacity and rate (prefill tokens/s from the prefill pool, decode tokens/s and concurrency from the decode pool),
    the cost of all GPUs per decoded token (`planner.deployment.commands.pool_commands` deploys it)."""
    prefill, decode = evaluate(deployment.prefill), evaluate(deployment.decode)
    if not (prefill.fits and decode.fits):
        pool = "prefill" if not prefill.fits else "decode"
        raise PlannerError(f"the {pool} pool does not fit: {(prefill if pool == 'prefill' else decode).note}")
    context = min(deployment.decode.context, decode.plan.max_position_embeddings)
    link = deployment.handoff_link()
    decode_rate = decode.summary()["decode_tokens_per_s"]
    usd_per_s = deployment.gpus * decode.gpu_hour_usd / 3600
    return {
        "pools": deployment.name, "gpus": deployment.gpus, "prefill_gpus": deployment.prefill.gpus,
        "decode_gpus": deployment.decode.gpus, "link": deployment.resolved_link,
        "link_gb_s": round(link.bytes_per_s / 1e9, 3),
        "handoff_bytes_per_token": deployment.handoff_bytes(decode.plan.page_size) // decode.plan.page_size,
        "handoff_s_at_context": round(link.seconds(deployment.handoff_bytes(context)), 6),
        "prefill_tokens_per_s": prefill.summary()["prefill_tokens_per_s"],
        "decode_tokens_per_s": decode_rate, "max_concurrency": decode.summary()["max_concurrency"],
        "max_context_tokens": min(prefill.summary()["max_context_tokens"], decode.summary()["max_context_tokens"]),
        "cost_per_million_tokens": round(usd_per_s / decode_rate * 1e6, 4) if decode_rate else None,
    }
