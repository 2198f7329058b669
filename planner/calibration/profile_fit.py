"""Fits the step-time model to a profile of the real engine, and guards what a fit may be used for.

A calibration is the fitted `StepParameters` plus where they came from: the profile's fingerprint
(engine version, device, dtypes, model) and a hash of its samples, the peaks the efficiencies are
relative to, and the fit error per regime and on held-out points. Fits are robust (soft-L1 loss on
relative errors, so one noisy point cannot drag the rest) and refused above an error threshold.

A profile that timed its linear layers by row count (`engine.harness.profiler.Profiler.linear_runs`) is fitted
twice: with the physical terms alone (the `parameters`, which carry over to any model on this hardware),
and with the measured linears in place of the weight and linear-FLOP terms (`measured_linears`: for the
very model profiled, as verification uses it).
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from engine.core.step_shape import PROFILE_VERSION, SAMPLE_KINDS
from planner.calibration.parameters import CALIBRATION_VERSION
from planner.catalog.hardware import catalogue
from planner.cost.communication import fit_alpha_beta
from planner.cost.step_model import (
    BatchShape,
    MeasuredLinears,
    ModelCosts,
    Peaks,
    StepParameters,
    StepTerms,
    combine,
    step_terms,
)
from planner.errors import PlannerError
from planner.files import read_json

# the committed fit to the catalogue of public measurements (bench/gpu_calibration.py writes it): the default for
# the GPU kinds it covers, where no calibration was made for exactly the deployment's model and dtypes
# which error bar each figure the planner prints carries: the cross-validated error of the measured figure it is
# (`planner.benchmarks.fit.uncertainty`)
MAX_MAPE_PCT = 15.0
PARAMETER_NAMES = tuple(item.name for item in fields(StepParameters))
# each coefficient's (lower bound, upper bound, typical size for the solver's scaling), by name
BOUNDS = {"step_overhead_s": (0.0, 1.0, 1e-3), "seq_overhead_s": (0.0, 0.1, 1e-5),
          **{name: (1e-3, 1.5, 0.1) for name in ("bandwidth_efficiency", "gemv_efficiency", "kv_bandwidth_efficiency",
                                                  "dequant_efficiency", "compute_efficiency", "attention_efficiency")},
          "overlap": (0.0, 1.0, 0.1), "linear_scale": (0.3, 3.0, 0.1), "chunk_overhead_s": (0.0, 0.1, 1e-3),
          "expert_overhead_s": (0.0, 0.05, 1e-4), "collective_latency_s": (0.0, 0.05, 1e-5),
          "link_efficiency": (0.01, 1.5, 0.1), "kernel_launch_s": (0.0, 0.01, 1e-6),
          "eager_kernel_s": (0.0, 1e-3, 1e-5),
          "request_overhead_s": (0.0, 2.0, 1e-2),
          "expert_gemm_scale": (0.01, 1.5, 0.1), "verify_step_overhead_s": (0.0, 1.0, 1e-3),
          "verify_overhead_s": (0.0, 0.1, 1e-3), "all_to_all_latency_s": (0.0, 0.01, 1e-5),
          "all_to_all_link_efficiency": (0.01, 1.5, 0.1), "network_efficiency": (0.01, 1.5, 0.1),
          "two_batch_overlap_share": (0.0, 1.0, 0.1)}
# coefficients one model's profile cannot tell from the step overhead (its kernels are as many at every point):
# fitted only over profiles of the same model at several depths, else kept at their default (the catalogue's)
HELD = ("kernel_launch_s",)
# coefficients a profile never fits: it times steps, not requests; a CPU runs the experts with the dense layers'
# matmul kernels; its eager steps' kernels are kernel_launch_s's
NOT_FROM_PROFILES = ("request_overhead_s", "expert_gemm_scale", "eager_kernel_s")
# what profiles fitted together must share: everything but the depth (and the timings)
SAME_SETUP = ("engine_version", "device", "hardware", "model", "weights", "group_size", "kv_dtype", "compute_dtype",
              "integrity", "threads", "tensor_parallel", "expert_parallel", "num_experts", "page_size")
# each coefficient with the term it scales: one whose term is zero at every point is not fitted
TERM_OF = {"bandwidth_efficiency": "weight_bytes", "gemv_efficiency": "gemv_weight_bytes",
           "dequant_efficiency": "dequant_bytes", "compute_efficiency": "linear_flops",
           "kv_bandwidth_efficiency": "kv_bytes", "attention_efficiency": "attention_flops",
           "linear_scale": "measured_linear_s", "chunk_overhead_s": "num_prefills",
           "expert_overhead_s": "expert_calls", "collective_latency_s": "collective_calls",
           "link_efficiency": "collective_wire_bytes", "kernel_launch_s": "kernel_launches",
           "eager_kernel_s": "eager_kernels",
           "expert_gemm_scale": "expert_flops", "verify_step_overhead_s": "verifying",
           "verify_overhead_s": "num_verifications", "all_to_all_latency_s": "all_to_all_calls",
           "all_to_all_link_efficiency": "all_to_all_link_bytes", "network_efficiency": "all_to_all_network_bytes",
           "two_batch_overlap_share": "overlapped"}


def load_profile(path: str | Path) -> dict[str, Any]:
    profile = read_json(path, "profile")
    if profile.get("version") != PROFILE_VERSION:
        raise PlannerError(f"profile {str(path)!r} has version {profile.get('version')!r}; "
                           f"this planner reads version {PROFILE_VERSION}: re-profile with `engine profile`")
    for key in ("fingerprint", "model", "samples"):
        if key not in profile:
            raise PlannerError(f"profile {str(path)!r} lacks {key!r}")
    if not profile["samples"]:
        raise PlannerError(f"profile {str(path)!r} has no samples")
    return profile


def samples_hash(profile: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(profile["samples"], sort_keys=True).encode()).hexdigest()


def profile_costs(model: dict[str, Any]) -> ModelCosts:
    """The step costs of the profiled model (of rank 0's share under tensor parallelism), from the bytes its
    engine allocated. Profiles of dense Llama-family models made before MLA and MoE came lack the cost
    fields: theirs follow from the shape."""
    layers, heads, head_dim = model["num_layers"], model["num_heads"], model["head_dim"]
    ranks = model.get("tensor_parallel", 1)
    experts = (model.get("local_experts") or model.get("num_experts", 0)) * model.get("num_moe_layers", 0)
    expert_bytes = model.get("expert_weight_bytes", 0)
    return ModelCosts(
        dense_weight_bytes=model["linear_weight_bytes"] - experts * expert_bytes + model["head_weight_bytes"],
        linear_flops_per_token=model.get("linear_flops_per_token", 2.0 * model["num_linear_parameters"]) / ranks,
        attention_flops_per_pair=model.get("attention_flops_per_pair", 4.0 * layers * heads * head_dim) / ranks,
        prefill_attention_flops_per_pair=(None if model.get("prefill_attention_flops_per_pair") is None
                                          else model["prefill_attention_flops_per_pair"] / ranks),
        prefill_context_flops_per_token=model.get("prefill_context_flops_per_token", 0.0) / ranks,
        expert_weight_bytes=expert_bytes, num_moe_layers=model.get("num_moe_layers", 0),
        num_experts=model.get("num_experts", 0), experts_per_token=model.get("experts_per_token", 0),
        local_experts=model.get("local_experts"),
        kv_bytes_per_token=model["kv_bytes_per_token"],
        head_flops_per_sequence=2.0 * model["vocab_size"] * model["hidden_size"] / ranks,
        tensor_parallel=ranks, collective_calls_per_step=model.get("collective_calls_per_step", 0),
        allreduce_bytes_per_token=model.get("allreduce_bytes_per_token", 0.0),
        gather_bytes_per_sequence=model.get("gather_bytes_per_sequence", 0.0),
        fused_max_tokens=model.get("fused_max_tokens"),
        dequantized_weight_bytes=model.get("dequantized_weight_bytes", 0) if model.get("fused_max_tokens")
        is not None else 0,
        decode_padding_page=model.get("decode_padding_page"),
        kernels_per_step=model.get("kernels_per_step", 0),
        index_topk=model.get("index_topk", 0), indexer_bytes_per_token=model.get("indexer_bytes_per_token", 0),
        indexer_flops_per_pair=model.get("indexer_flops_per_pair", 0.0),
        sparse_prefill=model.get("sparse_prefill", True),
    )


def profile_peaks(fingerprint: dict[str, Any], collectives: list[dict[str, Any]] | None = None) -> Peaks:
    """Catalogued peaks for a known GPU; the profile's own measurements for a CPU or an unknown device. Under
    tensor parallelism the link's bandwidth is the one its collectives reached timed alone (`planner.cost.communication`)."""
    link = fit_alpha_beta(collectives, "all_reduce").beta_bytes_per_s if collectives else None
    spec = catalogue().get(fingerprint.get("hardware") or "")
    if spec is not None and not spec.calibrated:
        return Peaks(spec.bandwidth_bytes_per_s, spec.peak_flops(fingerprint["weights"]), link)
    return Peaks(fingerprint["copy_bandwidth_bytes_per_s"], fingerprint["matmul_flops_per_s"], link)


@dataclass(frozen=True)
class Points:
    """A profile's samples: each one's regime, its step terms (every field an array over the samples) and
    the measured median per step."""

    kinds: np.ndarray
    terms: StepTerms
    seconds: np.ndarray
    collective_seconds: np.ndarray | None = None    # tensor parallelism: each step's time inside collectives

    @classmethod
    def of(cls, samples: list[dict[str, Any]], costs: ModelCosts, linears: MeasuredLinears | None = None) -> Points:
        terms = [step_terms(costs, BatchShape(**sample["batch"]), linears) for sample in samples]
        timed = all("collective_s" in sample for sample in samples)
        return cls(np.array([sample["kind"] for sample in samples]),
                   StepTerms(**{item.name: np.array([getattr(t, item.name) for t in terms], dtype=float)
                                for item in fields(StepTerms)}),
                   np.array([sample["median_s"] for sample in samples], dtype=float),
                   np.array([sample["collective_s"] for sample in samples], dtype=float) if timed else None)

    @classmethod
    def joined(cls, parts: list[Points]) -> Points:
        """Several profiles' points as one set (profiles of one model at several depths)."""
        collective = [part.collective_seconds for part in parts]
        return cls(np.concatenate([part.kinds for part in parts]),
                   StepTerms(**{item.name: np.concatenate([getattr(part.terms, item.name) for part in parts])
                                for item in fields(StepTerms)}),
                   np.concatenate([part.seconds for part in parts]),
                   None if any(c is None for c in collective) else np.concatenate(collective))

    def subset(self, mask: np.ndarray) -> Points:
        return Points(self.kinds[mask], StepTerms(**{item.name: getattr(self.terms, item.name)[mask]
                                                     for item in fields(StepTerms)}), self.seconds[mask],
                      None if self.collective_seconds is None else self.collective_seconds[mask])


def predict(points: Points, peaks: Peaks, params: StepParameters) -> np.ndarray:
    return combine(points.terms, peaks, params)


def free_parameters(points: Points) -> np.ndarray:
    """Which coefficients the points can say anything about: those whose term is not zero everywhere; the kernel
    launch cost only where the points launch different numbers of kernels (profiles at several depths), since
    at one count it is the step overhead's twin."""
    def says_something(name: str) -> bool:
        if name in NOT_FROM_PROFILES:
            return False
        if name not in TERM_OF:
            return True
        term = getattr(points.terms, TERM_OF[name])
        return np.unique(term).size > 1 if name in HELD else bool(term.any())

    return np.array([says_something(name) for name in PARAMETER_NAMES])


COMMUNICATION = ("collective_latency_s", "link_efficiency")


def fit_communication(points: Points, peaks: Peaks) -> dict[str, float]:
    """The collectives' coefficients from the time each step spent inside them (a tensor-parallel profile
    times it per point): a step's collectives are as many at every batch, so from the step times alone their
    latency could not be told from the step's fixed overhead."""
    terms, measured = points.terms, points.collective_seconds
    wire = terms.collective_wire_bytes / (peaks.link_bytes_per_s or np.inf)

    def residuals(x: np.ndarray) -> np.ndarray:
        return (x[0] * terms.collective_calls + wire / x[1]) / measured - 1.0

    lower, upper, scale = zip(*(BOUNDS[name] for name in COMMUNICATION))
    result = least_squares(residuals, np.array([float(np.min(measured / terms.collective_calls)) / 2, 1.0]),
                           bounds=(lower, upper), loss="soft_l1", f_scale=0.05, x_scale=scale)
    return dict(zip(COMMUNICATION, (float(value) for value in result.x)))


def fit(points: Points, peaks: Peaks) -> StepParameters:
    """Robust least squares on relative errors, from several starting points (the max() makes it
    non-smooth). A coefficient whose term is zero at every point (no widened weights in a float profile)
    says nothing about the data: it keeps its default rather than wandering. Where the profile timed the
    collectives inside each step, their coefficients are fitted to those times first, then held."""
    free = free_parameters(points)
    base = StepParameters()
    if points.collective_seconds is not None and points.terms.collective_calls.any():
        base = replace(base, **fit_communication(points, peaks))
        free &= np.array([name not in COMMUNICATION for name in PARAMETER_NAMES])
    defaults = np.array([getattr(base, name) for name in PARAMETER_NAMES])
    lower, upper, scale = (np.array([BOUNDS[name][column] for name in PARAMETER_NAMES])[free] for column in range(3))

    def full(x: np.ndarray) -> np.ndarray:
        values = defaults.copy()
        values[free] = x
        return values

    def residuals(x: np.ndarray) -> np.ndarray:
        return predict(points, peaks, StepParameters(*full(x))) / points.seconds - 1.0

    best = None
    for overlap, efficiency in itertools.product((0.0, 0.5, 1.0), (0.05, 0.2, 0.8)):
        start = {"step_overhead_s": min(points.seconds) / 4, "seq_overhead_s": 1e-5, "overlap": overlap,
                 "linear_scale": 1.0, "chunk_overhead_s": 1e-3, "expert_overhead_s": 1e-4,
                 "collective_latency_s": 1e-4, "link_efficiency": 1.0, "kernel_launch_s": 1e-6,
                 "verify_step_overhead_s": 1e-3, "verify_overhead_s": 1e-3}
        x0 = np.array([start.get(name, efficiency) for name in PARAMETER_NAMES])[free]
        result = least_squares(residuals, x0, bounds=(lower, upper), loss="soft_l1", f_scale=0.05, x_scale=scale,
                               max_nfev=4000)
        if best is None or result.cost < best.cost:
            best = result
    return StepParameters(*(float(value) for value in full(best.x)))


def mape_pct(points: Points, peaks: Peaks, params: StepParameters) -> float:
    return float(100 * np.mean(np.abs(predict(points, peaks, params) / points.seconds - 1.0)))


def holdout_split(points: Points) -> np.ndarray:
    """Every other point of each kind, in the profile's order: both halves span the same ranges."""
    mask = np.zeros(len(points.seconds), dtype=bool)
    for kind in SAMPLE_KINDS:
        index = np.flatnonzero(points.kinds == kind)
        mask[index[::2]] = True
    return mask


def fit_report(points: Points, peaks: Peaks, max_mape: float) -> dict[str, Any]:
    """Fitted parameters, the error per regime and on held-out points; PlannerError above `max_mape` percent."""
    params = fit(points, peaks)
    report = {f"mape_{kind}_pct": round(mape_pct(points.subset(points.kinds == kind), peaks, params), 3)
              for kind in SAMPLE_KINDS if (points.kinds == kind).any()}
    train = holdout_split(points)
    holdout = None
    if train.sum() >= free_parameters(points).sum() and (~train).any():
        holdout = round(mape_pct(points.subset(~train), peaks, fit(points.subset(train), peaks)), 3)
    worst = max(report, key=report.get)
    if report[worst] > max_mape:
        raise PlannerError(f"the fit's error is {report[worst]:.1f}% ({worst}), above the {max_mape:g}% threshold: "
                           "the profile is too noisy or the model does not describe this engine; re-profile")
    return {"parameters": asdict(params), **report, "holdout_mape_pct": holdout}


def calibrate(profile: dict[str, Any], max_mape: float = MAX_MAPE_PCT,
              other_depths: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Fits a profile, with profiles of the same setup at other depths (`engine profile --num-layers`) where
    given: then the cost per kernel launched is fitted too. Raises PlannerError when any regime's error is
    above `max_mape` percent, or when another profile's setup differs."""
    fingerprint = profile["fingerprint"]
    others = other_depths or []
    for other in others:
        differs = [key for key in SAME_SETUP if other["fingerprint"].get(key) != fingerprint.get(key)]
        if differs:
            raise PlannerError(f"profiles fitted together must differ only in depth; these differ in "
                               f"{', '.join(differs)}: {[other['fingerprint'].get(k) for k in differs]!r} against "
                               f"{[fingerprint.get(k) for k in differs]!r}")
    costs = profile_costs(profile["model"])
    peaks = profile_peaks(fingerprint, profile.get("collectives"))
    points = Points.joined([Points.of(p["samples"], profile_costs(p["model"])) for p in [profile, *others]])
    document = {
        "version": CALIBRATION_VERSION,
        "fingerprint": fingerprint,
        "samples_sha256": samples_hash(profile),
        "model": profile["model"],
        "peaks": asdict(peaks),
        **fit_report(points, peaks, max_mape),
        "max_mape_pct": max_mape,
        "num_samples": len(points.seconds),
    }
    if others:
        document["other_depths"] = [{"num_layers": other["model"]["num_layers"], "samples_sha256": samples_hash(other),
                                     "num_samples": len(other["samples"])} for other in others]
    elif profile.get("linears"):
        linears = MeasuredLinears.of(profile["linears"])
        document["measured_linears"] = {"linears": profile["linears"],
                                        **fit_report(Points.of(profile["samples"], costs, linears), peaks, max_mape)}
    return document
