"""`planner search`: the cheapest deployment that meets latency SLOs, every candidate simulated with the engine's
own scheduler and allocator rather than judged by a formula.

1. Enumerate: hardware x GPUs per replica (powers of two up to `max_gpus`, one tensor-parallel group) x expert
   parallelism (MoE models, more than one GPU) x weights x KV dtype x `max_num_seqs` x prefill chunk budget x
   prefix caching (on and off where the workload's prompts share prefixes, else on).
2. Prune analytically what cannot work: a format the GPU lacks (NVFP4 off Blackwell), heads or experts that do
   not split, weights that leave no room for one request of the workload's longest; and what cannot meet the
   SLOs even alone: one stream's decode step above a TPOT limit, the longest prompt's prefill above a TTFT one.
3. Simulate the rest: the largest Poisson rate at which every SLO holds (bracketed in steps of 1.5x from the
   step model's estimate, then bisected; candidates that differ only in their batch limits one after another,
   each next from the answer before it), on the workload's own requests and seed; a simulation stops as soon
   as its misses settle the answer.

A fleet is replicas of one configuration: `cheapest_fleet` sizes it for a target rate. Results depend only on
the candidate, the workload, the SLOs and the bisections: any executor gives the same (`planner.search.executors`).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine.core.metrics import RequestTiming
from planner.catalog.hardware import get_hardware
from planner.catalog.models import get_model
from planner.deployment.capacity import HOURS, Deployment, deployment_uncertainty, evaluate, figure_uncertainty
from planner.deployment.commands import deploy_commands
from planner.deployment.disaggregated import DisaggregatedDeployment, disaggregated_setup
from planner.deployment.simulate import simulation_setup
from planner.deployment.speculative_plan import speculative_gain
from planner.errors import PlannerError
from planner.search.executors import ResultCache, run_tasks
from planner.search.pools import analyse_pools, pool_candidates, pools_label
from planner.search.slo import Slo
from planner.simulation.speculation import Speculation
from planner.simulation.workload import LengthDistribution, RequestSpec, Workload

DEFAULT_WEIGHTS = ("bf16", "fp8", "int4", "nvfp4")
DEFAULT_KV = ("bf16", "fp8")
DEFAULT_MAX_SEQS = (64, 256)
DEFAULT_CHUNKS = (2048, 8192)
RATE_STEP = 1.5                 # the factor a rate search steps by from the step model's estimate
MAX_RATE_RANGE = 11.0           # and how far from its starting rate it goes, at most
RATE_BISECTIONS = 3
NEAR_STEP = 1.2                 # ... and from a sibling's answer (`Task`): a narrower bracket, one bisection fewer
WIDE_REDUNDANT_EXPERTS = 32     # EPLB's copies in wide candidates, as DeepSeek's and SGLang's deployments run
RATE_KEYS = ("output_tokens_per_s", "throughput_tokens_per_s", "goodput_requests_per_s")


# (prompt, output) lengths of the presets: lognormal around a median (sigma), clipped at a maximum
WORKLOAD_PRESETS = {
    "chat": ((1000, 0.8, 8192), (256, 0.5, 1024)),
    "rag": ((4000, 0.5, 16384), (256, 0.5, 1024)),
    "summarize": ((8000, 0.4, 32768), (512, 0.4, 2048)),
    "code": ((2000, 0.6, 16384), (512, 0.6, 4096)),
}


def preset_workload(name: str, requests: int, seed: int = 0, prompt: LengthDistribution | None = None,
                    output: LengthDistribution | None = None) -> Workload:
    """A preset's Poisson workload (its rate is what the search varies); `prompt` or `output` override."""
    if name not in WORKLOAD_PRESETS:
        raise PlannerError(f"unknown workload {name!r} (choose from {', '.join(WORKLOAD_PRESETS)})")
    prompts, outputs = (LengthDistribution("lognormal", median, sigma=sigma, maximum=maximum)
                        for median, sigma, maximum in WORKLOAD_PRESETS[name])
    return Workload("poisson", requests, rate=1.0, prompt=prompt or prompts, output=output or outputs, seed=seed)


