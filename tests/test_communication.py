"""Communication in the planner: the alpha-beta fit of collectives recovers a known link from noisy timings, and
the step model's multi-GPU terms (collectives, kernel launches, expert-parallel imbalance) are what they say."""
from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from planner.calibration.parameters import step_parameters
from planner.calibration.profile_fit import HELD, PARAMETER_NAMES, Points, free_parameters
from planner.catalog.hardware import get_hardware
from planner.catalog.models import get_model
from planner.cost.communication import LinkFit, fit_alpha_beta, wire_bytes
from planner.cost.step_model import BatchShape, ModelCosts, StepTerms, expected_max_normal
from planner.deployment.capacity import Deployment, evaluate
from planner.errors import PlannerError

SIZES = [1 << k for k in range(10, 24, 2)]


@pytest.mark.parametrize("op,ranks", [("all_reduce", 2), ("all_reduce", 8), ("all_gather", 4)])
def test_fit_recovers_a_synthetic_link_within_5_percent(op, ranks):
    truth = LinkFit(op, ranks, alpha_s=25e-6, beta_bytes_per_s=4e9)
    rng = np.random.default_rng(ranks)
    rows = [{"op": op, "bytes": size, "ranks": ranks, "median_s": truth.seconds(size) * rng.uniform(0.97, 1.03)}
            for size in SIZES for _ in range(3)]
    rows.append({"op": "all_gather" if op == "all_reduce" else "all_reduce", "bytes": 1, "ranks": ranks,
                 "median_s": 1.0})                                # another op's row is not mixed in
    fit = fit_alpha_beta(rows, op)
    assert abs(fit.alpha_s / truth.alpha_s - 1) < 0.05
    assert abs(fit.beta_bytes_per_s / truth.beta_bytes_per_s - 1) < 0.05


def test_wire_bytes_of_a_ring():
    assert wire_bytes("all_reduce", 1000, 2) == 1000 and wire_bytes("all_reduce", 1000, 8) == 1750
    assert wire_bytes("all_gather", 1000, 4) == 3000 and wire_bytes("all_reduce", 1000, 1) == 0


def test_too_few_sizes_are_refused():
    with pytest.raises(PlannerError, match="two message sizes"):
        fit_alpha_beta([{"op": "all_reduce", "bytes": 1024, "ranks": 2, "median_s": 1e-5}] * 3, "all_reduce")
    with pytest.raises(PlannerError, match="unknown collective 'broadcast'"):
        wire_bytes("broadcast", 10, 2)


MODELS = ("llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2.6", "glm-5.2", "smollm2-135m")


@pytest.mark.parametrize("model", MODELS)
def test_one_gpu_has_no_collective_no_launch_and_no_imbalance_term(model):
    """`planner plan` on one GPU gives the numbers it gave before the multi-GPU terms: with CUDA graphs (the
    catalogue's default for GPUs) those terms are exactly zero at every batch. A step with a prompt chunk pays its
    eager dispatch (the engines capture decode-only batches), one GPU or several; a decode-only step does not."""
    capacity = evaluate(Deployment(model=model, hardware="h200", gpus=1, weights="fp8", kv_dtype="fp8", context=4096))
    eager_kernel_s = step_parameters(get_hardware("h200"), model, "fp8", "fp8").parameters.eager_kernel_s
    assert eager_kernel_s > 0           # the fit to public measurements prices every one of these
    for batch in (1, 7, 64):
        parts = capacity.step_parts(BatchShape.of([4096] * batch, [(512, 512)]))
        assert parts["communication"] == 0 and parts["launches"] == 0
        assert parts["prompt_dispatch"] == pytest.approx(eager_kernel_s * get_model(model).kernels_per_step(1))
        assert capacity.step_parts(BatchShape.of([4096] * batch, []))["prompt_dispatch"] == 0


