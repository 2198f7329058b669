"""Which step parameters a deployment gets, and how far to trust them: a calibration given, else one committed
for exactly its hardware, model and dtypes, else the committed fit to public serving benchmarks where it covers
the GPU, else the documented defaults (which carry no error bar). Calibrations are read and checked here; they
are made by `planner.calibration.profile_fit`, `planner.endpoint` and `planner.benchmarks.fit`."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.core.step_shape import engine_version
from planner.catalog.engines import ENGINE_NAMES, check_engine, engine_calibration
from planner.catalog.hardware import HardwareSpec, get_hardware
from planner.cost.step_model import (
    MeasuredLinears,
    Peaks,
    StepParameters,
)
from planner.errors import PlannerError
from planner.files import PROFILES, read_json

CALIBRATION_VERSION = 1


ENDPOINT_VERSION_PREFIX = "endpoint:"     # the engine_version of a calibration made against a running server


BENCHMARKS_VERSION_PREFIX = "benchmarks:"   # ... of one fitted to serving benchmark files (`planner.benchmarks.fit`)


PUBLIC_BENCHMARKS = PROFILES / "public-benchmarks.calibration.json"


FIGURE_ERRORS = {"decode_tokens_per_s": "output_tokens_per_s", "cost_per_million_tokens": "output_tokens_per_s",
                 "single_stream_decode_tokens_per_s": "single_stream", "prefill_tokens_per_s": "ttft",
                 "throughput_tokens_per_s": "output_tokens_per_s", "output_tokens_per_s": "output_tokens_per_s",
                 "ttft_p50_s": "ttft", "ttft_p99_s": "ttft", "tpot_p50_s": "time_between_tokens",
                 "tpot_p99_s": "time_between_tokens", "e2e_p50_s": "time_between_tokens",
                 "max_rate_rps": "output_tokens_per_s", "tokens_per_s_per_gpu": "output_tokens_per_s",
                 "tokens_per_s_per_user": "time_between_tokens", "usd_per_million_tokens": "output_tokens_per_s"}


@dataclass(frozen=True)
class Calibration:
    parameters: StepParameters
    peaks: Peaks | None                                 # None: fitted to benchmarks against the catalogue's peaks
    fingerprint: dict[str, Any]
    document: dict[str, Any]
    linears: MeasuredLinears | None = None              # for the profiled model only, with its own parameters
    measured_parameters: StepParameters | None = None

    @classmethod
    def of(cls, document: dict[str, Any], source: str = "calibration") -> Calibration:
        """A profile's or an endpoint's calibration (its measured peaks), or a benchmark fit's (peaks: null: the
        catalogue's of each GPU it covers)."""
        try:
            measured = document.get("measured_linears")
            peaks = document["peaks"]
            return cls(StepParameters(**document["parameters"]), None if peaks is None else Peaks(**peaks),
                       document["fingerprint"], document,
                       MeasuredLinears.of(measured["linears"]) if measured else None,
                       StepParameters(**measured["parameters"]) if measured else None)
        except (KeyError, TypeError, ValueError) as error:
            raise PlannerError(f"{source} is malformed: {error}") from None

    @property
    def from_endpoint(self) -> bool:
        """Made against a running server (`planner.endpoint.calibrate`): it describes that server's kernels, whatever engine
        it is, so no engine version applies."""
        return str(self.fingerprint.get("engine_version", "")).startswith(ENDPOINT_VERSION_PREFIX)

    @property
    def from_benchmarks(self) -> bool:
        """Fitted to serving benchmarks (`planner.benchmarks.fit`): any model and dtypes on the GPU kinds it covers."""
        return str(self.fingerprint.get("engine_version", "")).startswith(BENCHMARKS_VERSION_PREFIX)

    @property
    def hardware_kinds(self) -> list[str]:
        kinds = self.fingerprint.get("hardware")
        return list(kinds) if isinstance(kinds, list) else [kinds]

    @property
    def uncertainty(self) -> dict[str, float | None]:
        """The relative error bar (%) of each kind of figure: a benchmark fit's cross-validated ones; a profile's
        error on its held-out points (step times) for every figure."""
        if self.from_benchmarks:
            return dict(self.document["uncertainty_pct"])
        holdout = self.document.get("holdout_mape_pct")
        return {kind: holdout for kind in ("time_between_tokens", "ttft", "output_tokens_per_s", "single_stream")}

    def describe(self, name: str) -> str:
        """Where a plan's parameters came from, for its first line."""
        if not self.from_benchmarks:
            return f"calibration {name}"
        document = self.document
        return (f"calibrated on {document['num_points']} {document.get('described_as', 'benchmark points')} "
                f"(median error {document['median_error_pct']['all']:.1f}%, {document['cross_validation']} "
                f"{document['cross_validated_median_error_pct']['all']:.1f}%; {name})")

    def check_matches(self, engine_version: str | None = None, model: str | None = None,
                      weights: str | None = None, kv_dtype: str | None = None) -> None:
        check_fingerprint(self.fingerprint, "calibration", engine_version, model, weights, kv_dtype)