@dataclass(frozen=True)
class SearchSpace:
    model: str
    hardware: tuple[str, ...] = ("h100-sxm", "h200", "b200")
    max_gpus: int = 8
    weights: tuple[str, ...] = DEFAULT_WEIGHTS
    kv_dtypes: tuple[str, ...] = DEFAULT_KV
    max_num_seqs: tuple[int, ...] = DEFAULT_MAX_SEQS
    chunk_budgets: tuple[int, ...] = DEFAULT_CHUNKS
    explicit_formats: bool = False      # the user named the formats: NVFP4 off Blackwell is then an error
    prefix_caching: tuple[bool, ...] | None = None     # None: with and without where prompts share prefixes
    speculation: Speculation | None = None      # tried beside plain decoding on every candidate
    pool_ratios: tuple[tuple[int, int], ...] = ()   # disaggregated xPyD pools tried beside every candidate
    engine: str | None = None           # the serving engine whose fit prices every candidate (None: every engine's)

    def __post_init__(self) -> None:
        if not isinstance(self.max_gpus, int) or self.max_gpus <= 0:
            raise PlannerError(f"--max-gpus must be a positive integer, got {self.max_gpus!r}")
        for hardware in self.hardware:
            get_hardware(hardware)
        for name in ("max_num_seqs", "chunk_budgets"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v <= 0 for v in values):
                raise PlannerError(f"{name.replace('_', ' ')} must be positive integers, got {values!r}")
        if self.explicit_formats and "nvfp4" in (*self.weights, *self.kv_dtypes) and not any(
                get_hardware(h).supports_nvfp4 for h in self.hardware):
            raise PlannerError(f"NVFP4 needs Blackwell's FP4 tensor cores; none of {', '.join(self.hardware)} has "
                               f"them (b200 has)")

    def gpu_counts(self, node: int) -> list[int]:
        """Powers of two up to `max_gpus` and at most a node: no tensor-parallel group spans nodes."""
        limit = min(self.max_gpus, node)
        return [2 ** i for i in range(limit.bit_length()) if 2 ** i <= limit]

    def wide_node_counts(self, node: int) -> list[int]:
        """Nodes of a wide expert-parallel candidate: powers of two from two while they fit in `max_gpus`."""
        return [2 ** i for i in range(1, (self.max_gpus // node).bit_length()) if 2 ** i * node <= self.max_gpus]


def context_for(workload: Workload) -> int:
    """What one request may hold in the cache: the longest prompt and output among the workload's requests."""
    return max(r.prompt_tokens + r.output_tokens for r in workload.requests())


def candidates(space: SearchSpace, workload: Workload) -> list[Deployment]:
    model = get_model(space.model)
    context = min(context_for(workload), model.max_position_embeddings)
    caching = space.prefix_caching or ((True, False) if workload.shares_prefixes else (True,))
    found = []
    for hardware in space.hardware:
        spec = get_hardware(hardware)
        layouts = [{"gpus": gpus, "tensor_parallel": gpus, "expert_parallel": expert_parallel}
                   for gpus in space.gpu_counts(spec.gpus_per_node)
                   for expert_parallel in ((False, True) if model.is_moe and gpus > 1 else (False,))]
        if model.is_moe:           # beyond a node: wide expert parallelism as its published deployments run it
            layouts += [{"gpus": nodes * spec.gpus_per_node, "expert_parallel": True, "attention_data_parallel": True,
                         "redundant_experts": WIDE_REDUNDANT_EXPERTS, "two_batch_overlap": True}
                        for nodes in space.wide_node_counts(spec.gpus_per_node)]
        for layout in layouts:
            for weights in space.weights:
                for kv in space.kv_dtypes:
                    if "nvfp4" in (weights, kv) and not spec.supports_nvfp4:
                        continue        # a format this GPU does not have: not a configuration at all
                    for seqs in space.max_num_seqs:
                        for chunk in space.chunk_budgets:
                            for cached in caching:
                                found.append(Deployment(space.model, hardware, weights=weights, kv_dtype=kv,
                                                        context=context, max_num_seqs=seqs,
                                                        max_num_batched_tokens=chunk, prefix_caching=cached,
                                                        engine=space.engine, **layout))
    if space.speculation is not None:
        found = [drafted for deployment in found for drafted in (deployment, replace(deployment,
                                                                                       speculation=space.speculation))]
    return found + pool_candidates(found, space.pool_ratios, space.max_gpus)


def analyse(deployment: Deployment, workload: Workload, slo: Slo) -> tuple[str | None, float]:
    """What the step model says before any simulation: why the candidate cannot work (None if it may), and the
    rate its search starts from (what it sustains with every step as the step model prices it)."""
    if isinstance(deployment, DisaggregatedDeployment):
        return analyse_pools(deployment, workload, slo)
    try:
        capacity = evaluate(deployment)
    except PlannerError as error:
        return f"invalid: {error}", 0.0
    if not capacity.fits:
        return f"does not fit: {capacity.note}", 0.0
    requests = workload.requests()
    prompt = statistics.fmean(r.prompt_tokens for r in requests)
    output = statistics.fmean(r.output_tokens for r in requests)
    longest = max(r.prompt_tokens for r in requests)
    tpot = slo.tightest("tpot")
    one_stream = 1.0 / capacity.single_stream_tokens_per_s
    if tpot is not None and one_stream > tpot:
        return f"cannot meet tpot: one stream decodes a token in {one_stream * 1e3:.1f} ms", 0.0
    ttft = slo.tightest("ttft")
    prefill = capacity.prompt_seconds(longest)
    if ttft is not None and prefill > ttft:
        return f"cannot meet ttft: the longest prompt alone prefills in {prefill:.3f} s", 0.0
    return None, 1.0 / (prompt / capacity.prefill_tokens_per_s + output / capacity.decode_tokens_per_s)


def settled_miss(slo: Slo, requests: list[RequestSpec]) -> Callable[[RequestTiming], bool]:
    """A simulation's `give_up` hook: True once so many requests missed a limit that its percentile must miss it
    too. Percentiles are nearest-rank: the p-th of n values exceeds a limit once n - ceil(p n / 100) + 1 do.
    TTFT is judged at a request's first token, TPOT and end to end at its last."""
    defined = {"ttft": len(requests), "e2e": len(requests), "tpot": sum(1 for r in requests if r.output_tokens >= 2)}
    rules = []
    for metric, limit in slo.limits:
        family, percentile = metric.split("_")[0], int(metric.split("_")[1][1:])
        count = defined[family]
        rules.append((f"{family}_s", family != "ttft", limit, count - math.ceil(percentile * count / 100) + 1))
    misses = [0] * len(rules)

    def give_up(timing: RequestTiming) -> bool:
        ended = timing.finish_s is not None
        for index, (attribute, at_end, limit, enough) in enumerate(rules):
            value = getattr(timing, attribute) if at_end == ended else None
            if value is not None and value > limit:
                misses[index] += 1
                if misses[index] >= enough:
                    return True
        return False
    return give_up


def max_rate(deployment: Deployment, workload: Workload, slo: Slo, estimate: float,
             bisections: int = RATE_BISECTIONS, step: float = RATE_STEP) -> tuple[float, dict[str, Any] | None]:
    """The largest Poisson rate (requests/s) whose simulation meets every SLO, with that simulation's report;
    (0, None) when none tried does. From `estimate` it steps by factors of `step` up (while rates pass) or down
    (while they miss) until a pass and a miss bracket the answer, then bisects that bracket `bisections` times:
    the rate found is within (step - 1) / 2**bisections of the answer, relatively (6% by default: as fine as a
    plan needs; 5 simulations where the estimate is within `step`). A rate is dropped as soon as its simulation
    has settled a miss (`settled_miss`): overloaded runs, the longest, stop early.

    A deployment over several nodes has up to hundreds of data-parallel ranks, as alike as the step model prices
    them (each at the same load): one rank is simulated with its share of the traffic, all the workload's requests
    on it, and its rates scaled by the ranks it stands for."""
    setup = (disaggregated_setup(deployment) if isinstance(deployment, DisaggregatedDeployment)
             else simulation_setup(deployment))       # once: only the rate changes
    represented = 1
    if not isinstance(deployment, DisaggregatedDeployment) and deployment.parallel.nodes > 1:
        represented, setup = setup.replicas, replace(setup, replicas=1)      # one rank stands for all

    def passes(rate: float) -> dict[str, Any] | None:
        at_rate = replace(workload, arrival="poisson", rate=rate / represented)
        requests = at_rate.requests()
        result = setup.simulation(record_steps=False, give_up=settled_miss(slo, requests)).run(requests)
        report = None if result.abandoned else result.report()
        if report is None or not slo.met(report):
            return None
        return report | {key: report[key] * represented for key in RATE_KEYS if report.get(key) is not None}

    best = passes(estimate)
    low, high = (estimate, None) if best is not None else (None, estimate)
    for _ in range(math.ceil(math.log(MAX_RATE_RANGE) / math.log(step))):
        if low is not None and high is not None:
            break
        rate = low * step if high is None else high / step
        report = passes(rate)
        if report is None:
            high = rate
        else:
            low, best = rate, report
    if low is None:
        return 0.0, None
    if high is None:
        return low, best
    for _ in range(bisections):
        rate = (low + high) / 2
        report = passes(rate)
        if report is None:
            high = rate
        else:
            low, best = rate, report
    return low, best


@dataclass(frozen=True)
class Task:
    """Candidates that differ only in their batch limits (`max_num_seqs`, the chunk budget), searched one after
    another by one executor task. The first starts from the step model's estimate; each next one from the rate
    the one before it sustained, scaled by the ratio of their estimates: the step model's error is much the same
    for both, so that guess is usually within NEAR_STEP of the answer, and a narrower bracket with one bisection
    fewer reaches it as finely (5% against 6%) in fewer simulations. Picklable; the cache's key."""

    deployments: tuple[Deployment, ...]
    workload: Workload
    slo: Slo
    estimates: tuple[float, ...]
    bisections: int = RATE_BISECTIONS

    def key(self) -> dict[str, Any]:
        return {"deployments": [asdict(deployment) for deployment in self.deployments],
                "workload": asdict(self.workload), "slo": self.slo.text(), "estimates": list(self.estimates),
                "bisections": self.bisections}


def run_task(task: Task) -> dict[str, Any]:
    found, previous = [], None
    for deployment, estimate in zip(task.deployments, task.estimates):
        if previous is None:
            rate, report = max_rate(deployment, task.workload, task.slo, estimate, task.bisections)
        else:
            guess = previous[0] * estimate / previous[1]
            rate, report = max_rate(deployment, task.workload, task.slo, guess, max(task.bisections - 1, 0),
                                    NEAR_STEP)
        found.append({"rate": rate, "report": report})
        previous = (rate, estimate) if report is not None else None
    return {"candidates": found}


ERROR_BARRED = ("max_rate_rps", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "ttft_p99_s", "tpot_p99_s",
                "usd_per_million_tokens")


@dataclass(frozen=True)
class Ranked:
    """A configuration that meets the SLOs, at the largest rate it sustains."""

    deployment: Deployment
    rate: float
    report: dict[str, Any]
    gpu_hour_usd: float
    uncertainty: dict[str, float | None] | None = None     # the calibration's error bars (None: defaults)

    @property
    def output_tokens_per_s(self) -> float:
        return self.report["output_tokens_per_s"]

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.deployment.gpus

    @property
    def tokens_per_s_per_user(self) -> float | None:
        tpot = self.report.get("tpot_p50_s")
        return 1.0 / tpot if tpot else None

    @property
    def usd_per_hour(self) -> float:
        return self.deployment.gpus * self.gpu_hour_usd

    @property
    def usd_per_million_tokens(self) -> float:
        return self.usd_per_hour / HOURS / self.output_tokens_per_s * 1e6

    def name(self) -> str:
        d = self.deployment
        if isinstance(d, DisaggregatedDeployment):
            return pools_label(d)
        parallel = d.parallel
        layout = (f"wide-ep {parallel.nodes} nodes{f' eplb{parallel.redundant_experts}' if parallel.redundant_experts else ''}"
                  f"{' tbo' if d.two_batch_overlap else ''}" if parallel.all_to_all
                  else f"tp{parallel.tp}{' ep' if d.expert_parallel else ''}")
        return (f"{d.gpus}x{d.hardware} {layout} {d.weights}/kv {d.kv_dtype} "
                f"seqs {d.max_num_seqs} chunk {d.max_num_batched_tokens}{'' if d.prefix_caching else ' no-cache'}"
                + (f" {d.speculation.method}:{d.speculation.num_draft_tokens}" if d.speculation else ""))

    def row(self) -> dict[str, Any]:
        d = self.deployment
        pools = d.name if isinstance(d, DisaggregatedDeployment) else None
        return {"configuration": self.name(), "hardware": d.hardware, "gpus": d.gpus, "pools": pools,
                "tensor_parallel": d.prefill.parallel.tp if pools else d.parallel.tp,
                "nodes": (d.prefill.parallel.nodes + d.decode.parallel.nodes) if pools else d.parallel.nodes,
                "expert_parallel": d.expert_parallel, "weights": d.weights, "kv_dtype": d.kv_dtype,
                "max_num_seqs": d.max_num_seqs, "max_num_batched_tokens": d.max_num_batched_tokens,
                "prefix_caching": d.prefix_caching, "prefix_cache_hit_rate": self.report.get("prefix_cache_hit_rate"),
                "speculative": d.speculation.describe() if d.speculation else None,
                "max_rate_rps": round(self.rate, 4), "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 2),
                "tokens_per_s_per_user": None if self.tokens_per_s_per_user is None
                else round(self.tokens_per_s_per_user, 2),
                "ttft_p99_s": self.report["ttft_p99_s"], "tpot_p99_s": self.report["tpot_p99_s"],
                "usd_per_hour": round(self.usd_per_hour, 2),
                "usd_per_million_tokens": round(self.usd_per_million_tokens, 4),
                "uncertainty_pct": figure_uncertainty(self.uncertainty, ERROR_BARRED) or None}


@dataclass
class SearchResult:
    space: SearchSpace
    workload: Workload
    slo: Slo
    ranked: list[Ranked]
    pruned: list[tuple[Deployment, str]]
    missed: list[Deployment]            # simulated, but no rate tried met the SLOs
    simulated: int
    cached: int = 0

    @property
    def enumerated(self) -> int:
        return len(self.pruned) + self.simulated

    def pareto(self) -> list[Ranked]:
        """The ranked configurations no other beats on both tokens/s per GPU and tokens/s per user."""
        points = [r for r in self.ranked if r.tokens_per_s_per_user is not None]

        def dominated(a: Ranked) -> bool:
            return any(b.tokens_per_s_per_gpu >= a.tokens_per_s_per_gpu
                       and b.tokens_per_s_per_user >= a.tokens_per_s_per_user
                       and (b.tokens_per_s_per_gpu, b.tokens_per_s_per_user)
                       != (a.tokens_per_s_per_gpu, a.tokens_per_s_per_user) for b in points)
        return sorted((a for a in points if not dominated(a)), key=lambda r: r.tokens_per_s_per_gpu)

    def summary(self, top: int) -> dict[str, Any]:
        """The counts, the ranked rows, the Pareto front's rows, the deploy commands of the best `top`, and what
        came closest when nothing met the SLOs (`planner search --json`, the dashboard)."""
        rows = [r.row() for r in self.ranked]
        return {"enumerated": self.enumerated, "pruned": len(self.pruned), "simulated": self.simulated,
                "cached": self.cached, "met_slo": len(rows), "ranked": rows, "pareto": [r.row() for r in self.pareto()],
                "deploy": [{"configuration": r.name(), **deploy_commands(r.deployment)} for r in self.ranked[:top]],
                "speculative": self.speculative_verdict(), "disaggregation": self.disaggregation_verdict(),
                "note": None if rows else f"nothing meets these SLOs; the closest: {self.closest()}"}

    def speculative_verdict(self) -> dict[str, Any] | None:
        """With speculation in the space: whether the cheapest configuration drafts, and, for the cheapest one that
        does, the batch at which drafting stops paying (`planner.deployment.speculative_plan`)."""
        if self.space.speculation is None or not self.ranked:
            return None
        drafting = next((r for r in self.ranked if r.deployment.speculation is not None), None)
        verdict: dict[str, Any] = {"best_drafts": self.ranked[0].deployment.speculation is not None}
        if drafting is not None:
            gain = speculative_gain(evaluate(drafting.deployment), self.space.speculation)
            verdict |= {"configuration": drafting.name(), "stops_paying_at_batch": gain.stops_paying_at,
                        "single_stream_speedup": gain.summary()["single_stream_speedup"]}
        return verdict

    def disaggregation_verdict(self) -> dict[str, Any] | None:
        """With pool ratios in the space: the cheapest aggregated and disaggregated configurations and which wins
        (USD per million output tokens at the largest rate meeting the SLOs)."""
        if not self.space.pool_ratios:
            return None
        best = {kind: next((r for r in self.ranked if isinstance(r.deployment, DisaggregatedDeployment) == pools),
                           None) for kind, pools in (("aggregated", False), ("disaggregated", True))}
        verdict: dict[str, Any] = {kind: None if r is None else {
            "configuration": r.name(), "usd_per_million_tokens": round(r.usd_per_million_tokens, 4),
            "tokens_per_s_per_gpu": round(r.tokens_per_s_per_gpu, 2), "max_rate_rps": round(r.rate, 4)}
            for kind, r in best.items()}
        verdict["winner"] = None if not self.ranked else (
            "disaggregated" if isinstance(self.ranked[0].deployment, DisaggregatedDeployment) else "aggregated")
        return verdict

    def closest(self) -> str:
        """What comes nearest when nothing meets the SLOs."""
        if self.missed:
            return f"{len(self.missed)} configurations fit but miss the SLOs even at the lowest rate tried"
        reasons = sorted({reason.split(":")[0] for _, reason in self.pruned})
        return f"every configuration was pruned ({', '.join(reasons)}); the first: {self.pruned[0][1]}"


def rank(tasks: list[Task], results: list[dict[str, Any]]) -> tuple[list[Ranked], list[Deployment]]:
    ranked, missed = [], []
    for task, result in zip(tasks, results):
        for deployment, found in zip(task.deployments, result["candidates"]):
            if found["report"] is None:
                missed.append(deployment)
                continue
            price = get_hardware(deployment.hardware).with_price(deployment.gpu_hour_usd).gpu_hour_usd
            barred = deployment.decode if isinstance(deployment, DisaggregatedDeployment) else deployment
            ranked.append(Ranked(deployment, found["rate"], found["report"], price, deployment_uncertainty(barred)))
    ranked.sort(key=lambda r: (r.usd_per_million_tokens, -r.rate, r.name()))
    return ranked, missed


def check_target_rate(target_rate: float) -> None:
    if not (target_rate > 0 and math.isfinite(target_rate)):
        raise PlannerError(f"--target-rate must be a positive number of requests/s, got {target_rate!r}")


def cheapest_fleet(ranked: list[Ranked], target_rate: float) -> dict[str, Any] | None:
    """Replicas of one ranked configuration that sustain `target_rate` requests/s, at the lowest USD per hour."""
    check_target_rate(target_rate)
    fleets = [(math.ceil(target_rate / r.rate), r) for r in ranked if r.rate > 0]
    if not fleets:
        return None
    replicas, best = min(fleets, key=lambda item: (item[0] * item[1].usd_per_hour, item[1].name()))
    return {"configuration": best.name(), "replicas": replicas, "gpus": replicas * best.deployment.gpus,
            "rate_rps": round(replicas * best.rate, 4), "usd_per_hour": round(replicas * best.usd_per_hour, 2),
            "deploy": deploy_commands(best.deployment)}


def run_search(space: SearchSpace, workload: Workload, slo: Slo, executor: str = "local", workers: int | None = None,
               cache: ResultCache | None = None, progress: bool = False,
               bisections: int = RATE_BISECTIONS) -> SearchResult:
    """Enumerate, prune analytically, simulate what is left (on `executor`), rank by USD per million tokens."""
    siblings: dict[tuple, list[tuple[Deployment, float]]] = {}
    pruned = []
    for deployment in candidates(space, workload):
        reason, estimate = analyse(deployment, workload, slo)
        if reason:
            pruned.append((deployment, reason))
        else:
            limits_aside = tuple((field.name, getattr(deployment, field.name)) for field in fields(deployment)
                                 if field.name not in ("max_num_seqs", "max_num_batched_tokens"))
            siblings.setdefault(limits_aside, []).append((deployment, estimate))
    tasks = [Task(tuple(d for d, _ in group), workload, slo, tuple(e for _, e in group), bisections)
             for group in siblings.values()]
    results, from_cache = run_tasks(tasks, run_task, executor, workers, cache, progress)
    ranked, missed = rank(tasks, results)
    simulated = sum(len(task.deployments) for task in tasks)
    cached = sum(len(task.deployments) for task, hit in zip(tasks, from_cache) if hit)
    return SearchResult(space, workload, slo, ranked, pruned, missed, simulated, cached)
