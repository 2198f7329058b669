"""Calibrations per serving engine: the families, their versions, which fit a deployment gets, and the deploy command
of the engine chosen (issue 47)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from planner.calibration import parameters
from planner.calibration.parameters import PUBLIC_BENCHMARKS
from planner.catalog.engines import check_engine, default_limits, engine_family, minor_version, version_groups
from planner.catalog.hardware import get_hardware
from planner.cost.step_model import StepParameters
from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.commands import deploy_commands
from planner.errors import PlannerError
from planner.simulation.simulator import BatchWait


@dataclass(frozen=True)
class Versioned:
    label: str
    engine_version: str
    model: str = "qwen3-8b"


@pytest.mark.parametrize(("text", "version"), [("0.21.0rc2", (0, 21)), ("v1.2.0rc1", (1, 2)),
                                               ("0.5.13.post1", (0, 5)), ("commit b626186", None), ("", None)])
def test_minor_versions(text, version):
    assert minor_version(text) == version


def test_families_and_bad_engines():
    assert [engine_family(name) for name in ("vllm", "sglang", "trtllm", "other", "")] == [
        "vllm", "sglang", "trtllm", "other", "other"]
    assert check_engine(None) is None and check_engine("sglang") == "sglang"
    with pytest.raises(PlannerError, match="unknown engine 'tgi'"):
        check_engine("tgi")
    with pytest.raises(PlannerError, match="unknown engine 'tgi'"):
        Deployment("llama-3.1-8b", "h100-sxm", 1, engine="tgi")


def test_other_minor_versions_stand_apart_and_unnamed_ones_join_the_newest():
    points = [Versioned("a", "v1.2.0rc1"), Versioned("b", ""), Versioned("c", "0.21.0rc2"),
              Versioned("d", "commit x"), Versioned("e", "0.20.0"), Versioned("f", "0.21.1"),
              Versioned("g", "v1.2.1", "llama-3.1-8b")]
    current, others = version_groups(points)
    assert [p.label for p in current] == ["a", "b", "d", "g"]
    assert {version: [p.label for p in group] for version, group in others.items()} == {(0, 21): ["c", "f"],
                                                                                       (0, 20): ["e"]}
    assert list(others) == [(0, 21), (0, 20)]


def test_the_reference_version_is_the_newest_that_spans_two_models():
    """A newest version measured on one model cannot anchor the family's fit: the newest spanning two does, and the
    newer one is checked against it like any other."""
    points = [Versioned("new", "0.19.1", "llama-3.1-8b"), Versioned("a", "v0.11.0", "qwen3-8b"),
              Versioned("b", "0.11.2", "qwen3-32b"), Versioned("old", "0.10.2", "llama-3.1-70b"),
              Versioned("unnamed", "")]
    current, others = version_groups(points)
    assert [p.label for p in current] == ["a", "b", "unnamed"]
    assert {version: [p.label for p in group] for version, group in others.items()} == {(0, 19): ["new"],
                                                                                       (0, 10): ["old"]}
    lone = [Versioned("x", "0.19.1", "llama-3.1-8b"), Versioned("y", "0.11.0", "llama-3.1-8b")]
    assert [p.label for p in version_groups(lone)[0]] == ["x"]         # no version spans two: the newest


def test_an_unstated_limit_is_the_engines_default_on_that_gpu():
    def limits(engine: str, hardware: str, ranks: int = 1) -> tuple[int, int] | None:
        return default_limits(engine, get_hardware(hardware), ranks)

    assert limits("vllm", "h100-sxm") == (1024, 8192)
    assert limits("vllm", "a100-80gb") == (256, 2048)       # vLLM leaves an A100 its small defaults, 80 GB or not
    assert limits("vllm", "l40s") == (256, 2048)
    assert limits("sglang", "h200", ranks=8) == (2048, 1024)
    assert limits("other", "h100-sxm") is None


def test_an_engine_gets_its_own_fit_where_one_covers_the_gpu_and_says_so_where_none_does(tmp_path, monkeypatch):
    deployment = Deployment("llama-3.1-8b", "h100-sxm", 1, engine="sglang")
    missing = tmp_path / "missing.json"
    monkeypatch.setattr(parameters, "engine_calibration", lambda engine: missing)
    fallback = evaluate(deployment)
    assert fallback.parameters_source.startswith("no SGLang fit covers h100-sxm: every engine's; calibrated on")
    own = tmp_path / "public-benchmarks-sglang.calibration.json"
    document = json.loads(PUBLIC_BENCHMARKS.read_text())
    document["parameters"]["step_overhead_s"] *= 3                  # an engine with a slower scheduler
    document["described_as"] = "public sglang measurements"
    own.write_text(json.dumps(document))
    monkeypatch.setattr(parameters, "engine_calibration", lambda engine: own)
    chosen = evaluate(deployment)
    assert "public sglang measurements" in chosen.parameters_source and own.name in chosen.parameters_source
    assert chosen.decode_step_s > fallback.decode_step_s
    assert evaluate(Deployment("llama-3.1-8b", "h100-sxm", 1)).decode_step_s == pytest.approx(fallback.decode_step_s)


def test_the_engine_chosen_gets_its_command_alone():
    base = Deployment("qwen3-235b-a22b", "h200", 8, weights="fp8", kv_dtype="fp8", expert_parallel=True,
                      attention_data_parallel=True, max_num_seqs=128)
    assert set(deploy_commands(base)) == {"vllm", "sglang", "trtllm"}
    trtllm = deploy_commands(Deployment(**{**base.__dict__, "engine": "trtllm"}))
    assert set(trtllm) == {"trtllm"}
    text = trtllm["trtllm"]
    for piece in ("enable_attention_dp: true", "dtype: fp8", "trtllm-serve Qwen/", "--tp_size 8 --ep_size 8",
                  "--max_batch_size 128", "--extra_llm_api_options extra.yaml"):
        assert piece in text, piece
    wide = deploy_commands(Deployment("deepseek-v3", "h100-sxm", 16, weights="fp8", redundant_experts=32,
                                      engine="trtllm"))["trtllm"]
    assert "backend: WIDEEP" in wide and "num_slots: 288" in wide and "mpirun -H HOST0,HOST0_1 -n 16" in wide
    assert set(deploy_commands(Deployment(**{**base.__dict__, "engine": "vllm"}))) == {"vllm"}
    polled = deploy_commands(Deployment(**{**base.__dict__, "engine": "sglang", "scheduler_recv_interval": 30}))
    assert "--scheduler-recv-interval 30" in polled["sglang"]
    assert "--scheduler-recv-interval" not in deploy_commands(Deployment(**{**base.__dict__, "engine": "sglang"}))[
        "sglang"]
    waiting = deploy_commands(Deployment(**{**base.__dict__, "engine": "trtllm", "batch_wait": BatchWait(20, 0.9)}))
    assert "batch_wait_timeout_iters: 20\nbatch_wait_max_tokens_ratio: 0.9\n" in waiting["trtllm"]
    assert "batch_wait" not in text


def test_a_family_timing_tokens_on_one_model_only_is_not_fitted_on_its_own(monkeypatch):
    """TensorRT-LLM's catalogue points without its Qwen3-8B and Qwen3-14B runs time tokens on Qwen3-32B alone in its
    reference version (the rest are throughput runs or older versions): their own fit could not be cross-validated on
    latency, so it keeps the every-engine fit and says why."""
    from planner.benchmarks import engine_fit
    from planner.benchmarks.formats import read_benchmarks
    from planner.files import BENCHMARKS

    points = read_benchmarks([BENCHMARKS / "public.csv"])
    trtllm = [point for point in points if point.engine == "trtllm" and point.model not in ("qwen3-8b", "qwen3-14b")]
    assert {point.model for point in trtllm if point.measured("tpot") or point.measured("itl")} >= {"qwen3-32b"}
    monkeypatch.setattr(engine_fit, "ENGINES", ("trtllm",))
    found = engine_fit.engine_calibrations(trtllm, {"cross_validated_rows": []}, 30.0, StepParameters())
    assert found["trtllm"]["document"] is None
    assert found["trtllm"]["why"].startswith("its points time tokens (TPOT or ITL) on qwen3-32b only")


def test_an_engines_fit_keeps_the_shared_physics_and_fits_its_own_terms():
    """Points made by the simulator at known parameters, as one engine's: its fit frees only the engine's own terms
    (step overheads, bandwidth share, API time) and keeps the GEMMs' and collectives' rates it is handed, exactly;
    its own terms come back within 5%."""
    from dataclasses import replace

    from test_benchmarks import SPECS, TRUTH, synthetic_points

    from planner.benchmarks import engine_fit

    points = [replace(point, engine="sglang", engine_version="0.5.12") for point in synthetic_points(SPECS)]
    shared = replace(TRUTH, step_overhead_s=2e-3, bandwidth_efficiency=0.5, request_overhead_s=0.1)
    found = engine_fit.engine_calibrations(points, {"cross_validated_rows": []}, 30.0, shared)["sglang"]
    parameters = found["document"]["parameters"]
    for name in found["document"]["shared_with_every_engine"]:
        assert parameters[name] == getattr(shared, name), name
    for name in ("step_overhead_s", "bandwidth_efficiency", "request_overhead_s"):
        assert parameters[name] == pytest.approx(getattr(TRUTH, name), rel=0.05), name
    assert found["document"]["max_cv_median_pct"] == 30.0      # the threshold it passed, as written
    cv = found["cross_validated_median_error_pct"]
    worst = max(cv[metric] for metric in ("tpot", "itl", "output_tokens_per_s") if cv[metric] is not None)
    refused = engine_fit.engine_calibrations(points, {"cross_validated_rows": []}, worst * 0.99, shared)["sglang"]
    assert refused["document"] is None and refused["why"].startswith("the fit's leave-one-model-out median error")
    assert refused["cross_validated_median_error_pct"] == cv and refused["points"] == found["points"]


def test_an_engine_frees_its_dense_gemm_rate_only_where_leaving_models_out_says_so():
    """Handed a shared GEMM rate 1.6x its points' truth, an engine's fit frees its own: it comes back within 5%, and
    the leave-one-model-out median over every figure it was chosen by is below the shared rate's. Handed the true
    rate, the extra term buys nothing the left-out models can see, and the shared rate stands."""
    from dataclasses import replace

    from test_benchmarks import SPECS, TRUTH, synthetic_points

    from planner.benchmarks import engine_fit

    points = [replace(point, engine="vllm", engine_version="0.11.0") for point in synthetic_points(SPECS[:2])]
    for shared_rate, chosen in ((TRUTH.compute_efficiency * 1.6, "own"), (TRUTH.compute_efficiency, "shared")):
        document = engine_fit.engine_fit(points, "vllm", replace(TRUTH, compute_efficiency=shared_rate))
        medians = document["compute_share_choice"]["cross_validated_median_error_pct_all"]
        assert document["compute_share_choice"]["chosen"] == chosen, medians
        assert ("compute_efficiency" in document["engine_terms"]) == (chosen == "own")
        if chosen == "own":
            assert medians["own"] < medians["shared"]
            assert document["parameters"]["compute_efficiency"] == pytest.approx(TRUTH.compute_efficiency, rel=0.05)
        else:
            assert medians["shared"] <= medians["own"]
            assert document["parameters"]["compute_efficiency"] == TRUTH.compute_efficiency
