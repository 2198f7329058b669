"""Step-time model and calibration: recovery of known coefficients, fit error on the committed CPU
profiles, refusal of foreign profiles, and a physics check of every decode point."""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from engine.core.step_shape import PROFILE_VERSION, REGIMES, chunk_pairs
from planner.calibration.parameters import check_fingerprint, load_calibration
from planner.calibration.profile_fit import (
    BOUNDS,
    MAX_MAPE_PCT,
    PARAMETER_NAMES,
    Points,
    calibrate,
    load_profile,
    predict,
    profile_costs,
    profile_peaks,
    samples_hash,
)
from planner.catalog.hardware import get_hardware
from planner.cost.step_model import BatchShape, MeasuredLinears, StepParameters, step_time
from planner.errors import PlannerError

PROFILES = sorted((Path(__file__).resolve().parent.parent / "planner" / "profiles").glob("cpu-*.profile.json"))
CUDA_PROFILES = sorted(PROFILES[0].parent.glob("cuda-*.profile.json"))
SMOLLM_MODEL = {
    "name": "smollm2-135m", "num_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_heads": 9,
    "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152, "num_linear_parameters": 106_168_320,
    "linear_weight_bytes": 424_673_280, "head_weight_bytes": 113_246_208, "kv_bytes_per_token": 46_080,
    "fused_max_tokens": 32, "dequantized_weight_bytes": 2 * 106_168_320 * 4,     # as INT4 weights on a CPU
}
FINGERPRINT = {"engine_version": "0.1.0", "hardware": "cpu", "model": "smollm2-135m", "weights": "fp32",
               "kv_dtype": "fp32", "copy_bandwidth_bytes_per_s": 30e9, "matmul_flops_per_s": 150e9}


# linears that BLAS runs faster at 16 rows than at 12 (as measured on this CPU), proportional past 64
LINEARS = {"rows": [1, 2, 4, 8, 12, 16, 32, 64], "decoder_s": [0.04, 0.041, 0.06, 0.075, 0.105, 0.08, 0.12, 0.16],
           "head_rows": [1, 4, 16, 64], "head_s": [0.01, 0.012, 0.02, 0.05]}


# An MLA + MoE model as the profiler describes it: 64 experts of 3.5 MB, two per token, in 4 MoE layers; MLA's
# decode pairs in the latent space, its prefill pairs expanded, and the re-expansion of a chunk's context.
EXPERT_BYTES = 3 * 576 * 512 * 4
MOE_MODEL = {**SMOLLM_MODEL, "name": "moe-mla", "num_experts": 64, "experts_per_token": 2, "num_moe_layers": 4,
             "expert_weight_bytes": EXPERT_BYTES, "linear_weight_bytes": 200_000_000 + 4 * 64 * EXPERT_BYTES,
             "linear_flops_per_token": 2.0 * 60_000_000, "attention_flops_per_pair": 2.0 * 30 * 9 * (2 * 64 + 32),
             "prefill_attention_flops_per_pair": 2.0 * 30 * 9 * 160, "prefill_context_flops_per_token": 2.0 * 30 * 64 * 9 * 128}


