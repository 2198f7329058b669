"""One calibration per serving engine (`planner.catalog.engines`): each family's points fitted on their own, another
version's points joined only where they agree with the reference version's fit (the newest that spans two models),
leave-one-model-out within the family, and beside each figure what the fit over every engine says of the same points.

An engine's fit frees only what its own code decides (`ENGINE_TERMS`): its step's host and scheduling overheads,
its kernels' share of the memory bandwidth, its cost per expert run, its API server's time per request, its cost per
kernel of a prompt step it runs without a CUDA graph. The rest is physics it shares with every engine on the same
GPUs, taken from the fit over every engine in force: the experts' GEMM rate beside the dense one and the
collectives' latency. One engine's points cannot tell those apart: SGLang's (every one a MoE model) fitted them
freely to dense GEMMs at 12% of peak beside experts at 1.5 times the dense rate, and priced the Kimi K2 pools they
had never seen 29-45% low; with the shared physics, within 24%. The dense GEMMs' share of peak FLOP/s
(`compute_efficiency`) is the engine's own kernels' too, but freeing it is a model choice its points make: the fit
frees it only where that lowers the family's leave-one-model-out median error over every figure (`OWN_COMPUTE`)."""
from __future__ import annotations

import math
from typing import Any

from planner.benchmarks.fit import (
    FREE,
    PointSetup,
    calibrate_benchmarks,
    error_rows,
    fit_points,
    median_errors,
    not_replayed,
    predictions,
    refusal,
)
from planner.benchmarks.formats import HELD_OUT_FAMILIES, BenchmarkPoint
from planner.catalog.engines import ENGINES, engine_family, version_groups
from planner.cost.step_model import StepParameters
from planner.errors import PlannerError

MIN_ENGINE_POINTS = 12          # a family fitted on its own needs this many points of two models or more
ENGINE_TERMS = ("step_overhead_s", "seq_overhead_s", "bandwidth_efficiency", "expert_overhead_s",
                "request_overhead_s", "eager_kernel_s")
OWN_COMPUTE = ENGINE_TERMS + ("compute_efficiency",)
VERSION_AGREEMENT_PCT = 25.0    # another version's median |error| under the reference's fit that counts as agreeing


def fittable(points: list[BenchmarkPoint]) -> list[BenchmarkPoint]:
    return [point for point in points if not point.held_out and not not_replayed(point)]


def agreeing_versions(points: list[BenchmarkPoint], shared: StepParameters) -> tuple[list[BenchmarkPoint],
                                                                                     list[dict[str, Any]]]:
    """The reference version's points (`version_groups`), with each other version's that its fit predicts within
    VERSION_AGREEMENT_PCT (median |error|); the others kept apart, with their error."""
    current, others = version_groups(points)
    if not others:
        return current, []
    params, _ = fit_points([PointSetup.of(point) for point in current], shared, free=ENGINE_TERMS)
    kept, apart = list(current), []
    for version, group in others.items():
        setups = [PointSetup.of(point) for point in group]
        error = median_errors(error_rows(setups, predictions(setups, params), "version_check"))["all"]
        verdict = {"version": ".".join(map(str, version)), "points": len(group), "median_error_pct": error}
        if error is not None and error <= VERSION_AGREEMENT_PCT:
            kept += group
        else:
            apart.append(verdict)
    return kept, apart


def same_points(rows: list[dict[str, Any]], labels: set[str]) -> dict[str, float | None]:
    return median_errors([row for row in rows if row["point"] in labels])


def engine_fit(points: list[BenchmarkPoint], engine: str, shared: StepParameters) -> dict[str, Any]:
    """The family's fit over its own terms, and over them with its own dense GEMM rate: the one whose
    leave-one-model-out median |error| over every figure is lower (the shared rate on a tie), with both medians."""
    fits = []
    for rate, terms in (("shared", ENGINE_TERMS), ("own", OWN_COMPUTE)):
        try:
            fits.append((rate, terms, calibrate_benchmarks(points, held_out=HELD_OUT_FAMILIES,
                                                           max_cv_median_pct=math.inf, free=terms, start=shared,
                                                           described_as=f"public {engine} measurements")))
        except PlannerError:
            if not fits:            # its own terms alone cannot be fitted
                raise               # else too few figures for one more term: the shared GEMM rate stands
    medians = {rate: document["cross_validated_median_error_pct"]["all"] for rate, _, document in fits}
    chosen, terms, document = min(fits, key=lambda fit: fit[2]["cross_validated_median_error_pct"]["all"])
    document["engine_terms"] = list(terms)
    document["compute_share_choice"] = {"cross_validated_median_error_pct_all": medians, "chosen": chosen}
    return document


def engine_calibrations(points: list[BenchmarkPoint], every_engine: dict[str, Any],
                        max_cv_median_pct: float, shared: StepParameters) -> dict[str, dict[str, Any]]:
    """Per engine family: its calibration document (None where too few points or models, or where fewer than two of
    its models have a time between tokens measured), what was kept apart, and
    its leave-one-model-out medians beside the every-engine fit's cross-validated medians on the same points (also
    for a fit refused at `max_cv_median_pct`, whose document is None). `shared`: the every-engine fit in force, whose
    physics every engine's fit keeps."""
    found: dict[str, dict[str, Any]] = {}
    for engine in ENGINES:
        family = [point for point in points if engine_family(point.engine) == engine]
        fitted = fittable(family)
        models = {point.model for point in fitted}
        current, _ = version_groups(fitted)         # other versions join only if they agree: not counted on
        timed = {point.model for point in current if point.measured("tpot") or point.measured("itl")}
        if len(fitted) < MIN_ENGINE_POINTS or len(models) < 2:
            found[engine] = {"document": None, "why": f"{len(fitted)} points of {len(models)} models: fewer than "
                                                      f"{MIN_ENGINE_POINTS} of two models"}
            continue
        if len(timed) < 2:
            found[engine] = {"document": None, "why": f"its points time tokens (TPOT or ITL) on "
                                                      f"{', '.join(sorted(timed)) or 'no model'} only: a fit cannot "
                                                      f"be cross-validated on its latency"}
            continue
        kept, apart = agreeing_versions(fitted, shared)
        kept_labels = {point.label for point in kept}
        apart_labels = {point.label for point in fitted if point.label not in kept_labels}
        family_points = [point for point in family if point.label not in apart_labels]
        try:
            document = engine_fit(family_points, engine, shared)
        except PlannerError as error:
            found[engine] = {"document": None, "why": str(error), "kept_apart": apart}
            continue
        labels = {row["point"] for row in document["cross_validated_rows"]}
        medians = {"cross_validated_median_error_pct": document["cross_validated_median_error_pct"],
                   "every_engine_cross_validated_median_error_pct": same_points(every_engine["cross_validated_rows"],
                                                                                labels),
                   "held_out_median_error_pct": document["held_out_median_error_pct"],
                   "points": document["num_points"], "models": document["models"],
                   "compute_share_choice": document["compute_share_choice"]}
        refused = refusal(document, max_cv_median_pct)
        if refused:         # not written, not used: its medians still say how far the engine's own fit got
            found[engine] = {"document": None, "why": refused, "kept_apart": apart, **medians}
            continue
        document["max_cv_median_pct"] = max_cv_median_pct
        document["shared_with_every_engine"] = [name for name in FREE if name not in document["engine_terms"]]
        found[engine] = {"document": document, "kept_apart": apart, **medians}
    return found