def test_eight_gpus_pay_each_collective_of_the_step():
    """Llama-3.1-70B over 8 H200s, one decode at 8192 tokens: the embedding's all-reduce and two per layer of one
    bf16 hidden state (8192 x 2 bytes), and the all-gather of 128256 / 8 bf16 logits, each at the collectives'
    latency plus its ring bytes over NVLink (450 GB/s on an H200), or PCIe (32 GB/s on an L40S). On the
    catalogue's defaults (an L40S node: not covered by the committed fit to public benchmarks) that latency is 15 us
    under CUDA graphs, 20 us without, where every kernel also costs 4 us; the H200 is priced at the fitted latency
    and link efficiency."""
    shape = BatchShape.of([8192], [])
    layers, hidden, vocab = 80, 8192, 128256
    wire = 2 * 7 / 8 * (1 + 2 * layers) * hidden * 2 + 7 * vocab // 8 * 2
    calls = 2 * layers + 2
    h200 = Deployment(model="llama-3.1-70b", hardware="h200", gpus=8, weights="fp8", kv_dtype="fp8")
    fitted = step_parameters(get_hardware("h200"), h200.model, h200.weights, h200.kv_dtype).parameters
    assert evaluate(h200).step_parts(shape)["communication"] == pytest.approx(
        calls * fitted.collective_latency_s + wire / (450e9 * fitted.link_efficiency), rel=1e-12)

    l40s = Deployment(model="llama-3.1-70b", hardware="l40s", gpus=8, weights="bf16", kv_dtype="bf16")
    link = get_hardware("l40s").link_bytes_per_s
    graphs = evaluate(l40s)
    assert graphs.parameters_source.startswith("defaults")
    assert graphs.step_parts(shape)["communication"] == pytest.approx(calls * 15e-6 + wire / link, rel=1e-12)
    eager = evaluate(replace(l40s, cuda_graphs=False))
    assert eager.step_parts(shape)["communication"] == pytest.approx(calls * 20e-6 + wire / link, rel=1e-12)
    assert eager.step_parts(shape)["launches"] == pytest.approx(get_model("llama-3.1-70b").kernels_per_step(8) * 4e-6)
    assert eager.single_stream_tokens_per_s < graphs.single_stream_tokens_per_s


def test_the_most_loaded_expert_parallel_gpu_sets_the_pace():
    """E[max of n standard normals] by quadrature; under expert parallelism the experts a GPU's layer runs are
    the mean plus that many standard deviations, never more than the GPU holds; one GPU: just the mean."""
    assert [round(expected_max_normal(n), 3) for n in (1, 2, 4, 8)] == [0.0, 0.564, 1.029, 1.424]
    shared = dict(dense_weight_bytes=0, linear_flops_per_token=0, attention_flops_per_pair=0, kv_bytes_per_token=0,
                  num_moe_layers=2, num_experts=256, experts_per_token=8, local_experts=32)
    mean, spread = ModelCosts(**shared), ModelCosts(**shared, expert_parallel_ranks=8)
    for tokens in (1, 4, 32):
        share = 1 - (1 - 8 / 256) ** tokens
        assert mean.experts_touched(tokens) == pytest.approx(2 * 32 * share)
        expected = min(32, 32 * share + 1.4236 * (32 * share * (1 - share)) ** 0.5)
        assert spread.experts_touched(tokens) == pytest.approx(2 * expected, rel=1e-3)
    assert spread.experts_touched(4096) == pytest.approx(2 * 32)


def test_the_launch_cost_is_fitted_only_across_depths():
    """One model launches as many kernels at every point of its profile: the calibration keeps the cost at its
    default rather than trading it against the step overhead, unless the points come from several depths."""
    names = list(PARAMETER_NAMES)
    assert "kernel_launch_s" in HELD
    terms = StepTerms(**{item.name: np.ones(4) for item in fields(StepTerms)})
    free = free_parameters(Points(np.array(["decode"] * 4), terms, np.ones(4)))
    assert not free[names.index("kernel_launch_s")] and free[names.index("step_overhead_s")]
    deeper = replace(terms, kernel_launches=np.array([50.0, 50.0, 90.0, 90.0]))
    assert free_parameters(Points(np.array(["decode"] * 4), deeper, np.ones(4)))[names.index("kernel_launch_s")]
