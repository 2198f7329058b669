"""Predictions checked against the engine: the same workload through the real engine and the simulator.

The engine runs on this machine with the profile's model and dtypes, requests arriving at the workload's
times with prompts of the requested lengths cut from real English text and outputs of exactly the
requested lengths. The simulator runs the same requests through the engine's scheduler with the step
times of a calibration fitted to the profile. Every metric follows `engine.core.metrics` on both sides.

Two predictions are exact by construction and reported as such: the KV capacity (both sides use
`engine.core.memory`), and, with the engine's own step durations replayed, the preemption count and the
sequence of batches. The timing metrics carry the step-time model's error, and the machine's: a shared
VM runs the same step up to ~30% slower or faster from one minute to the next, and more when something
else runs beside it. So a second engine of the same configuration times a few of the profile's own steps
again *between* the served steps (the served timeline is the virtual clock of measured step durations, so
this costs the workload nothing): both engines see the same machine at the same minutes, and the errors are
also reported with each predicted step time scaled by the drift measured around that instant (the probes
nearest to it) for a step of its shape (the probe most like it). What is left is the model's error.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.core.memory import GIB, kv_layout, kv_pages_for_budget
from engine.core.metrics import summarize
from engine.core.step_shape import REGIMES, SAMPLE_KINDS, batch_shape, regime_of
from planner.calibration.parameters import Calibration, check_fingerprint
from planner.calibration.profile_fit import calibrate, load_profile, profile_costs
from planner.catalog.models import get_model
from planner.cost.step_model import step_time
from planner.errors import PlannerError
from planner.simulation.simulator import (
    ModelStepTime,
    Simulation,
    SimulationResult,
    model_step_time,
    replayed_step_time,
)
from planner.simulation.speculation import Speculation
from planner.simulation.workload import RequestSpec, Workload
from planner.verification.comparison import TIMING_METRICS, compared, gate, gate_line, metrics_table, workload_dict
from planner.verification.drafting import ReplayedDrafts, drafting_by_request, served_outcomes
from planner.verification.engine_run import engine_of, english_prompts, warm_up
from planner.verification.probe_engine import ProbeEngine

if TYPE_CHECKING:
    from engine.core.config import SchedulerConfig
    from engine.core.scheduler import SchedulerOutput
    from engine.harness.profiler import Profiler
    from engine.harness.served_run import ServedStep, ServeRequest, ServeResult
    from engine.llm import LLM

PROBE_EVERY_STEPS = 3       # one reference step is timed after every this many served steps
PROBE_MIN_TIMINGS = 3       # each probe at least this often (a short run tops them up after it)
SHAPE_MIN_TIMINGS = 6       # a probe's own drift, beside the machine's, needs this many timings: one is +-6%


def predicted_kv_capacity(profile: dict[str, Any], kv_cache_gib: float, page_size: int) -> int:
    """The planner's own arithmetic for the engine's pool: the model's KV layout over the budget."""
    fingerprint = profile["fingerprint"]
    model = get_model(fingerprint.get("model_source") or fingerprint["model"])
    spec = model.truncated(fingerprint.get("num_layers"), fingerprint.get("num_experts"))
    layout = kv_layout(spec, fingerprint["kv_dtype"], fingerprint.get("tensor_parallel", 1))
    return kv_pages_for_budget(int(kv_cache_gib * GIB), layout, page_size) * page_size


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, all) CPU ticks since boot from Linux's /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7], sum(ticks[:8])) if len(ticks) >= 8 else None


def steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time the hypervisor gave to other guests in between: a shared VM's steps slow down
    with it, and neither the profile nor the step model can know."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 2)