def synthetic_profile(params: StepParameters, noise: float = 0.0, seed: int = 0, linears: dict | None = None,
                      model: dict = SMOLLM_MODEL, drafts: int = 0) -> dict:
    """Samples whose times the step model itself produced, over the profiler's usual grid (with measured
    linears in place of the weight and linear-FLOP terms if given; with verifications of `drafts` drafts at every
    decode batch if given)."""
    rng = random.Random(seed)
    measured = MeasuredLinears.of(linears) if linears else None
    costs, peaks = profile_costs(model), profile_peaks(FINGERPRINT)
    batches = [("prefill", BatchShape.of([], [(n, n)])) for n in (16, 64, 256, 1024, 2048, 4096)]
    batches += [("decode", BatchShape.of([c] * b, [])) for b in (1, 4, 16, 64, 256) for c in (128, 512, 2048)]
    batches += [("prefill", BatchShape.of([], [(n // k, n // k)] * k)) for n, k in ((512, 2), (1024, 4), (2048, 8))]
    batches += [("mixed", BatchShape.of([c] * b, [(p // k, p // k)] * k))
                for b, c, p, k in ((4, 256, 64, 1), (16, 256, 512, 1), (32, 1024, 128, 1), (64, 128, 1024, 1),
                                   (8, 256, 1024, 4), (16, 256, 2048, 8))]
    if drafts:
        batches += [("verify", BatchShape.of([], [], 0, [(drafts + 1, c + drafts)] * b))
                    for b in (1, 4, 16, 64, 256) for c in (128, 2048)]
    samples = []
    for kind, batch in batches:
        seconds = step_time(costs, peaks, params, batch, measured) * (1 + rng.uniform(-noise, noise))
        samples.append({"kind": kind, "batch": batch.__dict__, "median_s": seconds, "times_s": [seconds]})
    return {"version": PROFILE_VERSION, "fingerprint": FINGERPRINT, "model": model, "samples": samples,
            "linears": linears}


@pytest.mark.parametrize("truth", [
    StepParameters(3e-3, 4e-4, 0.35, 0.6, 0.05, 0.2, 0.6, 0.1, 0.2, chunk_overhead_s=2e-3),
    StepParameters(1e-3, 1e-5, 0.8, 0.5, 0.6, 0.3, 0.4, 0.25, 0.6),
    StepParameters(8e-3, 2e-3, 0.2, 0.4, 0.3, 0.1, 0.9, 0.5, 0.8, chunk_overhead_s=1e-2),
])
def test_calibration_recovers_known_coefficients(truth):
    """(With no overlap at all a dense model's weight time is the same every step, so it cannot be told
    from the step overhead: only their sum is identifiable; the truths here overlap enough to tell them apart.)"""
    fitted = calibrate(synthetic_profile(truth))["parameters"]
    for name, value in truth.__dict__.items():
        absolute = 1e-6 if name.endswith("_s") else 1e-3      # seconds, or a fraction
        assert fitted[name] == pytest.approx(value, rel=0.02, abs=absolute), name


def test_calibration_recovers_the_cost_of_each_expert_run():
    truth = StepParameters(3e-3, 4e-4, 0.35, 0.6, 0.05, 0.2, 0.6, 0.1, 0.2, chunk_overhead_s=2e-3, expert_overhead_s=5e-4)
    fitted = calibrate(synthetic_profile(truth, model=MOE_MODEL))["parameters"]
    for name, value in truth.__dict__.items():
        assert fitted[name] == pytest.approx(value, rel=0.02, abs=1e-6 if name.endswith("_s") else 1e-3), name


def test_calibration_recovers_the_costs_of_verifying_drafts():
    """A profile with verification points (4 drafts each): the cost of a step that verifies and of each
    verification come out apart from the prompts' chunk overhead; without such points they stay at zero."""
    truth = StepParameters(3e-3, 4e-4, 0.35, 0.6, 0.05, 0.2, 0.6, 0.1, 0.2, chunk_overhead_s=2e-2,
                           verify_step_overhead_s=3e-2, verify_overhead_s=8e-3)
    fitted = calibrate(synthetic_profile(truth, drafts=4))["parameters"]
    for name, value in truth.__dict__.items():
        assert fitted[name] == pytest.approx(value, rel=0.02, abs=1e-6 if name.endswith("_s") else 1e-3), name
    plain = calibrate(synthetic_profile(truth))["parameters"]
    assert plain["verify_step_overhead_s"] == plain["verify_overhead_s"] == 0


def test_a_verification_is_no_prompt_chunk_and_samples_every_row():
    """Eight verifications of 4 drafts: no chunk overhead, the step's and each verification's own costs, and the
    output head on all 5 rows of each (the measured head at 40 rows, not 8)."""
    from planner.cost.step_model import step_terms

    batch = BatchShape.of([], [], 0, [(5, 300)] * 8)
    assert (batch.num_prefills, batch.num_verifications, batch.prefill_tokens, batch.logit_rows) == (8, 8, 40, 40)
    costs, peaks, linears = profile_costs(SMOLLM_MODEL), profile_peaks(FINGERPRINT), MeasuredLinears.of(LINEARS)
    terms = step_terms(costs, batch, linears)
    assert (terms.num_prefills, terms.verifying, terms.num_verifications) == (0, 1, 8)
    assert terms.measured_linear_s == pytest.approx(linears.seconds(40, 40))
    base = StepParameters(chunk_overhead_s=0.5)
    priced = StepParameters(chunk_overhead_s=0.5, verify_step_overhead_s=0.03, verify_overhead_s=0.01)
    assert step_time(costs, peaks, priced, batch) - step_time(costs, peaks, base, batch) == pytest.approx(0.03 + 8 * 0.01)
    prompts = step_terms(costs, BatchShape.of([], [(5, 300)] * 8))
    assert prompts.num_prefills == 8 and prompts.verifying == 0
    assert step_terms(costs, batch).linear_flops - prompts.linear_flops == pytest.approx(32 * costs.head_flops_per_sequence)


def test_moe_and_mla_step_terms():
    """Experts touched: 2 of 64 per token, so 1 token runs 2 per layer, 16 run 64 x (1 - (31/32)^16) = 25.2;
    MLA: decode pairs at the latent cost, prefill pairs at the expanded cost, a chunk's earlier context
    re-expanded (chunk of 100 at 300: 200 tokens)."""
    from planner.cost.step_model import step_terms

    costs = profile_costs(MOE_MODEL)
    assert costs.experts_touched(1) == pytest.approx(4 * 2)
    assert costs.experts_touched(16) == pytest.approx(4 * 64 * (1 - (31 / 32) ** 16))
    assert costs.weight_bytes_read(1) == pytest.approx(200_000_000 + SMOLLM_MODEL["head_weight_bytes"] + 8 * EXPERT_BYTES)
    decode, prefill = step_terms(costs, BatchShape.of([50], [])), step_terms(costs, BatchShape.of([], [(100, 300)]))
    assert decode.attention_flops == pytest.approx(MOE_MODEL["attention_flops_per_pair"] * 50)
    assert prefill.attention_flops == pytest.approx(MOE_MODEL["prefill_attention_flops_per_pair"]
                                                    * chunk_pairs(100, 300))
    assert prefill.linear_flops == pytest.approx(MOE_MODEL["linear_flops_per_token"] * 100 + costs.head_flops_per_sequence
                                                 + MOE_MODEL["prefill_context_flops_per_token"] * 200)
    assert decode.expert_calls == pytest.approx(8) and prefill.expert_calls == pytest.approx(costs.experts_touched(100))


def test_measured_linears_interpolate_between_row_counts_and_scale_past_the_last():
    linears = MeasuredLinears.of(LINEARS)
    assert linears.seconds(12, 1) == pytest.approx(0.105 + 0.01)
    assert linears.seconds(10, 2) == pytest.approx((0.075 + 0.105) / 2 + 0.01 + (0.012 - 0.01) / 3)
    assert linears.seconds(128, 128) == pytest.approx(0.32 + 0.1)
    costs, peaks = profile_costs(SMOLLM_MODEL), profile_peaks(FINGERPRINT)
    twelve, sixteen = (BatchShape.of([100] * n, []) for n in (12, 16))
    params = StepParameters()
    assert step_time(costs, peaks, params, twelve, linears) > step_time(costs, peaks, params, sixteen, linears)
    assert step_time(costs, peaks, params, twelve) < step_time(costs, peaks, params, sixteen)    # bytes and FLOPs
    with pytest.raises(ValueError, match="increasing row counts"):
        MeasuredLinears.of({**LINEARS, "rows": [1, 4, 2, 8, 12, 16, 32, 64]})
    with pytest.raises(ValueError, match="must be positive"):
        MeasuredLinears.of({**LINEARS, "head_s": [0.01, 0.0, 0.02, 0.05]})


def test_calibration_with_measured_linears_recovers_the_rest():
    """The physical fit still comes first (it carries over to other models); the second fit, with the
    profile's measured linears, recovers the overheads, KV and attention rates and the linears' scale."""
    truth = StepParameters(3e-3, 4e-4, kv_bandwidth_efficiency=0.2, attention_efficiency=0.1, overlap=0.4,
                           linear_scale=1.1, chunk_overhead_s=5e-3)
    calibration = calibrate(synthetic_profile(truth, linears=LINEARS), max_mape=1e9)
    assert set(calibration["parameters"]) == set(truth.__dict__)
    fitted = calibration["measured_linears"]["parameters"]
    assert calibration["measured_linears"]["linears"] == LINEARS
    for name in ("step_overhead_s", "seq_overhead_s", "kv_bandwidth_efficiency", "attention_efficiency", "overlap",
                 "linear_scale", "chunk_overhead_s"):
        assert fitted[name] == pytest.approx(getattr(truth, name), rel=0.02, abs=1e-6 if name.endswith("_s") else 1e-3)
    assert max(v for k, v in calibration["measured_linears"].items() if k.startswith("mape")) < 0.1
    # no term for them: the weight and linear-FLOP efficiencies keep their defaults
    assert fitted["bandwidth_efficiency"] == StepParameters().bandwidth_efficiency


def test_a_fit_above_the_threshold_is_refused():
    profile = synthetic_profile(StepParameters(3e-3, 4e-4, 0.35, 0.6, 0.05, 0.2, 0.6, 0.1, 0.2))
    rng = random.Random(5)
    for sample in profile["samples"]:
        sample["median_s"] *= rng.choice((0.3, 3.0))          # times that no step model can describe
    with pytest.raises(PlannerError, match="above the 15% threshold"):
        calibrate(profile)


def test_committed_cpu_profiles_and_their_calibrations():
    """SmolLM2's CPU combinations (see scripts/make_cpu_profiles.sh for those left out), and Kimi K2.6 cut to 2
    layers and 16 experts as it ships; each with its calibration beside it."""
    fingerprints = [json.loads(path.read_text())["fingerprint"] for path in PROFILES]
    smollm2 = {(f["weights"], f["kv_dtype"]) for f in fingerprints if f["model"] == "smollm2-135m"}
    assert smollm2 == {("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp8"), ("int4", "fp32"), ("int4", "fp8"),
                       ("native", "fp32"), ("native", "fp8")}
    others = [(f["model"], f.get("num_layers"), f.get("num_experts"), f["weights"], f["kv_dtype"])
              for f in fingerprints if f["model"] != "smollm2-135m"]
    assert others == [("kimi-k2.6", 2, 16, "native", "bf16")]
    for path in PROFILES:
        calibration = load_calibration(str(path).replace(".profile.json", ".calibration.json"))
        assert calibration.document["samples_sha256"] == samples_hash(load_profile(path))
    assert all(f["hardware"] == "cpu" for f in fingerprints)


def test_committed_gpu_profiles_and_their_calibrations():
    """The first H200 run's profiles (scripts/gpu_check.sh): measured on an H200 by this engine, each with the
    calibration of its own samples beside it, whose fit stayed within 20% on every regime."""
    assert len(CUDA_PROFILES) == 7
    for path in CUDA_PROFILES:
        profile = load_profile(path)
        assert profile["fingerprint"]["hardware"] == "h200" and profile["fingerprint"]["device"] == "cuda"
        calibration = load_calibration(str(path).replace(".profile.json", ".calibration.json"))
        assert calibration.document["samples_sha256"] == samples_hash(profile)
        assert all(calibration.document[f"mape_{kind}_pct"] < 20 for kind in REGIMES), path.name


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_committed_profile_fits_and_predicts_held_out_points(path, capsys):
    calibration = calibrate(load_profile(path), max_mape=1e9)
    errors = {kind: calibration[f"mape_{kind}_pct"] for kind in REGIMES}
    with capsys.disabled():
        print(f"\n{path.name}: MAPE {errors}, held out {calibration['holdout_mape_pct']}%")
    assert all(error < MAX_MAPE_PCT for error in errors.values()), errors
    assert calibration["holdout_mape_pct"] < MAX_MAPE_PCT


@pytest.mark.parametrize("path", PROFILES + CUDA_PROFILES, ids=lambda p: p.name)
def test_no_decode_point_beats_the_configured_peak_bandwidth(path):
    profile = load_profile(path)
    peak = get_hardware(profile["fingerprint"]["hardware"]).bandwidth_bytes_per_s
    decodes = [s for s in profile["samples"] if s["kind"] == "decode"]
    assert decodes
    for sample in decodes:
        achieved = sample["bytes_moved"] / sample["median_s"]
        assert achieved == pytest.approx(sample["achieved_gb_s"] * 1e9, rel=1e-2)
        assert 0 < achieved <= peak, f"{sample['batch']}: {achieved / 1e9:.1f} GB/s > {peak / 1e9:.0f} GB/s"


@pytest.mark.parametrize("field, value", [("engine_version", "0.0.9"), ("model", "llama-3.1-8b"),
                                          ("weights", "int4"), ("kv_dtype", "fp8")])
def test_a_foreign_profile_or_calibration_is_refused(field, value, tmp_path):
    profile = synthetic_profile(StepParameters())
    expected = {"engine_version": "0.1.0", "model": "smollm2-135m", "weights": "fp32", "kv_dtype": "fp32"}
    check_fingerprint(profile["fingerprint"], "profile", **expected)
    foreign = copy.deepcopy(profile)
    foreign["fingerprint"][field] = value
    with pytest.raises(PlannerError, match=f"made for .*{value!r}, not"):
        check_fingerprint(foreign["fingerprint"], "profile", **expected)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibrate(foreign)))
    with pytest.raises(PlannerError, match="this calibration was made for"):
        load_calibration(path).check_matches(**expected)


def test_unreadable_or_old_profiles_are_refused(tmp_path):
    old = synthetic_profile(StepParameters())
    old["version"] = PROFILE_VERSION + 1
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(PlannerError, match="has version"):
        load_profile(tmp_path / "old.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlannerError, match="not readable JSON"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(PlannerError, match="does not exist"):
        load_profile(tmp_path / "missing.json")


def test_calibration_carries_fingerprint_and_samples_hash():
    profile = synthetic_profile(StepParameters())
    first, second = calibrate(profile), calibrate(copy.deepcopy(profile))
    assert first["fingerprint"] == FINGERPRINT and first["samples_sha256"] == second["samples_sha256"]
    profile["samples"][0]["median_s"] *= 1.01
    assert calibrate(profile)["samples_sha256"] != first["samples_sha256"]


def test_padded_decode_attention_costs_the_longest_context_for_every_decode():
    """The engine's CPU decode attention pads each decode's pages to the batch's longest; paged kernels do not."""
    from dataclasses import replace

    from planner.cost.step_model import decode_tokens_read

    paged = profile_costs(SMOLLM_MODEL)
    padded = replace(paged, decode_padding_page=16)
    ragged, uniform = BatchShape.of([10, 100, 40], []), BatchShape.of([50, 50, 50], [])
    assert decode_tokens_read(paged, ragged) == 150
    assert decode_tokens_read(padded, ragged) == 3 * 112            # 100 tokens fill 7 pages of 16
    assert decode_tokens_read(padded, replace(ragged, decode_max_context=0)) == 150   # older profiles' samples
    peaks, params = profile_peaks(FINGERPRINT), StepParameters()
    assert step_time(paged, peaks, params, ragged) == pytest.approx(step_time(paged, peaks, params, uniform))
    assert step_time(padded, peaks, params, ragged) > step_time(padded, peaks, params, uniform)


def test_every_coefficient_has_bounds_and_the_formula_is_the_same_on_arrays():
    """The fit evaluates `step_model.combine` over arrays of points; the simulator over one step at a time."""
    assert set(BOUNDS) == set(PARAMETER_NAMES)
    profile = synthetic_profile(StepParameters(chunk_overhead_s=0.01, overlap=0.4))
    costs, peaks = profile_costs(profile["model"]), profile_peaks(profile["fingerprint"])
    params = StepParameters(step_overhead_s=3e-3, overlap=0.4, chunk_overhead_s=0.01, compute_efficiency=0.3)
    points = Points.of(profile["samples"], costs)
    one_by_one = [step_time(costs, peaks, params, BatchShape(**s["batch"])) for s in profile["samples"]]
    assert predict(points, peaks, params) == pytest.approx(one_by_one, rel=1e-12)
    assert len({round(t, 9) for t in one_by_one}) > len(one_by_one) // 2      # points of different shapes


def test_profiles_fitted_together_must_differ_only_in_depth():
    folder = PROFILES[0].parent
    profiles = [load_profile(folder / f"cpu-smollm2-135m-fp32-kv{kv}.profile.json") for kv in ("bf16", "fp32")]
    with pytest.raises(PlannerError, match="differ only in depth; these differ in kv_dtype"):
        calibrate(profiles[0], other_depths=profiles[1:])