def check_fingerprint(fingerprint: dict[str, Any], what: str, engine_version: str | None = None,
                      model: str | None = None, weights: str | None = None, kv_dtype: str | None = None) -> None:
    """Refuses a profile or calibration made for something else: it would silently mispredict."""
    for key, expected, label in (("engine_version", engine_version, "engine version"), ("model", model, "model"),
                                 ("weights", weights, "weights"), ("kv_dtype", kv_dtype, "KV dtype")):
        if expected is not None and fingerprint.get(key) != expected:
            raise PlannerError(f"this {what} was made for {label} {fingerprint.get(key)!r}, not {expected!r}; "
                               f"make one with `engine profile` for this configuration")


@functools.lru_cache(maxsize=16)
def _read_calibration(path: str, mtime_ns: int) -> Calibration:
    document = read_json(path, "calibration")
    if document.get("version") != CALIBRATION_VERSION:
        raise PlannerError(f"calibration {path!r} has version {document.get('version')!r}; "
                           f"this planner reads version {CALIBRATION_VERSION}")
    return Calibration.of(document, f"calibration {path!r}")


def load_calibration(path: str | Path) -> Calibration:
    """The calibration at `path`, read again only when the file changes. Every caller shares it (a search prices
    hundreds of deployments, and a copy of a fit with its rows cost a fifth of its time): read it, never change it."""
    try:
        stamp = Path(path).stat().st_mtime_ns
    except OSError:
        stamp = -1                                  # read_json names the missing or unreadable file
    return _read_calibration(str(path), stamp)


def committed_calibration(hardware: str, model: str, weights: str, kv_dtype: str) -> Path | None:
    """A calibration under planner/profiles made on this hardware for exactly this model and these dtypes."""
    path = PROFILES / f"{hardware}-{model}-{weights}-kv{kv_dtype}.calibration.json"
    return path if path.exists() else None


@dataclass(frozen=True)
class DeploymentParameters:
    """A deployment's step parameters, the peaks a calibration measured (None: the catalogue's), where they came
    from, and the error bar of each kind of figure (None: uncalibrated defaults, no error bar)."""

    parameters: StepParameters
    measured_peaks: Peaks | None
    source: str
    uncertainty: dict[str, float | None] | None = None


def step_parameters(hardware: HardwareSpec, model: str, weights: str, kv_dtype: str, calibration: str | None = None,
                    cuda_graphs: bool | None = None, engine: str | None = None) -> DeploymentParameters:
    """The step parameters of a deployment from the given calibration (which must match), else a committed one for
    exactly this setup, else the committed fit to public benchmarks where it covers this GPU (the serving `engine`'s
    own fit where one covers it, else the fit over every engine's points), else the defaults. What a
    profile did not measure comes from the catalogue: the collectives' latency where it ran on one device, the
    cost per kernel launched where it was not profiled at several depths (`HELD`). With CUDA graphs a step
    launches once: no cost per kernel, whatever an eager engine's profile measured."""
    graphs = hardware.cuda_graphs if cuda_graphs is None else cuda_graphs
    fitted = _fitted_parameters(hardware, model, weights, kv_dtype, calibration, check_engine(engine))
    params = fitted.parameters
    if fitted.measured_peaks is None and not params.collective_latency_s:
        params = replace(params, collective_latency_s=hardware.collective_latency(graphs))
    if graphs or not params.kernel_launch_s:
        params = replace(params, kernel_launch_s=hardware.launch_cost(graphs))
    return replace(fitted, parameters=params)


def _fitted_parameters(hardware: HardwareSpec, model: str, weights: str, kv_dtype: str, path: str | None,
                       engine: str | None = None) -> DeploymentParameters:
    fallback = ""
    if path is None:
        found = committed_calibration(hardware.key, model, weights, kv_dtype)
        if found is None and engine is not None:
            found = _public_benchmarks(hardware.key, engine_calibration(engine))
            fallback = "" if found else f"no {ENGINE_NAMES[engine]} fit covers {hardware.key}: every engine's; "
        found = found or _public_benchmarks(hardware.key)
        path = str(found) if found else None
    if path is None:
        if hardware.calibrated:
            raise PlannerError(f"hardware {hardware.key!r} is described by a calibration: none exists for "
                               f"{model} {weights}/kv {kv_dtype}; give --calibration")
        return DeploymentParameters(StepParameters(), None, "defaults (no calibration for this hardware: no error bar)")
    calibration = load_calibration(path)
    if not hardware.shares_kernels_with(calibration.hardware_kinds):
        raise PlannerError(f"calibration {path!r} was made on {', '.join(map(str, calibration.hardware_kinds))}, "
                           f"not {hardware.key!r}")
    # efficiencies belong to the hardware, kernels and dtypes: a calibration applies to any model's shape; a fit to
    # benchmarks spans the engines, models and dtypes of its points
    if not calibration.from_benchmarks:
        calibration.check_matches(engine_version=None if calibration.from_endpoint else engine_version(),
                                  weights=weights, kv_dtype=kv_dtype)
    peaks = calibration.peaks if hardware.calibrated else None
    return DeploymentParameters(calibration.parameters, peaks, fallback + calibration.describe(Path(path).name),
                                calibration.uncertainty)


def _public_benchmarks(hardware: str, path: Path = PUBLIC_BENCHMARKS) -> Path | None:
    """A committed fit to public measurements (every engine's, or one engine's), where it covers this GPU kind."""
    if not path.exists():
        return None
    return path if get_hardware(hardware).shares_kernels_with(load_calibration(path).hardware_kinds) else None
