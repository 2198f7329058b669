"""Verification of disaggregated serving: the workload through a real prefill engine and a real decode engine
(`engine.harness.served_pair`), and through the simulator's two pools priced by the profile's calibration, compared.

The link between the engines is the loop's own (the hand-off frame encoded and decoded in memory); it is measured
before the run (`probe_link`: frames of several sizes, latency + bytes / bandwidth by least squares) and the
simulator is given that link, as a deployment is given its NICs. Hand-off bytes are compared exactly, request by
request: both sides compute them with `engine.core.memory.handoff_bytes`, the engine by building the frame.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.core.memory import handoff_bytes, kv_layout
from engine.core.metrics import summarize
from planner.calibration.parameters import Calibration, check_fingerprint
from planner.calibration.profile_fit import calibrate, load_profile
from planner.catalog.models import get_model
from planner.errors import PlannerError
from planner.simulation.disaggregated import ByteCost, DisaggregatedSimulation, HandoffLink
from planner.simulation.workload import Workload
from planner.verification.comparison import TIMING_METRICS, compared, gate, workload_dict
from planner.verification.engine_run import engine_of, warm_up
from planner.verification.verify import (
    AtServedSpeed,
    DriftProbes,
    cpu_ticks,
    drift_probes,
    engine_requests,
    profile_step_time,
    served_shape,
    steal_pct,
)

PROBE_PAGES = (4, 32, 128)
PROBE_REPEATS = 5

if TYPE_CHECKING:
    from engine.harness.served_pair import PairResult
    from engine.llm import LLM


def fitted(sizes: list[int], seconds: list[float]) -> ByteCost:
    """latency + bytes / bandwidth through (bytes, seconds) points, by least squares."""
    slope, intercept = np.polyfit(sizes, seconds, 1)
    return ByteCost(1.0 / max(float(slope), 1e-15), max(0.0, float(intercept)))


def probe_handoffs(prefill: LLM, decode: LLM) -> dict[str, ByteCost]:
    """What a hand-off costs the pair, at several sizes (median of a few repeats each): `pack`, the prefill engine
    copying pages out of its pool and checksumming them; `link`, the frame encoded and decoded; `unpack`, the decode
    engine checking the pages and copying them into its pool (free pages: nobody's data is touched)."""
    from engine.core.handoff import KVHandoff

    costs = {"pack": ([], []), "link": ([], []), "unpack": ([], [])}

    def timed(name: str, size: int, work: Callable[[], object]) -> None:
        times = []
        for _ in range(PROBE_REPEATS):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        costs[name][0].append(size)
        costs[name][1].append(statistics.median(times))

    for count in PROBE_PAGES:
        pages = list(range(min(count, prefill.stats().num_pages, decode.stats().num_pages)))

        def pack(pages: list[int] = pages) -> KVHandoff:
            return prefill.copy_pages_out(pages)

        handoff = pack()
        size = len(handoff.payload)
        timed("pack", size, pack)
        timed("link", size, lambda handoff=handoff: KVHandoff.decode(handoff.encode()))
        timed("unpack", size, lambda handoff=handoff, pages=pages: decode.copy_pages_in(handoff, pages))
    return {name: fitted(*points) for name, points in costs.items()}


def verify_disaggregated(profile_path: str, workload: Workload, kv_cache_gib: float = 0.25,
                         decode_kv_cache_gib: float | None = None, max_num_seqs: int = 256,
                         max_num_batched_tokens: int = 2048, max_mape: float = 1e9) -> dict[str, Any]:
    """The workload through a prefill engine and a decode engine configured as the profiled one (the decode
    engine's pool `decode_kv_cache_gib`, default the same) and through the simulator's 1P1D, compared."""
    from engine.core.step_shape import engine_version
    from engine.harness.served_pair import serve_pair

    profile = load_profile(profile_path)
    fingerprint = profile["fingerprint"]
    check_fingerprint(fingerprint, "profile", engine_version=engine_version())
    if fingerprint.get("device") != "cpu" or fingerprint.get("tensor_parallel", 1) != 1:
        raise PlannerError("a disaggregated verification runs two single-device engines here, on a CPU; this profile "
                           f"is from {fingerprint.get('device_name')!r} with tensor parallelism "
                           f"{fingerprint.get('tensor_parallel', 1)}")
    specs = workload.requests()
    if any(spec.arrival_s is None or spec.follows is not None for spec in specs):
        raise PlannerError("a disaggregated verification needs independent requests with arrival times: a poisson, "
                           "gamma or trace workload without turns")
    calibration = Calibration.of(calibrate(profile, max_mape))
    limits = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    with ExitStack() as cleanup:
        prefill = engine_of(fingerprint, kv_cache_gib, **limits)
        cleanup.callback(prefill.close)
        decode = engine_of(fingerprint, decode_kv_cache_gib or kv_cache_gib, **limits)
        cleanup.callback(decode.close)
        requests, specs = engine_requests(specs, prefill)
        probes = drift_probes(profile, kv_cache_gib, limits, cleanup, [spec.prompt_tokens for spec in specs])
        probed = probe_handoffs(prefill, decode)        # before the warm-up publishes pages the probe would overwrite
        longest = max(spec.prompt_tokens for spec in specs)
        warm_up(prefill, longest)
        warm_up(decode, longest)
        cpu_before = cpu_ticks()
        served = serve_pair(prefill, decode, requests, between_steps=probes)
        probes.complete()
        steal = steal_pct(cpu_before, cpu_ticks())
        configs = prefill.scheduler_config, decode.scheduler_config
    layout = kv_layout(get_model(fingerprint["model_source"]), fingerprint["kv_dtype"])
    if fingerprint.get("num_layers"):
        layout = replace(layout, num_layers=fingerprint["num_layers"])
    page_size = configs[1].page_size
    link = HandoffLink(probed["link"].bytes_per_s, probed["link"].latency_s,
                       lambda tokens: handoff_bytes(layout, tokens, page_size), probed["pack"], probed["unpack"])
    model = profile_step_time(calibration, profile)
    simulation = DisaggregatedSimulation(configs[0], model, 1, configs[1], model, 1, link)
    predicted = simulation.run(list(specs)).report()
    speeds = probes.local_speeds([served_shape(step) for step in served.steps_in_order()])
    drift_corrected = at_served_speed(model, configs, link, served, probes).run(list(specs)).report()
    measured = summarize(served.timings)
    engine_bytes = sorted((handoff.request, handoff.num_bytes) for handoff in served.handoffs)
    planned_bytes = [(index, link.bytes_of(spec.prompt_tokens)) for index, spec in enumerate(specs)]
    transfers = [handoff.arrived_s - handoff.ready_s for handoff in served.handoffs]
    metrics = {
        **{name: compared(predicted[name], measured[name]) for name in TIMING_METRICS},
        "preemptions": compared(predicted["preemptions"], served.preemptions),
        "handoff_bytes": compared(simulation.stats.bytes, sum(size for _, size in engine_bytes)),
    }
    machine = {**probes.report(speeds), "cpu_steal_pct": steal,
               "metrics_drift_corrected": {name: compared(drift_corrected[name], measured[name])
                                           for name in TIMING_METRICS}}
    return {
        "metrics": metrics,
        "gate": gate(metrics, machine["metrics_drift_corrected"], machine["probe_scatter_pct"]),
        "handoff_bytes_exact": engine_bytes == planned_bytes,
        "handoff_costs": {name: {"latency_s": cost.latency_s, "bytes_per_s": cost.bytes_per_s}
                          for name, cost in probed.items()},
        "link": {                 "served_transfer_p50_s": statistics.median(transfers),
                 "simulated_transfer_p50_s": statistics.median(simulation.stats.seconds)},
        "steps": {"prefill": len(served.prefill_steps), "decode": len(served.decode_steps)},
        "machine": machine,
        "workload": workload_dict(workload), "fingerprint": fingerprint,
        "engine": {"kv_cache_gib": kv_cache_gib, "decode_kv_cache_gib": decode_kv_cache_gib or kv_cache_gib, **limits},
    }


def at_served_speed(model: Callable, configs: tuple, link: HandoffLink, served: PairResult,
                    probes: DriftProbes) -> DisaggregatedSimulation:
    """The pair's simulation with each engine's steps priced at the machine's speed around its own served steps
    (both engines' steps timed in the order they ran: the two engines and the load share one machine), for a step of
    the priced step's shape."""
    around = probes.speeds_around(len(served.order))
    by_role = {role: [speed for speed, ran in zip(around, served.order) if ran == role] for role in ("prefill", "decode")}
    prefill = AtServedSpeed(model, [step.start_s for step in served.prefill_steps], by_role["prefill"],
                            probes.shape_factor)
    decode = AtServedSpeed(model, [step.start_s for step in served.decode_steps], by_role["decode"],
                           probes.shape_factor)
    simulation = DisaggregatedSimulation(configs[0], prefill, 1, configs[1], decode, 1, link)
    prefill.clock = decode.clock = lambda: simulation.env.now
    return simulation