@dataclass
class DriftProbes:
    """A few of the profile's own steps, timed again on a second engine between the served steps (cycling
    through them, one every `every` steps): the machine's speed now against when it was profiled, seen by
    the same cores at the same minutes as the served steps."""

    profiler: Profiler | ProbeEngine
    samples: list[dict[str, Any]]
    every: int = PROBE_EVERY_STEPS
    # every timing: (served steps before it, which probe, seconds)
    timeline: list[tuple[int, int, float]] = field(default_factory=list)
    steps_done: int = 0
    # (timings they were computed from, factor per probe): `shape_factor`'s, computed again only when timings come
    _factors: tuple[int, dict[int, float]] | None = field(default=None, repr=False)

    def __call__(self, steps_done: int) -> None:
        self.steps_done = steps_done
        if self.samples and steps_done % self.every == 0:
            self._time((steps_done // self.every - 1) % len(self.samples))

    def _time(self, index: int) -> None:
        self.timeline.append((self.steps_done, index, self.profiler.remeasure(self.samples[index])["median_s"]))

    @property
    def times(self) -> list[list[float]]:
        """Each probe's timings, in the order they were taken."""
        return [[seconds for _, probe, seconds in self.timeline if probe == index] for index in range(len(self.samples))]

    def complete(self) -> None:
        """A run too short to time every probe `PROBE_MIN_TIMINGS` times tops them up after it: one timing
        of a reference step is as noisy as the steps themselves (+-6% on this VM)."""
        for index, times in enumerate(self.times):
            for _ in range(PROBE_MIN_TIMINGS - len(times)):
                self._time(index)

    def ratios(self) -> list[float]:
        """Now against then, for every timing in the order taken."""
        return [seconds / self.samples[probe]["median_s"] for _, probe, seconds in self.timeline]

    def speed(self) -> float:
        """The median ratio of now to then over every probe timed: > 1 where the machine is slower now."""
        ratios = self.ratios()
        return float(np.median(ratios)) if ratios else 1.0

    def probe_like(self, kind: str, num_decodes: int) -> int | None:
        """The probe most like a step: a prefill or mixed step its regime's probe, a decode step the decode probe
        nearest in batch size (by ratio: 1 is as far from 4 as 4 from 16)."""
        same = [index for index, sample in enumerate(self.samples) if sample.get("kind") == kind]
        if kind != "decode" or not same:
            return same[0] if same else None
        return min(same, key=lambda index: abs(np.log(max(1, self.samples[index]["batch"]["num_decodes"])
                                                      / max(1, num_decodes))))

    def local_speeds(self, shapes: list[tuple[str, int]]) -> list[float]:
        """The machine's speed for each served step, given as (regime, decodes): how slow the machine was
        around that instant (`speeds_around`) times how much slower than that the probe most like the step ran over
        the whole run (`shape_factor`).

        Both matter. A neighbour on this VM can slow every step by 1.5-2x for a minute and then leave
        (consecutive identical decode steps measured 0.42, 0.88, 0.80, 0.39 s): one factor for the whole run
        would pass that minute's error on to the rest. And the drift is not one factor for every shape: in one
        run the prefill probe ran 20% slower than profiled, the single-sequence decode 11%, the decode of 10
        sequences 5% faster; a run of small decodes scaled by their median was predicted 14% fast."""
        around = self.speeds_around(len(shapes))
        return [speed * self.shape_factor(kind, decodes) for speed, (kind, decodes) in zip(around, shapes)]

    def speeds_around(self, num_steps: int) -> list[float]:
        """How slow the machine was around each of `num_steps` served steps: the median ratio of the probe timings
        nearest to it, two of each reference step."""
        if not self.timeline:
            return [1.0] * num_steps
        return self._around(np.arange(num_steps) + 0.5).tolist()

    def shape_factor(self, kind: str, decodes: int) -> float:
        """How much slower than the machine around it the probe most like a step of this shape ran, over the whole
        run; 1 where that probe was timed fewer than `SHAPE_MIN_TIMINGS` times (a short run: its median would be
        noise). The simulation asks at every step it prices: the factors are computed once per timeline."""
        if self._factors is None or self._factors[0] != len(self.timeline):
            self._factors = (len(self.timeline), self._shape_factors())
        return self._factors[1].get(self.probe_like(kind, decodes), 1.0)

    def _shape_factors(self) -> dict[int, float]:
        if not self.timeline:
            return {}
        at = np.array([step for step, _, _ in self.timeline], dtype=float)
        probes = np.array([probe for _, probe, _ in self.timeline])
        relative = np.array(self.ratios()) / self._around(at)
        return {index: float(np.median(relative[probes == index])) for index in set(probes.tolist())
                if int((probes == index).sum()) >= SHAPE_MIN_TIMINGS}

    def _around(self, points: np.ndarray) -> np.ndarray:
        """At each point (in served steps), the median ratio of the probe timings nearest to it."""
        at = np.array([step for step, _, _ in self.timeline], dtype=float)
        ratios = np.array(self.ratios())
        window = min(len(ratios), 2 * len(self.samples))
        return np.array([np.median(ratios[np.argsort(np.abs(at - point), kind="stable")[:window]])
                         for point in points])

    def scatter_pct(self) -> float | None:
        """How much the probes disagree with themselves: the median over probes of the interquartile range of one
        probe's timings, in percent of their median. A steady machine, however slow, times one step alike all run
        long (the drift then means one thing); a neighbour that comes and goes scatters them."""
        scatters = [100 * float(np.subtract(*np.percentile(times, [75, 25])) / np.median(times))
                    for times in self.times if len(times) >= PROBE_MIN_TIMINGS]
        return round(float(np.median(scatters)), 3) if scatters else None

    def report(self, local_speeds: list[float]) -> dict[str, Any]:
        from engine.harness.profiler import Profiler

        local = local_speeds or [self.speed()]
        return {"slowdown_vs_profile_pct": round(100 * (self.speed() - 1), 3), "probe_every_steps": self.every,
                "local_slowdown_pct": [round(100 * (min(local) - 1), 3), round(100 * (max(local) - 1), 3)],
                "probe_scatter_pct": self.scatter_pct(),
                "probes": [{"kind": s["kind"], "point": Profiler.point_of(s), "profiled_s": s["median_s"],
                            "timed": len(times), "median_s": round(float(np.median(times)), 6),
                            "slowdown_pct": round(100 * (float(np.median(times)) / s["median_s"] - 1), 3)}
                           for s, times in zip(self.samples, self.times)]}


def verify(profile_path: str, workload: Workload, kv_cache_gib: float = 0.25, max_num_seqs: int = 256,
           max_num_batched_tokens: int = 2048, max_mape: float = 1e9, speculative: str | None = None) -> dict[str, Any]:
    """The workload through the engine and through the simulator on the profile's calibration, compared. With
    `speculative` ("ngram:K") the engine drafts by prompt lookup over prompts that repeat themselves, and the
    simulator draws drafts and their acceptance as the engine measured them."""
    from engine.core.step_shape import engine_version

    if speculative is not None and not speculative.startswith("ngram:"):
        raise PlannerError(f"verify --speculative takes ngram:K (prompt lookup over prompts that repeat themselves), "
                           f"got {speculative!r}")
    profile = load_profile(profile_path)
    fingerprint = profile["fingerprint"]
    check_fingerprint(fingerprint, "profile", engine_version=engine_version())
    if fingerprint.get("device") != "cpu":
        raise PlannerError(f"verification runs the engine here, on a CPU; this profile is from "
                           f"{fingerprint.get('device_name')!r}")
    calibration = Calibration.of(calibrate(profile, max_mape))
    specs = workload.requests()
    if any(spec.arrival_s is None and spec.follows is None for spec in specs):
        raise PlannerError("verification needs arrival times: use a poisson, gamma or trace workload")
    engine = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    run = _serve(profile, specs, kv_cache_gib, engine, speculative)
    served, speeds = run.served, run.speeds
    predicted = _predict(calibration, profile, run, run.specs)
    measured = summarize(served.timings)
    served_cached = [timing.cached_tokens for timing in served.timings]
    metrics = {
        "kv_capacity_tokens": compared(predicted_kv_capacity(profile, kv_cache_gib, run.config.page_size),
                                       run.capacity_tokens),
        "peak_concurrency": compared(predicted.report["max_concurrency_reached"], max(s.running for s in served.steps)),
        "preemptions": compared(predicted.report["preemptions"], served.preemptions),
        "cached_tokens": compared(sum(predicted.cached_tokens), sum(served_cached)),
        **{name: compared(predicted.report[name], measured[name]) for name in TIMING_METRICS},
    }
    durations = [s.duration_s for s in served.steps]
    replay = {"preemptions": compared(predicted.replayed.preemptions, served.preemptions),
              "cached_tokens_equal": predicted.cached_tokens == served_cached,
              "cached_tokens_equal_replayed": _cached_by_request(predicted.replayed, run.specs) == served_cached,
              "same_batches": [s.batch for s in predicted.replayed.steps] == [s.batch for s in served.steps],
              "steps": len(served.steps),
              "step_model": step_model_errors(predicted.modelled, durations),
              "step_model_drift_corrected": step_model_errors(
                  [(kind, speed * seconds) for (kind, seconds), speed in zip(predicted.modelled, speeds)], durations)}
    machine = {**run.probes.report(speeds), "cpu_steal_pct": run.steal_pct,
               "metrics_drift_corrected": {name: compared(predicted.drift_corrected[name], measured[name])
                                           for name in TIMING_METRICS}}
    judged = gate(metrics, machine["metrics_drift_corrected"], machine["probe_scatter_pct"])
    result = {"metrics": metrics, "gate": judged, "replay": replay, "machine": machine, "workload": workload_dict(workload),
              "fingerprint": fingerprint, "calibration": _fit_summary(calibration.document),
              "engine": {"kv_cache_gib": kv_cache_gib, **engine, "capacity_tokens": run.capacity_tokens}}
    if run.speculation is not None:
        result["speculative"] = {"engine": run.draft_summary, "planner": run.speculation.describe(),
                                 "expected_tokens_per_step": run.speculation.expected_tokens_per_step}
    return result


@dataclass
class VerifiedRun:
    """The workload as the engine served it, with the machine's speed measured around each of its steps."""

    served: ServeResult
    probes: DriftProbes
    speeds: list[float]                 # per served step: the machine's speed then, against the profile's
    steal_pct: float | None
    config: SchedulerConfig             # the engine's
    capacity_tokens: int
    specs: list[RequestSpec]            # the workload's requests with the token ids the engine was given
    speculation: Speculation | None = None      # the engine's drafts and acceptance, as the simulator draws them
    draft_summary: dict[str, Any] | None = None
    # per request id, each decode step's (drafts checked, drafts that stood), as served
    draft_outcomes: dict[int, list[tuple[int, int]]] | None = None

    @property
    def around(self) -> list[float]:
        """Per served step: the machine's speed around it, whatever the step's shape."""
        return self.probes.speeds_around(len(self.served.steps))


def _serve(profile: dict[str, Any], specs: list, kv_cache_gib: float, engine: dict[str, int],
           speculative: str | None = None) -> VerifiedRun:
    """The workload through an engine configured as the profiled one, a second engine timing the profile's own
    steps again between the served steps (drift probes)."""
    from engine.harness.served_run import serve_requests

    fingerprint = profile["fingerprint"]
    llm = engine_of(fingerprint, kv_cache_gib, speculative=speculative, **engine)
    with ExitStack() as cleanup:
        cleanup.callback(llm.close)
        requests, specs = engine_requests(specs, llm, repeating=speculative is not None)
        probes = drift_probes(profile, kv_cache_gib, engine, cleanup, [spec.prompt_tokens for spec in specs])
        warm_up(llm, max(spec.prompt_tokens for spec in specs))
        cpu_before = cpu_ticks()
        served = serve_requests(llm, requests, clock="virtual", between_steps=probes)
        probes.complete()
        steal = steal_pct(cpu_before, cpu_ticks())
    speeds = probes.local_speeds([served_shape(step) for step in served.steps])
    stats = llm.draft_stats
    speculation, outcomes = None, None
    if stats is not None:
        overall = Speculation("ngram", llm.config.speculative_config.num_draft_tokens,
                              tuple(stats.acceptance_by_position()) or (0.0,), tuple(stats.draft_length_shares()))
        outcomes = served_outcomes(served.steps, specs)
        speculation = replace(overall, by_request=drafting_by_request(outcomes, overall))
    return VerifiedRun(served, probes, speeds, steal, llm.scheduler_config, llm.capacity_tokens, specs, speculation,
                       None if stats is None else stats.summary(), outcomes)


def drift_probes(profile: dict[str, Any], kv_cache_gib: float, engine: dict[str, int], cleanup: ExitStack,
                 prompt_tokens: list[int]) -> DriftProbes:
    """A second engine configured as the profiled one (closed with `cleanup`), to time the profile's own steps again
    between the served steps, its prefill probe the one most like the workload's `prompt_tokens`. Its pool is twice
    what the largest probe holds, not the profiled one: the profiler tiles real K/V over its whole pool, and a
    profile's 1 GiB pool made every verification 1 GiB bigger."""
    from engine.harness.profiler import Profiler, SweepPlan, pages_to_remeasure

    fingerprint = profile["fingerprint"]
    page = fingerprint["page_size"]
    plan = SweepPlan(warmup=0, repeats=1)        # each probe is warmed once below, not before every timing
    profiled_pages = profile["memory"]["kv_capacity_tokens"] // page

    def pages(sample: dict[str, Any]) -> int:
        return pages_to_remeasure(sample["kind"], Profiler.point_of(sample), page, plan)

    chosen = probe_samples(profile, lambda sample: pages(sample) <= profiled_pages, float(np.median(prompt_tokens)))
    num_pages = min(profiled_pages, 2 * max((pages(sample) for sample in chosen), default=profiled_pages))
    reference_settings = dict(num_pages=num_pages, **engine)
    if fingerprint.get("tensor_parallel", 1) > 1:      # one tensor-parallel group per process
        profiler = cleanup.enter_context(ProbeEngine(fingerprint, kv_cache_gib, **reference_settings))
    else:
        reference = engine_of(fingerprint, kv_cache_gib, **reference_settings)
        cleanup.callback(reference.close)
        profiler = Profiler(reference, plan)
    probes = [sample for sample in chosen if profiler.can_remeasure(sample)]
    for sample in probes:       # a warm-up step each, once: a step before every timing cost 40% of a disaggregated run
        profiler.remeasure(sample)
    return DriftProbes(profiler, probes)


def engine_requests(specs: list[RequestSpec], llm: LLM,
                     repeating: bool = False) -> tuple[list[ServeRequest], list[RequestSpec]]:
    """The engine's requests: prompts of the workload's own token identities where it has them (shared prefixes,
    conversations: ids every vocabulary has), else cut from English text (`repeating`: text said twice, which
    prompt lookup finds); and the specs with those very ids, so that the simulator's prefix cache sees what the
    engine's does."""
    from engine.harness.served_run import ServeRequest

    plain = [spec.prompt_tokens for spec in specs if spec.prompt_ids is None]
    cut = iter(english_prompts(llm.tokenizer, plain, llm.model_config.vocab_size, repeating) if plain else [])
    index = {spec.request_id: i for i, spec in enumerate(specs)}
    requests, identified = [], []
    for spec in specs:
        prompt = list(spec.prompt_ids) if spec.prompt_ids is not None else next(cut)
        requests.append(ServeRequest(spec.arrival_s or 0.0, prompt, spec.output_tokens,
                                     None if spec.follows is None else index[spec.follows], spec.think_s))
        identified.append(replace(spec, prompt_ids=tuple(prompt)))
    return requests, identified


@dataclass
class Predictions:
    report: dict[str, Any]                  # the simulation with the calibrated step model
    cached_tokens: list[int]                # its prefix-cache hits, by request in the workload's order
    replayed: SimulationResult              # the engine's own step durations replayed through the scheduler
    modelled: list[tuple[str, float]]       # the step model's price of each replayed step, with its regime
    drift_corrected: dict[str, Any]         # the simulation with each step at the machine's speed then


class AtServedSpeed:
    """A step model scaled by the machine's speed around the served step under way at the simulated instant
    (`clock`, the simulation's own: bound once the simulation that calls this exists), for a step of the priced
    step's own shape: the simulation forms other batches than the engine did, and a mixed step priced while the
    engine ran a decode takes the mixed probe's factor, not the decode's."""

    def __init__(self, model: Callable[[SchedulerOutput], float], starts: list[float], speeds: list[float],
                 shape_factor: Callable[[str, int], float] = lambda kind, decodes: 1.0) -> None:
        self.model, self.starts, self.speeds, self.shape_factor = model, starts, speeds, shape_factor
        self.clock: Callable[[], float] = lambda: 0.0

    def __call__(self, output: SchedulerOutput) -> float:
        if not self.speeds:
            return self.model(output)
        batch = batch_shape(output)
        factor = self.shape_factor(regime_of(batch), batch["num_decodes"])
        return self.speeds[max(0, bisect.bisect_right(self.starts, self.clock()) - 1)] * factor * self.model(output)


def profile_step_time(calibration: Calibration, profile: dict[str, Any]) -> ModelStepTime:
    """The step model of a profile's calibration, for its own model: with its linears as measured, by row count,
    where the profile has them."""
    params, peaks, linears = calibration.parameters, calibration.peaks, calibration.linears
    if linears is not None:
        params = calibration.measured_parameters
    costs = profile_costs(profile["model"])
    return model_step_time(lambda batch: step_time(costs, peaks, params, batch, linears), costs.index_topk)


def _predict(calibration: Calibration, profile: dict[str, Any], run: VerifiedRun, specs: list) -> Predictions:
    """The workload through the simulator three ways: priced by the calibration, replaying the engine's own step
    durations (the step model priced beside them; with speculation also its drafts and what stood of them), and
    priced at the machine's measured speed."""
    model = profile_step_time(calibration, profile)
    speculation = run.speculation
    simulated = Simulation(run.config, model, record_steps=True, speculation=speculation).run(list(specs))
    replay_step = replayed_step_time([s.duration_s for s in run.served.steps])
    modelled: list[tuple[str, float]] = []

    def replay_and_model(output: SchedulerOutput) -> float:
        modelled.append((regime_of(batch_shape(output)), model(output)))
        return replay_step(output)

    replaying = None if speculation is None else replace(speculation, by_request={
        request_id: ReplayedDrafts(done) for request_id, done in run.draft_outcomes.items()})
    replayed = Simulation(run.config, replay_and_model, record_steps=True, speculation=replaying).run(list(specs))
    at_served_speed = AtServedSpeed(model, [step.start_s for step in run.served.steps], run.around,
                                    run.probes.shape_factor)
    corrected = Simulation(run.config, at_served_speed, speculation=speculation)
    at_served_speed.clock = lambda: corrected.env.now
    return Predictions(simulated.report(), _cached_by_request(simulated, specs), replayed, modelled,
                       corrected.run(list(specs)).report())


def _cached_by_request(result: SimulationResult, specs: list[RequestSpec]) -> list[int]:
    cached = {timing.request_id: timing.cached_tokens for timing in result.timings}
    return [cached[spec.request_id] for spec in specs]


def _fit_summary(document: dict[str, Any]) -> dict[str, Any]:
    """The fit the prediction used: with measured linears where the profile has them."""
    fitted = document.get("measured_linears") or document
    return {"measured_linears": "measured_linears" in document,
            **{k: v for k, v in fitted.items() if k.startswith(("mape", "holdout")) or k == "parameters"}}


def probe_samples(profile: dict[str, Any], runnable: Callable[[dict[str, Any]], bool],
                  prompt_tokens: float) -> list[dict[str, Any]]:
    """Profile steps to time again: the prefill nearest the workload's median prompt (`prompt_tokens`), the quickest
    mixed step, and decodes at the smallest, middle and largest batch (the drift is not one factor: on a shared
    2-core VM the batched steps, which use both cores, slowed by 1.4-1.7x over a day while single-sequence ones moved
    0-20%). The prefill most like the served ones, not the profile's median: that was two prompts of 256 tokens,
    1.5 s a timing, beside prompts of 32-256 tokens, and its timings were a third of a verification's time."""
    candidates = [s for s in profile["samples"] if s["kind"] in REGIMES and runnable(s)]
    by_kind = {kind: sorted((s for s in candidates if s["kind"] == kind), key=lambda s: s["median_s"]) for kind in REGIMES}
    chosen = []
    if by_kind["prefill"]:
        chosen.append(min(by_kind["prefill"], key=lambda s: (abs(np.log(s["batch"]["prefill_tokens"] / prompt_tokens)),
                                                             s["batch"]["num_prefills"])))
    if by_kind["mixed"]:
        chosen.append(by_kind["mixed"][0])
    batches = sorted({s["batch"]["num_decodes"] for s in by_kind["decode"]})
    for batch in dict.fromkeys((batches[0], batches[(len(batches) - 1) // 2], batches[-1]) if batches else ()):
        at_batch = [s for s in by_kind["decode"] if s["batch"]["num_decodes"] == batch]
        chosen.append(at_batch[(len(at_batch) - 1) // 2])
    return chosen


def served_shape(step: ServedStep) -> tuple[str, int]:
    """A served step's regime and its number of decodes."""
    decodes = sum(1 for _, start, new in step.batch if new == 1 and start > 0)
    if decodes == len(step.batch):
        return "decode", decodes
    return ("prefill" if not decodes else "mixed"), decodes


def step_model_errors(modelled: list[tuple[str, float]], measured: list[float]) -> dict[str, dict[str, float]]:
    """The step model on the very steps the engine ran (same batches, replayed): per regime the median
    error of one step and the error of their summed time, which is what throughput sees. This separates
    the model's error from what queueing makes of it."""
    out = {}
    for name in (*SAMPLE_KINDS, "all"):
        pairs = [(p, m) for (kind, p), m in zip(modelled, measured) if name in (kind, "all") and m > 0]
        if pairs:
            predicted, actual = np.array(pairs).T
            out[name] = {"steps": len(pairs), "median_error_pct": round(float(100 * np.median(predicted / actual - 1)), 3),
                         "total_error_pct": round(float(100 * (predicted.sum() / actual.sum() - 1)), 3)}
    return out


def markdown_report(result: dict[str, Any]) -> str:
    rows = metrics_table(result["metrics"])
    fp = result["fingerprint"]
    replay = result["replay"]
    return "\n".join([
        f"# Verification: {fp['model']} ({fp['weights']} weights, {fp['kv_dtype']} KV) on {fp['device_name']}",
        "", f"Workload: `{result['workload']}`", "", *rows, "",
        f"Replaying the engine's {replay['steps']} measured step times, the simulator formed "
        f"{'the same' if replay['same_batches'] else 'DIFFERENT'} batches; preemptions predicted "
        f"{replay['preemptions']['predicted']}, measured {replay['preemptions']['measured']}.",
        "", "The step model on those same steps (what its error is before queueing compounds it):", "",
        "| steps | count | median step error | summed time error | at the machine's speed then: median | summed |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *(f"| {name} | {e['steps']} | {e['median_error_pct']:+.1f}% | {e['total_error_pct']:+.1f}% | "
          f"{d['median_error_pct']:+.1f}% | {d['total_error_pct']:+.1f}% |"
          for (name, e), d in zip(replay["step_model"].items(), replay["step_model_drift_corrected"].values())),
        "", _drift_section(result["machine"]), "", gate_line(result["gate"]).capitalize() + ".",
        "", f"Calibration fit: {result['calibration']}", ""])


def _drift_section(machine: dict[str, Any]) -> str:
    points = ", ".join(f"{p['kind']} {tuple(p['point'])} {p['slowdown_pct']:+.1f}% ({p['timed']}x)"
                       for p in machine["probes"])
    rows = [f"The profile's own steps, timed again between the served steps (one every "
            f"{machine['probe_every_steps']}), ran slower than when profiled by: {points}; by "
            f"{machine['slowdown_vs_profile_pct']:+.1f}% in the median"
            + (f" (meanwhile the hypervisor gave {machine['cpu_steal_pct']}% of the CPU time to other guests)"
               if machine.get("cpu_steal_pct") is not None else "")
            + ". With each predicted step time scaled by the probes nearest to it, as the probe most like it ran ("
            + "{:+.1f}%..{:+.1f}%)".format(*machine["local_slowdown_pct"]) + ":", "",
            *metrics_table(machine["metrics_drift_corrected"])]
    return "\n".join(rows)
