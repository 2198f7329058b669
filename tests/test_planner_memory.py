"""Planner catalogues and memory model: hand-computed bytes, published parameter counts, directions."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

from planner.catalog.hardware import get_hardware, hardware_names
from planner.catalog.models import CONFIGS, get_model, model_names, parse_model_config
from planner.cost.memory_plan import (
    Parallelism,
    component_bytes_per_gpu,
    kv_bytes_per_token_total,
    plan_memory,
    planned_weight_scheme,
)
from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.comparisons import kv_dtype_comparison, weight_dtype_comparison
from planner.errors import PlannerError

B = 1e9


def test_kv_bytes_per_token_by_hand():
    # Llama-3.1-8B: K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert kv_bytes_per_token_total(get_model("llama-3.1-8b"), "bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    # MLA: one latent of 512 plus a rope key of 64 per layer, 61 layers, 2 bytes
    for name in ("deepseek-v3", "kimi-k2.6"):
        assert kv_bytes_per_token_total(get_model(name), "bf16") == 61 * (512 + 64) * 2 == 70_272
    # GLM-5.2: MLA over 78 layers plus the DSA indexer key (128) on the 21 layers whose `indexer_types` is "full"
    assert kv_bytes_per_token_total(get_model("glm-5.2"), "bf16") == 78 * 576 * 2 + 21 * 128 * 2
    assert kv_bytes_per_token_total(get_model("glm-5.2"), "fp8") == 78 * 576 + 21 * (128 + 4)


def test_dsa_indexer_layers_follow_indexer_types():
    """GLM 5.2 lists each layer's indexer: layers 0-2 and every fourth from 6 run their own ("full", 21 of 78),
    the others reuse the previous selection and cache no indexer key. Without the list, transformers' rule from
    `index_topk_freq` / `index_skip_topk_offset` gives the same layers; a truncated model counts its own."""
    glm = get_model("glm-5.2")
    types = glm.attention.indexer_types
    assert [i for i, kind in enumerate(types) if kind == "full"] == [0, 1, 2, *range(6, 78, 4)]
    assert glm.attention.indexer_layers == 21
    assert [glm.truncated(n).attention.indexer_layers for n in (1, 3, 4, 6, 7)] == [1, 3, 3, 3, 4]
    config = json.loads((CONFIGS / "glm-5.2.json").read_text())
    del config["indexer_types"]
    assert parse_model_config(config, "glm").attention.indexer_types == types
    config["index_topk_pattern"] = "FS" * 39
    assert parse_model_config(config, "glm").attention.indexer_layers == 39
    for bad, message in ((["full", "sparse"] * 39, "must be 'full' or 'shared'"), (["full"] * 77, "77 indexer_types"),
                         (["shared"] * 78, "first layer's indexer type")):
        with pytest.raises(PlannerError, match=message):
            parse_model_config({**config, "indexer_types": bad}, "glm")


@pytest.mark.parametrize("name, total, active", [
    ("llama-3.1-8b", 8.03 * B, 8.03 * B),
    ("llama-3.1-70b", 70.6 * B, 70.6 * B),
    ("qwen3-235b-a22b", 235 * B, 22 * B),
    ("deepseek-v3", 671 * B, None),
    ("qwen3-30b-a3b", 30.5 * B, None),
])
def test_parameter_counts_match_published_totals(name, total, active):
    model = get_model(name)
    if total is not None:
        assert model.total_parameters == pytest.approx(total, rel=0.01)
    if active is not None:
        assert model.active_parameters == pytest.approx(active, rel=0.01)


def test_parameter_counts_where_the_published_figures_round_differently():
    """Counted from the public configs: DeepSeek V3 37.55B active (published "37B"), Kimi K2 1.026T total
    and 32.9B active (published "1.04T" and "32B"), Qwen3-30B-A3B 3.35B active (published "3.3B"),
    Llama 4 Scout 17.17B active (published "17B"). The text model alone; MTP layers and vision towers
    are outside `total`. The gaps stay within 3%."""
    deepseek, kimi = get_model("deepseek-v3"), get_model("kimi-k2.6")
    assert deepseek.active_parameters == pytest.approx(37 * B, rel=0.02)
    assert kimi.total_parameters == pytest.approx(1.04e12, rel=0.015)
    assert kimi.active_parameters == pytest.approx(32 * B, rel=0.03)
    assert get_model("qwen3-30b-a3b").active_parameters == pytest.approx(3.3 * B, rel=0.02)
    assert get_model("llama-4-scout").active_parameters == pytest.approx(17 * B, rel=0.02)
    assert deepseek.mtp_parameters == pytest.approx(11.6 * B, rel=0.05)      # 685B checkpoint - 671B, about


def test_every_preset_parses_and_components_add_up():
    for name in model_names():
        model = get_model(name)
        parts = model.component_parameters()
        assert sum(parts.values()) == model.total_parameters > 0
        assert model.active_parameters <= model.total_parameters
        assert model.is_moe == (parts["routed_experts"] > 0)


def test_engine_info_and_the_planner_agree_on_smollm2_bytes_by_component():
    """One description, one byte arithmetic: the engine's report of a scheme equals the planner's on one GPU."""
    from engine.core.config import EngineConfig
    from engine.model.loader import resolve, weight_bytes_report

    config = json.loads((CONFIGS / "smollm2-135m.json").read_text())
    planner_model = parse_model_config(config, "smollm2-135m")
    report = weight_bytes_report(resolve(str(CONFIGS / "smollm2-135m.json")), planner_model,
                                 EngineConfig(weights="bf16", group_size=64))
    for weights in ("bf16", "fp8", "int4"):
        planner_bytes = component_bytes_per_gpu(planner_model, planned_weight_scheme(planner_model, weights, 64), Parallelism(1))
        assert report["weight_bytes_by_dtype"][weights]["total"] == sum(planner_bytes.values())
    assert report["weight_bytes_by_component"] == component_bytes_per_gpu(
        planner_model, planned_weight_scheme(planner_model, "bf16"), Parallelism(1))


def test_weight_bytes_by_hand():
    llama = get_model("llama-3.1-8b")
    bf16 = component_bytes_per_gpu(llama, planned_weight_scheme(llama, "bf16"), Parallelism(1))
    assert sum(bf16.values()) == 2 * llama.total_parameters
    fp8 = component_bytes_per_gpu(llama, planned_weight_scheme(llama, "fp8"), Parallelism(1))
    # q, k, v, o, gate, up, down per layer: one fp32 scale per output row
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    assert fp8["attention"] + fp8["dense_ffn"] == (bf16["attention"] + bf16["dense_ffn"]) // 2 + 4 * rows
    kimi = get_model("kimi-k2.6")
    native = component_bytes_per_gpu(kimi, planned_weight_scheme(kimi, "native"), Parallelism(1))
    routed = kimi.component_parameters()["routed_experts"]
    assert native["routed_experts"] == routed // 2 + routed // 32 * 2       # INT4 g32, one bf16 scale per group
    assert native["attention"] == 2 * kimi.component_parameters()["attention"]


def test_nvfp4_bytes_by_hand_and_only_on_blackwell():
    """NVFP4: half a byte a value, an FP8 scale per 16 and an fp32 scale per matrix; the KV cache the same per
    token (Llama-3.1-70B: 80 layers x 2 x 8 heads x 128 = 163,840 values: 81,920 + 10,240 bytes), 9/16 of FP8's.
    B200 runs it on its FP4 tensor cores; an H100 has none: refused in one line."""
    llama = get_model("llama-3.1-70b")
    nvfp4 = component_bytes_per_gpu(llama, planned_weight_scheme(llama, "nvfp4"), Parallelism(1))
    bf16 = component_bytes_per_gpu(llama, planned_weight_scheme(llama, "bf16"), Parallelism(1))
    matrices = sum(linear.count for name in ("attention", "dense_ffn") for linear in llama.components()[name].linears)
    values = (bf16["attention"] + bf16["dense_ffn"]) // 2
    assert nvfp4["attention"] + nvfp4["dense_ffn"] == values // 2 + values // 16 + 4 * matrices
    assert nvfp4["embeddings"] == bf16["embeddings"]
    b200 = get_hardware("b200")
    plan = plan_memory(llama, b200, Parallelism(1), "nvfp4", "nvfp4")
    assert plan.kv_bytes_per_token_per_gpu == 81_920 + 10_240
    assert b200.peak_flops("nvfp4") == 2 * b200.peak_flops("fp8")
    for weights, kv in (("nvfp4", "fp8"), ("fp8", "nvfp4")):
        with pytest.raises(PlannerError, match="NVFP4 .* need Blackwell's FP4 tensor cores; h100-sxm has none"):
            plan_memory(llama, get_hardware("h100-sxm"), Parallelism(1), weights, kv)


def test_tensor_parallelism_divides_weights_and_gqa_heads():
    llama = get_model("llama-3.1-8b")
    one = plan_memory(llama, get_hardware("h100-sxm"), Parallelism(1), "bf16", "bf16")
    two = plan_memory(llama, get_hardware("h100-sxm"), Parallelism(2), "bf16", "bf16")
    assert two.kv_bytes_per_token_per_gpu * 2 == one.kv_bytes_per_token_per_gpu
    assert two.weights_bytes_per_gpu == pytest.approx(one.weights_bytes_per_gpu / 2, rel=1e-4)   # norms replicated
    sixteen = plan_memory(llama, get_hardware("h100-sxm"), Parallelism(16), "bf16", "bf16")
    assert sixteen.kv_bytes_per_token_per_gpu == 2 * 32 * 1 * 128 * 2        # 8 KV heads: one each, replicated


def test_mla_latent_is_replicated_unless_attention_is_data_parallel():
    kimi = get_model("kimi-k2.6")
    tp = plan_memory(kimi, get_hardware("h200"), Parallelism(8), "native", "bf16")
    dp = plan_memory(kimi, get_hardware("h200"), Parallelism(8, attention_data_parallel=True), "native", "bf16")
    assert tp.kv_bytes_per_token_per_gpu == dp.kv_bytes_per_token_per_gpu == 70_272
    assert tp.parallel.replicas == 1 and dp.parallel.replicas == 8
    assert dp.weights_by_component["attention"] > 3 * tp.weights_by_component["attention"]   # all heads on each GPU


@pytest.mark.parametrize("name", ["llama-3.1-70b", "kimi-k2.6", "glm-5.2", "qwen3-235b-a22b"])
def test_fp8_kv_doubles_capacity_less_its_scale_overhead(name):
    comparison = kv_dtype_comparison(Deployment(name, "h200", 8, "int4", context=8192))
    model = get_model(name)
    ratio = kv_bytes_per_token_total(model, "bf16") / kv_bytes_per_token_total(model, "fp8")
    assert 1.95 <= ratio <= 2.0
    assert ratio * 0.99 <= comparison["capacity_ratio"] <= ratio * 1.01
    assert comparison["concurrency_ratio"] >= 1.9


@pytest.mark.parametrize("name", model_names())
def test_int4_weights_never_increase_any_byte_count(name):
    model = get_model(name)
    parallel = Parallelism(8 if model.total_parameters > 200 * B else 1)
    by_dtype = {w: component_bytes_per_gpu(model, planned_weight_scheme(model, w, 64 if name == "smollm2-135m" else 128),
                                           parallel) for w in ("bf16", "fp8", "int4")}
    for component, int4_bytes in by_dtype["int4"].items():
        assert int4_bytes <= by_dtype["fp8"][component] <= by_dtype["bf16"][component], component


@pytest.mark.parametrize("name, weights", [("llama-3.1-70b", "fp8"), ("kimi-k2.6", "native"),
                                           ("qwen3-30b-a3b", "bf16"), ("glm-5.2", "int4")])
def test_more_gpus_never_lower_capacity_and_longer_contexts_never_raise_concurrency(name, weights):
    model = get_model(name)
    capacities = [plan_memory(model, get_hardware("h200"), Parallelism(n), weights, "fp8").kv_capacity_tokens
                  for n in (1, 2, 4, 8)]
    assert capacities == sorted(capacities)
    plan = plan_memory(model, get_hardware("h200"), Parallelism(8), weights, "fp8")
    concurrency = [plan.max_concurrency(c) for c in (1024, 4096, 8192, 32768, model.max_position_embeddings)]
    assert concurrency == sorted(concurrency, reverse=True)


def test_max_context_names_its_limit():
    small = plan_memory(get_model("llama-3.1-70b"), get_hardware("l40s"), Parallelism(1), "int4", "bf16")
    assert small.max_context_tokens == small.replica_capacity_tokens < 131072
    assert "KV pool" in small.max_context_reason
    big = plan_memory(get_model("llama-3.1-8b"), get_hardware("h200"), Parallelism(1), "fp8", "fp8")
    assert big.max_context_tokens == 131072 and "position limit" in big.max_context_reason


def test_int4_against_fp8_weights_on_a_memory_bound_decode():
    result = weight_dtype_comparison(Deployment("llama-3.1-8b", "h100-sxm", 1, kv_dtype="fp8"))
    assert result["weight_bytes_ratio"] < 0.7
    assert result["single_stream_speedup"] > 1.2
    assert result["prefill_speedup"] <= 1.0           # prefill stays compute-bound


def test_import_planner_does_not_import_torch():
    code = ("import sys, planner, planner.cli, planner.deployment.capacity, planner.catalog.models, planner.cost.memory_plan, "
            "planner.calibration.profile_fit, planner.catalog.hardware, planner.cost.step_model; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr


def planner_cli(*args: str):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_plan_json_has_the_documented_keys():
    result = planner_cli("plan", "--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "8", "--weights", "native",
                         "--kv", "fp8", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    documented = {"weights_bytes_per_gpu", "kv_bytes_per_token_per_gpu", "kv_capacity_tokens", "max_context_tokens",
                  "max_concurrency", "decode_tokens_per_s", "prefill_tokens_per_s", "cost_per_million_tokens",
                  "single_stream_decode_tokens_per_s", "fits", "note", "weights_by_component_per_gpu",
                  "uncertainty_pct"}
    bands = {f"{name}{end}" for name in (payload["uncertainty_pct"] or {}) for end in ("_low", "_high")}
    assert set(payload) == documented | bands
    assert sum(payload["weights_by_component_per_gpu"].values()) == payload["weights_bytes_per_gpu"]
    assert payload["kv_bytes_per_token_per_gpu"] == 35_136 and payload["max_concurrency"] > 0
    assert payload["fits"] is True and 0 < payload["single_stream_decode_tokens_per_s"] < payload["decode_tokens_per_s"]
    cheaper = planner_cli("plan", "--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "8", "--weights",
                          "native", "--kv", "fp8", "--gpu-hour-usd", "1.75", "--json")
    assert json.loads(cheaper.stdout)["cost_per_million_tokens"] == pytest.approx(
        payload["cost_per_million_tokens"] / 2, rel=1e-3)


def test_a_fleet_too_small_for_the_weights_says_so_and_how_many_gpus_it_needs():
    small = evaluate(Deployment("kimi-k2.6", "h200", 3, weights="native", kv_dtype="fp8"))
    assert not small.fits and small.concurrency == 0 and small.summary()["cost_per_million_tokens"] is None
    needed = small.minimum_gpus
    assert needed is not None and needed > 3
    assert "do not fit" in small.note and f"needs at least {needed} x h200" in small.note
    assert evaluate(Deployment("kimi-k2.6", "h200", needed, weights="native", kv_dtype="fp8")).fits
    assert not evaluate(Deployment("kimi-k2.6", "h200", needed - 1, weights="native", kv_dtype="fp8")).fits
    table = planner_cli("plan", "--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "3", "--weights", "native")
    assert table.returncode == 0 and f"DOES NOT FIT: kimi-k2.6 needs at least {needed} x h200" in table.stdout
    payload = json.loads(planner_cli("plan", "--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "3",
                                     "--weights", "native", "--json").stdout)
    assert payload["fits"] is False and payload["note"] == small.note


def test_a_context_longer_than_the_pool_does_not_fit_though_the_weights_do():
    long = evaluate(Deployment("llama-3.1-8b", "l4", 1, weights="bf16", kv_dtype="bf16", context=131072))
    assert not long.fits and long.plan.kv_capacity_tokens > 0
    assert "one request of 131072 tokens needs more KV" in long.note and long.minimum_gpus == 2
    assert evaluate(Deployment("llama-3.1-8b", "l4", 1, weights="bf16", kv_dtype="bf16", context=8192)).note is None


def test_plan_and_compare_print_tables():
    plan = planner_cli("plan", "--model", "llama-3.1-8b", "--hardware", "l4", "--gpus", "1", "--weights", "int4",
                       "--kv", "fp8")
    assert plan.returncode == 0 and "max concurrency" in plan.stdout and "GiB" in plan.stdout
    compare = planner_cli("compare", "--model", "qwen3-32b", "--hardware", "a100-80gb", "--gpus", "2", "--json")
    rows = json.loads(compare.stdout)["rows"]
    assert {(row["weights"], row["kv"]) for row in rows} == {(w, kv) for w in ("bf16", "fp8", "int4", "native")
                                                             for kv in ("bf16", "fp8")}


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5", "--hardware", "h200", "--gpus", "8"], "unknown model 'gpt-5' (choose from kimi-k2.6"),
    (["--model", "kimi-k2.6", "--hardware", "tpu-v5", "--gpus", "8"], "unknown hardware 'tpu-v5' (choose from h100"),
    (["--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "0"], "GPUs must be a positive integer, got 0"),
    (["--model", "llama-3.1-8b", "--hardware", "h200", "--gpus", "1", "--context", "200000"],
     "200000 tokens is above llama-3.1-8b's limit of 131072"),
    (["--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "8", "--kv", "int8"], "unknown KV dtype 'int8'"),
    (["--model", "kimi-k2.6", "--hardware", "h200", "--gpus", "3", "--tp", "2"], "must divide the 3 GPUs"),
    (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--gpus", "1", "--weights", "nvfp4"],
     "NVFP4 weights need Blackwell's FP4 tensor cores; h100-sxm has none"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    result = planner_cli("plan", *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_unsupported_architecture_is_refused(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    result = planner_cli("plan", "--model", str(config), "--hardware", "h200", "--gpus", "1")
    assert result.returncode == 2 and "unsupported architecture 'gpt2'" in result.stderr
    with pytest.raises(PlannerError, match="lacks the key"):
        parse_model_config({"model_type": "llama"}, "broken")


def test_hardware_catalogue_is_complete():
    assert {"h100-sxm", "h200", "b200", "a100-80gb", "l4", "l40s", "cpu"} <= set(hardware_names())
    h200 = get_hardware("h200")
    assert h200.memory_bytes == 143_771 * 2 ** 20
    assert h200.peak_flops("fp8") == pytest.approx(2 * h200.peak_flops("bf16"), rel=1e-3)
    assert get_hardware("a100-80gb").peak_flops("fp8") == get_hardware("a100-80gb").peak_flops("bf16")
    assert evaluate(Deployment("llama-3.1-8b", "l40s", 1, "bf16", "bf16")).parameters_source.startswith("defaults")
    assert "public measurements" in evaluate(Deployment("llama-3.1-8b", "h100-sxm", 1, "fp8", "fp8")).parameters_source


def test_the_h800_is_an_h100_with_a_slower_nvlink():
    """Its die is the H100 SXM's: the fits made there price it (one GPU: the same answer), and only what crosses
    NVLink slows down (a tensor-parallel group's all-reduces)."""
    h800, h100 = get_hardware("h800"), get_hardware("h100-sxm")
    assert h800.same_silicon_as == "h100-sxm" and h800.link_bytes_per_s < h100.link_bytes_per_s
    one = [evaluate(Deployment("llama-3.1-8b", kind, 1, "fp8", "fp8")) for kind in ("h800", "h100-sxm")]
    assert one[0].parameters_source == one[1].parameters_source and "public measurements" in one[0].parameters_source
    assert one[0].decode_step_s == pytest.approx(one[1].decode_step_s, rel=1e-12)
    eight = [evaluate(Deployment("llama-3.1-70b", kind, 8, "fp8", "fp8")) for kind in ("h800", "h100-sxm")]
    assert eight[0].decode_step_s > eight[1].decode_step_s


@pytest.mark.parametrize("config, total, active", [
    (dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
          num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
          num_experts_per_tok=2, max_position_embeddings=32768), 46.7 * B, 12.9 * B),       # Mixtral 8x7B
    (dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
          num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
     7.61 * B, None),                                                                        # Qwen2-7B
    (dict(model_type="glm4_moe", hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
          num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
          n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
          max_position_embeddings=131072, attention_bias=True, num_nextn_predict_layers=1), 355 * B, None),  # GLM-4.5
])
def test_other_families_parse_to_their_published_sizes(config, total, active):
    model = parse_model_config(config, config["model_type"])
    assert model.total_parameters == pytest.approx(total, rel=0.01)
    if active is not None:
        assert model.active_parameters == pytest.approx(active, rel=0.01)
