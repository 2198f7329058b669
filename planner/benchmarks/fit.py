"""GPU step parameters fitted to measured serving benchmarks, each point replayed in the simulator, cross-validated.

A point (`planner.benchmarks.formats.BenchmarkPoint`) says what ran: a model on GPUs, its lengths, its load (a closed
loop at a concurrency, or Poisson arrivals at a rate), and what it measured (TPOT, ITL, TTFT, output tokens/s).
Replaying it means running that load through the simulator, the engine's own scheduler and block manager on the
deployment's KV pool, every step priced by the one step formula (`planner.cost.step_model.step_parts`). The replay
keeps each step's shape and start, and each request's steps:

    request r:  arrives ─ API server (o) ─ waits for the step in progress (a share of it) ─ steps k..first ─ ..last
                TTFT_r = o + share × d[k-1] + d[k] + ... + d[first]   TPOT_r = (d[first+1] + ... + d[last]) / (out - 1)
    run:        output tokens/s = output tokens / (steps' durations + idle gaps)

so any other parameters re-price the same schedule without simulating again (d = the formula over the recorded
shapes, one numpy call a point). The fit minimises relative errors, pred / meas - 1 (soft L1: a stray point cannot
drag the rest), over every measured figure; the schedule itself depends on the step times only through arrivals
and admission, so the fit alternates: replay at the current parameters, fit, replay again (`ROUNDS`). Predictions are always a
fresh replay at the final parameters, i.e. the simulator's own answer.

Cross-validation: each model is predicted from a fit without it (leave-one-model-out; with one model only, one
point at a time). Its errors give the error bars (`uncertainty_pct`: the 80th percentile of |log(pred / meas)|,
as a percentage) that `plan`, `simulate` and `search` print beside each figure.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from engine.core.config import SchedulerConfig
from engine.core.scheduler import SchedulerOutput
from engine.core.step_shape import batch_shape
from planner.benchmarks.formats import LLMPERF, BenchmarkPoint
from planner.calibration.parameters import BENCHMARKS_VERSION_PREFIX, CALIBRATION_VERSION
from planner.calibration.profile_fit import BOUNDS, TERM_OF
from planner.catalog.engines import default_limits, engine_family
from planner.catalog.hardware import get_hardware
from planner.cost.memory_plan import DEFAULT_BATCHED_TOKENS, DEFAULT_MAX_SEQS
from planner.cost.step_model import BatchShape, ModelCosts, Peaks, StepParameters, StepTerms, combine, step_terms
from planner.deployment.capacity import Deployment, catalogue_costs
from planner.deployment.simulate import scheduler_config
from planner.errors import PlannerError
from planner.simulation.simulator import BatchWait, ModelStepTime, Simulation
from planner.simulation.workload import LengthDistribution, Workload

BYTE_TERMS = ("weight_bytes", "gemv_weight_bytes", "dequant_bytes", "kv_bytes")
FLOP_TERMS = ("linear_flops", "attention_flops", "expert_flops")
UNIT_PEAKS = Peaks(1.0, 1.0, 1.0, 1.0)
# what serving benchmarks can tell apart (`bench/gpu_calibration.py` checks each against leave-one-model-out):
# per step and per sequence, the weights' streaming rate, the GEMMs' share of peak, a cost per routed expert run
# (MoE batches touch more experts), the all-reduce latency
# (tensor-parallel points against single-GPU ones), the API server's time per request (TTFT at light load), the
# experts' grouped GEMMs against the dense ones (a MoE prefill against a dense one), the cost per kernel of an eager
# prompt step (TTFT at light load of models of different depths)
FREE = ("step_overhead_s", "seq_overhead_s", "bandwidth_efficiency", "compute_efficiency", "expert_overhead_s",
        "collective_latency_s", "request_overhead_s", "expert_gemm_scale", "eager_kernel_s")
TIED = {"gemv_efficiency": "bandwidth_efficiency"}  # a GPU decodes one row with the same kernels as several
ROUNDS = 2
PER_STEP_COUNTS = ("collective_latency_s",)     # its term counts per step, whatever the batch
PER_PROMPT_STEP_COUNTS = ("eager_kernel_s",)    # ... per step that runs prompt tokens: one a request at light load
# a GPU's kernels reach at most its peak (a profile's CPU efficiencies may exceed the nominal figures)
GPU_BOUNDS = {name: (0.02, 1.0, 0.1) for name in ("bandwidth_efficiency", "compute_efficiency", "gemv_efficiency",
                                                   "kv_bandwidth_efficiency", "attention_efficiency")}
MAX_CV_MEDIAN_PCT = 25.0        # refuse a fit whose cross-validated median error is above this for one of:
THRESHOLDED = ("tpot", "itl", "output_tokens_per_s")
METRIC_WEIGHTS: dict[str, float] = {}      # a metric's weight in the fit (1 where not named)    # what throughput, cost and TPOT SLOs rest on. TTFT, whose
# light-load part is each engine's own request handling, is not refused on: its error bar says how far it is
BAND_PERCENTILE = 80            # the error bar covers this share of the cross-validated errors
OPEN_LOOP_REQUESTS = 300        # an open-loop replay: enough arrivals for the medians to settle
CLOSED_LOOP_WAVES = 3           # a closed-loop replay: this many requests per user (at least MIN_CLOSED_REQUESTS),
MIN_CLOSED_REQUESTS = 16        # up to MAX_CLOSED_REQUESTS (or one request per user where there are more users)
MAX_CLOSED_REQUESTS = 1024


class StepRecorder(ModelStepTime):
    """Prices steps as `ModelStepTime` does and keeps, per replica, each step's shape, start and duration."""

    def __init__(self, step_seconds: Callable[[BatchShape], float], index_topk: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(step_seconds, index_topk)
        self.clock = clock
        self.shapes: list[BatchShape] = []
        self.starts: list[float] = []
        self.durations: list[float] = []
        self.replicas: dict[int, StepRecorder] = {}

    def for_replica(self, index: int, clock: Callable[[], float]) -> StepRecorder:
        self.replicas[index] = StepRecorder(self.step_seconds, self.index_topk, clock)
        return self.replicas[index]

    def __call__(self, output: SchedulerOutput) -> float:
        return self._record(BatchShape(**batch_shape(output, self.index_topk)))

    def decodes(self, count: int, context_tokens: int, max_context: int, selected_tokens: int) -> float:
        sparse = {"decode_selected_tokens": selected_tokens, "prefill_selected_pairs": 0} if self.index_topk else {}
        return self._record(BatchShape(count, context_tokens, max_context, **sparse))

    def _record(self, shape: BatchShape) -> float:
        seconds = self.step_seconds(shape)
        self.shapes.append(shape)
        self.starts.append(self.clock())
        self.durations.append(seconds)
        return seconds


def point_deployment(point: BenchmarkPoint) -> Deployment:
    """The deployment a point ran on, with the limits its source states, else its engine's defaults
    (`planner.catalog.engines.default_limits`), else a batch of at least its concurrency and 8192 tokens a step."""
    ranks = point.gpus if point.attention_data_parallel else 1
    seqs, tokens = (default_limits(engine_family(point.engine), get_hardware(point.hardware), ranks)
                    or (max(DEFAULT_MAX_SEQS, point.concurrency or 0), DEFAULT_BATCHED_TOKENS))
    return Deployment(model=point.model, hardware=point.hardware, gpus=point.gpus, weights=point.weights,
                      kv_dtype=point.kv_dtype, tensor_parallel=point.tensor_parallel,
                      expert_parallel=point.expert_parallel, attention_data_parallel=point.attention_data_parallel,
                      max_num_seqs=point.max_num_seqs or seqs,
                      max_num_batched_tokens=point.max_num_batched_tokens or tokens,
                      scheduler_recv_interval=point.scheduler_recv_interval or 1, batch_wait=point.batch_wait)


def point_workload(point: BenchmarkPoint, seed: int = 0) -> Workload:
    """The point's load: its concurrency as a closed loop of users without think time, or Poisson at its rate; its
    lengths fixed, or uniform over [ratio x L, L] where the benchmark client drew them so. A closed loop sends the
    run's `num_prompts` where the point states it (up to `MAX_CLOSED_REQUESTS`): its first burst of `concurrency`
    requests at once then weighs in the figures as much as it did in the run; else `CLOSED_LOOP_WAVES` per user."""
    lengths = {"prompt": point_lengths(point.input_tokens, point.length_range_ratio),
               "output": point_lengths(point.output_tokens, point.length_range_ratio)}
    if point.concurrency is not None:
        if point.num_prompts is not None:
            requests = max(min(point.num_prompts, MAX_CLOSED_REQUESTS), point.concurrency)
        else:
            requests = max(min(CLOSED_LOOP_WAVES * point.concurrency, MAX_CLOSED_REQUESTS), point.concurrency,
                           MIN_CLOSED_REQUESTS)
        return Workload(arrival="closed", num_requests=requests, users=point.concurrency, seed=seed, **lengths)
    requests = min(point.num_prompts or OPEN_LOOP_REQUESTS, OPEN_LOOP_REQUESTS)
    return Workload(arrival="poisson", num_requests=requests, rate=point.request_rate, seed=seed, **lengths)


def point_lengths(nominal: int, ratio: float | None) -> LengthDistribution:
    if ratio is None or math.ceil(ratio * nominal) >= nominal:
        return LengthDistribution("fixed", nominal)
    return LengthDistribution("uniform", low=max(1, math.ceil(ratio * nominal)), high=nominal)


@dataclass(frozen=True)
class PointSetup:
    """What replaying a point needs once: its per-GPU costs, peaks, one replica's scheduler, the replicas."""

    point: BenchmarkPoint
    costs: ModelCosts
    peaks: Peaks
    config: SchedulerConfig
    replicas: int
    receive_interval: int = 1       # decode steps between the scheduler's polls for requests
    batch_wait: BatchWait | None = None     # new prompts held back for a fuller batch (TensorRT-LLM's)

    @classmethod
    def of(cls, point: BenchmarkPoint) -> PointSetup:
        """PlannerError, naming the point, where its deployment cannot hold its requests."""
        where = point.label or point.deployment_text
        deployment = point_deployment(point)
        try:
            costs, peaks, plan = catalogue_costs(deployment)
        except PlannerError as error:
            raise PlannerError(f"{where}: {error}") from None
        length = point.input_tokens + point.output_tokens
        if length > plan.max_position_embeddings:
            raise PlannerError(f"{where}: {point.input_tokens} + {point.output_tokens} tokens exceed "
                               f"{point.model}'s limit of {plan.max_position_embeddings}")
        if not plan.kv_pages_per_replica or plan.max_concurrency(length) == 0:
            raise PlannerError(f"{where}: {point.model} with {point.weights} weights does not fit on {point.gpus} x "
                               f"{point.hardware} with a request of {length} tokens: the point contradicts its "
                               f"deployment")
        return cls(point, costs, peaks, scheduler_config(plan, deployment), plan.parallel.replicas,
                   deployment.scheduler_recv_interval, deployment.batch_wait)

    def scaled(self, terms: StepTerms) -> StepTerms:
        """The terms in seconds at peak rates (bytes over the bandwidth, FLOPs over the FLOP/s): steps of points on
        different GPUs are then priced together against `UNIT_PEAKS`."""
        peaks = self.peaks
        link = peaks.link_bytes_per_s or math.inf
        return replace(terms, **{name: getattr(terms, name) / peaks.bandwidth_bytes_per_s for name in BYTE_TERMS},
                       **{name: getattr(terms, name) / peaks.flops_per_s for name in FLOP_TERMS},
                       collective_wire_bytes=terms.collective_wire_bytes / link,
                       all_to_all_link_bytes=terms.all_to_all_link_bytes / link,
                       all_to_all_network_bytes=terms.all_to_all_network_bytes / (peaks.network_bytes_per_s or math.inf))


@dataclass(frozen=True)
class Replay:
    """A point's simulated run at some parameters: the recorded steps (all replicas, one after another) and each
    request's place in them; `predict` re-prices that schedule at other parameters."""

    setup: PointSetup
    terms: StepTerms                # array-valued, one entry per step, in seconds at peak rates (`PointSetup.scaled`)
    idle: np.ndarray                # per step: the gap before it on its replica (the first: from time 0)
    replica_of_step: np.ndarray
    waiting_step: np.ndarray        # per request: the step in progress when it arrived (-1: none)
    waiting_share: np.ndarray       # the share of that step left when it arrived
    first_queued: np.ndarray        # the first step that started at or after its arrival
    first_token: np.ndarray         # the step that sampled its first token
    last_token: np.ndarray          # the step that sampled its last
    output_tokens: np.ndarray
    first_arrival: float

    def predict(self, params: StepParameters) -> dict[str, float]:
        """Each measured figure of the point, as this schedule gives it at `params` (its statistic)."""
        return self.metrics(combine(self.terms, UNIT_PEAKS, params), params.request_overhead_s)

    def metrics(self, seconds: np.ndarray, request_overhead_s: float) -> dict[str, float]:
        """The measured figures from each recorded step's duration and the API server's time per request."""
        cumulative = np.concatenate([[0.0], np.cumsum(seconds)])
        wait = np.where(self.waiting_step >= 0, self.waiting_share * seconds[self.waiting_step], 0.0)
        ttft = request_overhead_s + wait + cumulative[self.first_token + 1] - cumulative[self.first_queued]
        several = self.output_tokens >= 2
        tpot = ((cumulative[self.last_token + 1] - cumulative[self.first_token + 1])[several]
                / (self.output_tokens[several] - 1))
        decoding = np.zeros(len(seconds) + 1)      # requests decoding in each step: steps first+1 .. last
        np.add.at(decoding, self.first_token[several] + 1, 1)
        np.add.at(decoding, self.last_token[several] + 1, -1)
        decoding = np.cumsum(decoding)[:-1]
        busy = np.bincount(self.replica_of_step, weights=seconds + self.idle)
        span = float(busy.max()) - self.first_arrival
        predicted = {}
        for measurement in self.setup.point.measurements:
            metric, statistic = measurement.metric, measurement.statistic
            if metric == "ttft":
                predicted[metric] = _statistic(ttft, statistic)
            elif metric == "tpot":
                predicted[metric] = _statistic(tpot, statistic) if tpot.size else float(np.median(seconds))
            elif metric == "itl" and statistic == LLMPERF:
                e2e = ttft + cumulative[self.last_token + 1] - cumulative[self.first_token + 1]
                predicted[metric] = float(np.median(e2e / np.maximum(self.output_tokens, 1)))
            elif metric == "itl":
                predicted[metric] = _weighted(seconds, decoding, statistic)
            else:
                predicted[metric] = float(self.output_tokens.sum()) / span
        return predicted


def _statistic(values: np.ndarray, statistic: str) -> float:
    return float(np.median(values) if statistic == "median" else np.mean(values))


def _weighted(values: np.ndarray, weights: np.ndarray, statistic: str) -> float:
    """The median or mean of `values` counted `weights` times each (inter-token gaps: one per decoding request)."""
    if not weights.sum():
        return float(np.median(values))
    if statistic == "mean":
        return float(np.average(values, weights=weights))
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def replay(setup: PointSetup, params: StepParameters, seed: int = 0) -> Replay:
    """Simulates the point's load at `params`, recording every step."""
    def seconds(shape: BatchShape) -> float:
        return combine(step_terms(setup.costs, shape), setup.peaks, params)

    recorder = StepRecorder(seconds, setup.costs.index_topk)
    result = Simulation(setup.config, recorder, setup.replicas, record_steps=False,
                        request_overhead_s=params.request_overhead_s,
                        receive_interval=setup.receive_interval,
                        batch_wait=setup.batch_wait).run(point_workload(setup.point, seed))
    replicas = [recorder.replicas[index] for index in sorted(recorder.replicas)]
    offsets = np.cumsum([0] + [len(rec.shapes) for rec in replicas])
    shapes = [shape for rec in replicas for shape in rec.shapes]
    terms = [step_terms(setup.costs, shape) for shape in shapes]
    ends_of = [np.array(rec.starts) + np.array(rec.durations) for rec in replicas]
    starts_of = [np.array(rec.starts) for rec in replicas]
    idle = np.concatenate([starts - np.concatenate([[0.0], ends[:-1]]) for starts, ends in zip(starts_of, ends_of)])
    rows = []
    for timing in result.timings:
        replica = next(index for index, ends in enumerate(ends_of) if _at(ends, timing.first_token_s) >= 0)
        starts, ends, offset = starts_of[replica], ends_of[replica], offsets[replica]
        admitted = timing.arrival_s + params.request_overhead_s
        queued = int(np.searchsorted(starts, admitted - 1e-12, side="left"))
        waiting = queued - 1 if queued > 0 and ends[queued - 1] > admitted else -1
        share = (ends[waiting] - admitted) / (ends[waiting] - starts[waiting]) if waiting >= 0 else 0.0
        rows.append((offset + waiting if waiting >= 0 else -1, share, offset + queued,
                     offset + _at(ends, timing.first_token_s), offset + _at(ends, timing.finish_s),
                     timing.output_tokens))
    columns = list(zip(*rows))
    return Replay(setup, setup.scaled(StepTerms(**{item.name: np.array([getattr(t, item.name) for t in terms],
                                                                        dtype=float) for item in fields(StepTerms)})),
                  idle, np.repeat(np.arange(len(replicas)), np.diff(offsets)),
                  np.array(columns[0], dtype=int), np.array(columns[1]), np.array(columns[2], dtype=int),
                  np.array(columns[3], dtype=int), np.array(columns[4], dtype=int), np.array(columns[5], dtype=int),
                  min(timing.arrival_s for timing in result.timings))


def _at(ends: np.ndarray, time_s: float) -> int:
    """The step of a replica that ended at `time_s` (the simulator's clock: exactly), else -1."""
    index = int(np.searchsorted(ends, time_s - 1e-9 * max(1.0, abs(time_s))))
    return index if index < len(ends) and math.isclose(ends[index], time_s, rel_tol=1e-9, abs_tol=1e-12) else -1


def _vector(params: StepParameters, free: tuple[str, ...]) -> np.ndarray:
    return np.array([getattr(params, name) for name in free])


def _parameters(base: StepParameters, free: tuple[str, ...], values: Iterable[float]) -> StepParameters:
    chosen = dict(zip(free, (float(value) for value in values)))
    chosen.update({tied: chosen[source] for tied, source in TIED.items() if source in chosen})
    return replace(base, **chosen)


class ReplaySet:
    """Several replays priced together: every step of every point in one array, one formula call per parameters."""

    def __init__(self, replays: list[Replay]) -> None:
        self.replays = replays
        self.terms = StepTerms(**{item.name: np.concatenate([getattr(r.terms, item.name) for r in replays])
                                  for item in fields(StepTerms)})
        self.offsets = np.cumsum([0] + [len(r.idle) for r in replays])
        self.measured = np.array([m.value for r in replays for m in r.setup.point.measurements])
        self.weights = np.array([METRIC_WEIGHTS.get(m.metric, 1.0) for r in replays
                                 for m in r.setup.point.measurements])

    def residuals(self, params: StepParameters) -> np.ndarray:
        """pred / meas - 1 for every measured figure of every point, in order. It weighs a figure priced low less
        than one priced as far high (-50% against +100%); log(pred / meas), symmetric, gave vLLM's own fit a worse
        leave-one-model-out ITL (32.3% -> 38.5% on the catalogue of 2026-12-06), so the fit keeps this one."""
        seconds = combine(self.terms, UNIT_PEAKS, params)
        predicted = []
        for index, item in enumerate(self.replays):
            values = item.metrics(seconds[self.offsets[index]:self.offsets[index + 1]], params.request_overhead_s)
            predicted.extend(values[m.metric] for m in item.setup.point.measurements)
        return self.weights * (np.array(predicted) / self.measured - 1.0)


def identifiable(free: tuple[str, ...], together: ReplaySet) -> tuple[str, ...]:
    """The coefficients these points can tell apart: each one's term must be non-zero somewhere; a cost per kernel
    or per collective must also vary between points (one model on one layout has as many of them in every step:
    the step overhead's twin; in every prompt step: the API server's time's); the API server's time needs a measured
    TTFT."""
    def says_something(name: str) -> bool:
        if name == "request_overhead_s":
            return any(m.metric == "ttft" for r in together.replays for m in r.setup.point.measurements)
        if name not in TERM_OF:
            return True
        term = getattr(together.terms, TERM_OF[name])
        if name in PER_STEP_COUNTS:
            return np.unique(term).size > 1
        if name in PER_PROMPT_STEP_COUNTS:     # one depth everywhere: the API server's time per request's twin
            return np.unique(term[term > 0]).size > 1
        return bool(term.any())

    return tuple(name for name in free if says_something(name))


def fit_parameters(replays: list[Replay], start: StepParameters, free: tuple[str, ...] = FREE) -> StepParameters:
    """Robust least squares on relative errors over the replays' schedules, from a few starting points; what the
    points cannot tell apart (`identifiable`) keeps its starting value."""
    together = ReplaySet(replays)
    free = identifiable(free, together)
    count = len(together.measured)
    if count < len(free):
        raise PlannerError(f"{count} measured figures cannot fit {len(free)} parameters: give more points")
    lower, upper, scale = (np.array([GPU_BOUNDS.get(name, BOUNDS[name])[column] for name in free])
                           for column in range(3))
    best = None
    for efficiency in (None, 0.5):
        x0 = _vector(start, free) if efficiency is None else np.array(
            [efficiency if name.endswith("efficiency") else getattr(start, name) for name in free])
        x0 = np.clip(x0, lower + 1e-12, upper - 1e-12)
        result = least_squares(lambda x: together.residuals(_parameters(start, free, x)), x0, bounds=(lower, upper),
                               loss="soft_l1", f_scale=0.1, x_scale=scale, max_nfev=300)
        if best is None or result.cost < best.cost:
            best = result
    return _parameters(start, free, best.x)


def initial_parameters() -> StepParameters:
    """Where the fit starts: the documented defaults, with CUDA graphs' overheads (no launch cost: serving engines
    capture their decode steps)."""
    return StepParameters(kernel_launch_s=0.0, step_overhead_s=5e-4, seq_overhead_s=1e-5, expert_overhead_s=5e-6,
                          collective_latency_s=1e-5, request_overhead_s=0.02, eager_kernel_s=1e-5)


def fit_points(setups: list[PointSetup], start: StepParameters | None = None, rounds: int = ROUNDS,
               free: tuple[str, ...] = FREE,
               replays: list[Replay] | None = None) -> tuple[StepParameters, list[Replay]]:
    """Alternates replays and fits `rounds` times (given `replays` stand for the first round's)."""
    params = start or initial_parameters()
    for round_index in range(rounds):
        if replays is None or round_index > 0:
            replays = [replay(setup, params) for setup in setups]
        params = fit_parameters(replays, params, free)
    return params, replays


def predictions(setups: list[PointSetup], params: StepParameters) -> list[dict[str, float]]:
    """The simulator's answer for each point at `params`: a fresh replay, priced at the parameters it ran with."""
    return [replay(setup, params).predict(params) for setup in setups]


def error_rows(setups: list[PointSetup], predicted: list[dict[str, float]], label: str) -> list[dict[str, Any]]:
    """One row per measured figure: measured, predicted, relative error."""
    rows = []
    for setup, values in zip(setups, predicted):
        point = setup.point
        for measurement in point.measurements:
            guess = values[measurement.metric]
            rows.append({"point": point.label or point.deployment_text, "model": point.model,
                         "hardware": point.hardware, "deployment": point.deployment_text,
                         "concurrency": point.concurrency, "request_rate": point.request_rate,
                         "single_stream": point.single_stream, "metric": measurement.metric,
                         "statistic": measurement.statistic, "measured": measurement.value,
                         "predicted": guess, "error_pct": 100 * (guess / measurement.value - 1),
                         "source": point.source, label: True})
    return rows


def median_errors(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median |error| % per metric over the rows (`all`: every row), None where no row has that metric."""
    out: dict[str, float | None] = {}
    for metric in ("all", "tpot", "itl", "ttft", "output_tokens_per_s"):
        errors = [abs(row["error_pct"]) for row in rows if metric == "all" or row["metric"] == metric]
        out[metric] = round(float(np.median(errors)), 2) if errors else None
    return out


def uncertainty(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The error bar of each figure the planner prints, from cross-validated rows: the `BAND_PERCENTILE`th
    percentile of |log(pred / meas)|, as a percentage (a figure is within x% of the truth that often). TPOT and
    ITL are one kind (the time between tokens); single streams get their own where three points or more say it."""
    def band(selected: list[dict[str, Any]]) -> float | None:
        if not selected:
            return None
        logs = [abs(math.log(row["predicted"] / row["measured"])) for row in selected]
        return round(100 * (math.exp(float(np.percentile(logs, BAND_PERCENTILE))) - 1), 1)

    between = [row for row in rows if row["metric"] in ("tpot", "itl")]
    single = [row for row in between if row["single_stream"]]
    return {"time_between_tokens": band(between), "ttft": band([r for r in rows if r["metric"] == "ttft"]),
            "output_tokens_per_s": band([r for r in rows if r["metric"] == "output_tokens_per_s"]),
            "single_stream": band(single) if len(single) >= 3 else band(between)}


def cross_validation_groups(setups: list[PointSetup]) -> tuple[str, list[list[int]]]:
    """Leave-one-model-out folds where there are two models or more; one point at a time otherwise."""
    models = sorted({setup.point.model for setup in setups})
    if len(models) >= 2:
        return "leave-one-model-out", [[i for i, s in enumerate(setups) if s.point.model == m] for m in models]
    return "leave-one-point-out", [[i] for i in range(len(setups))]


def cross_validate(setups: list[PointSetup], params: StepParameters, replays: list[Replay],
                   free: tuple[str, ...] = FREE) -> tuple[str, list[dict[str, Any]]]:
    """Each fold predicted from a fit on the rest (refitted on the full fit's schedules, then replayed anew)."""
    kind, folds = cross_validation_groups(setups)
    rows = []
    for fold in folds:
        keep = [i for i in range(len(setups)) if i not in fold]
        fold_params = fit_parameters([replays[i] for i in keep], params, free)
        held = [setups[i] for i in fold]
        rows += error_rows(held, predictions(held, fold_params), "cross_validated")
    return kind, rows


def not_replayed(point: BenchmarkPoint) -> str | None:
    """Why the simulator cannot replay a point faithfully yet, if it cannot."""
    if point.speculative:
        return f"speculative decoding ({point.speculative}): the simulator decodes one token a step"
    return None


def calibrate_benchmarks(points: list[BenchmarkPoint], held_out: Iterable[str] = (),
                         max_cv_median_pct: float = MAX_CV_MEDIAN_PCT, free: tuple[str, ...] = FREE,
                         rounds: int = ROUNDS, described_as: str = "benchmark points",
                         start: StepParameters | None = None) -> dict[str, Any]:
    """The calibration document: fitted parameters, per-point errors, cross-validated errors and error bars, and
    the held-out models' errors. Points decoded speculatively are left out (listed): the simulator decodes one token
    a step (`not_replayed`). Data-parallel attention ranks run as replicas of their own, each step priced with every
    rank's tokens at the experts. PlannerError where the cross-validated median error of TPOT, ITL or output
    tokens/s (`THRESHOLDED`) is
    above `max_cv_median_pct`, or where a point contradicts its deployment. What is not `free` keeps its value in
    `start` (default `initial_parameters`)."""
    held = set(held_out)
    skipped = [{"point": point.label or point.deployment_text, "why": why} for point in points
               if (why := not_replayed(point))]
    setups = [PointSetup.of(point) for point in points if not not_replayed(point)]
    fitted = [setup for setup in setups if setup.point.model not in held]
    kept_out = [setup for setup in setups if setup.point.model in held]
    if not fitted:
        raise PlannerError("every point is held out or speculative: nothing to fit")
    params, replays = fit_points(fitted, start, rounds=rounds, free=free)
    rows = error_rows(fitted, predictions(fitted, params), "fitted")
    kind, cross_rows = cross_validate(fitted, params, replays, free)
    held_rows = error_rows(kept_out, predictions(kept_out, params), "held_out") if kept_out else []
    cv = median_errors(cross_rows)
    document = {
        "version": CALIBRATION_VERSION,
        "fingerprint": {"engine_version": BENCHMARKS_VERSION_PREFIX + ",".join(
                            sorted({s.point.engine or "unknown" for s in fitted})),
                        "hardware": sorted({s.point.hardware for s in fitted}), "model": None, "weights": None,
                        "kv_dtype": None, "device": "serving benchmarks"},
        "described_as": described_as,
        "parameters": asdict(params),
        "peaks": None,
        "free_parameters": list(identifiable(free, ReplaySet(replays))),
        "num_points": len(fitted),
        "num_figures": len(rows),
        "models": sorted({s.point.model for s in fitted}),
        "points_by_hardware": {hw: sum(s.point.hardware == hw for s in fitted)
                               for hw in sorted({s.point.hardware for s in fitted})},
        "median_error_pct": median_errors(rows),
        "cross_validation": kind,
        "cross_validated_median_error_pct": cv,
        "single_stream_median_error_pct": median_errors([r for r in rows if r["single_stream"]]),
        "single_stream_cross_validated_median_error_pct": median_errors([r for r in cross_rows
                                                                          if r["single_stream"]]),
        "uncertainty_pct": uncertainty(cross_rows),
        "band_percentile": BAND_PERCENTILE,
        "max_cv_median_pct": max_cv_median_pct,
        "held_out_models": sorted(held),
        "held_out_median_error_pct": median_errors(held_rows) if held_rows else None,
        "skipped": skipped,
        "rows": rows, "cross_validated_rows": cross_rows, "held_out_rows": held_rows,
    }
    refused = refusal(document, max_cv_median_pct)
    if refused:
        raise PlannerError(refused)
    return document


def refusal(document: dict[str, Any], max_cv_median_pct: float) -> str | None:
    """Why a fit is refused: the cross-validated median error of TPOT, ITL or output tokens/s above the threshold."""
    cv = document["cross_validated_median_error_pct"]
    worst = max((metric for metric in THRESHOLDED if cv[metric] is not None), key=lambda m: cv[m], default=None)
    if worst is None or cv[worst] <= max_cv_median_pct:
        return None
    return (f"the fit's {document['cross_validation']} median error is {cv[worst]:.1f}% ({worst}), above the "
            f"{max_cv_median_pct:g}% threshold: the points disagree with each other or with the step model; check "
            f"them, or raise --max-cv-error")


def fit_report_lines(document: dict[str, Any]) -> list[str]:
    """The fit as a table: every measured figure fitted, cross-validated and held out, then the medians."""
    cross = {(row["point"], row["metric"]): row["error_pct"] for row in document["cross_validated_rows"]}
    lines = [f"{'point':24s} {'deployment':62s} {'metric':10s} {'measured':>10s} {'predicted':>10s} {'error':>7s} "
             f"{'CV error':>8s}"]
    for row in document["rows"] + document["held_out_rows"]:
        held = "held_out" in row
        cv = "held out" if held else f"{cross[(row['point'], row['metric'])]:+7.1f}%"
        metric = {"output_tokens_per_s": "tok/s"}.get(row["metric"], row["metric"])
        lines.append(f"{row['point'][:24]:24s} {row['deployment'][:62]:62s} {metric:10s} {row['measured']:10.4g} "
                     f"{row['predicted']:10.4g} {row['error_pct']:+6.1f}% {cv:>8s}")
    lines.append("")
    for label, key in (("median |error| fitted", "median_error_pct"),
                       (f"median |error| {document['cross_validation']}", "cross_validated_median_error_pct"),
                       ("single streams, fitted", "single_stream_median_error_pct"),
                       (f"single streams, {document['cross_validation']}",
                        "single_stream_cross_validated_median_error_pct"),
                       (f"held out ({', '.join(document['held_out_models']) or 'none'})", "held_out_median_error_pct")):
        values = document[key]
        lines.append(f"{label:44s} " + ("-" if not values else "  ".join(
            f"{name} {value:.1f}%" for name, value in values.items() if value is not None)))
    bars = document["uncertainty_pct"]
    lines.append(f"{'error bars (' + str(document['band_percentile']) + 'th percentile, cross-validated)':44s} "
                 + "  ".join(f"{name} ±{value}%" for name, value in bars.items() if value is not None))
    lines += [f"skipped {item['point']}: {item['why']}" for item in document["skipped"]]
    lines.append("parameters: " + ", ".join(f"{name} {document['parameters'][name]:.4g}"
                                            for name in document["free_parameters"]))
    return lines
