"""The kernels' launch configurations: defaults, a GPU's committed tuning, the autotuner's candidates."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO
from kernel_cases import int4_case, relative_error

from engine.core.memory import WeightFormat
from engine.kernels import reference
from engine.kernels.backend import ENV_VARIABLE
from engine.kernels.int4_matmul import w4a16_matmul
from engine.kernels.tuning import DEFAULTS, gpu_key, launch_config, rows_bucket, trying
from engine.model.quant import quantize_fp8_weight, quantize_int4
from engine.model.quantized_linear import LINEAR_PATHS, Fp8Linear, Int4Linear, fused_rows_limit, linear_path


@pytest.mark.parametrize(("name", "key"), [("NVIDIA H200", "nvidia-h200"), ("NVIDIA H100 80GB HBM3",
                                                                            "nvidia-h100-80gb-hbm3")])
def test_gpu_key(name, key):
    assert gpu_key(name) == key


@pytest.mark.parametrize(("rows", "bucket"), [(1, "rows<=1"), (3, "rows<=4"), (16, "rows<=16"), (17, "rows<=64"),
                                              (65, "rows>64")])
def test_rows_bucket(rows, bucket):
    assert rows_bucket(rows) == bucket


def test_the_cpu_gets_the_defaults_and_a_candidate_only_while_it_is_tried():
    cpu = torch.device("cpu")
    assert launch_config("w4a16", "rows<=1", cpu) == DEFAULTS["w4a16"]
    with trying("w4a16", "rows<=1", {"block_n": 32, "target_programs": 64}):
        tried = launch_config("w4a16", "rows<=1", cpu)
        assert tried == DEFAULTS["w4a16"] | {"block_n": 32, "target_programs": 64}
        assert launch_config("w4a16", "rows<=4", cpu) == DEFAULTS["w4a16"]
        case = int4_case(1, 72, 256, 64, torch.float32, "cpu", seed=3)      # the kernel runs with the candidate
        assert relative_error(w4a16_matmul(*case), reference.w4a16_matmul(*case)) < 1e-5
    assert launch_config("w4a16", "rows<=1", cpu) == DEFAULTS["w4a16"]


def test_the_autotuner_says_it_needs_cuda():
    done = subprocess.run([sys.executable, "bench/autotune_kernels.py"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def _quantized_layers(seed: int) -> tuple[torch.Tensor, Int4Linear, Fp8Linear, Fp8Linear]:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(96, 256, generator=generator) * 0.02
    int4 = Int4Linear(quantize_int4(dense, WeightFormat("int4", 64)))
    return dense, int4, Fp8Linear(quantize_fp8_weight(dense)), Fp8Linear(quantize_fp8_weight(dense, 128))


@pytest.mark.parametrize("rows", [3, 80])
def test_every_int4_path_gives_the_dequantized_product(monkeypatch, rows):
    monkeypatch.setenv(ENV_VARIABLE, "triton")
    _, layer, _, _ = _quantized_layers(seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows + 1))
    expected = x @ layer.dense_weight(torch.float32).t()
    assert linear_path("int4_linear", rows, x.device) == ("triton" if rows <= 64 else "dequantize")
    for path in LINEAR_PATHS["int4_linear"]:
        with trying("int4_linear", rows_bucket(rows), {"path": path}):
            assert layer._path(rows, x) == path
            out = layer(x)
        tolerance = 1e-2 if path == "torch_int4" else 1e-5      # torch's kernel takes bf16 activations
        assert relative_error(out, expected) < tolerance, path


def test_fp8_paths_and_the_scaled_mm_rounding(monkeypatch):
    """W8A8 through _scaled_mm rounds each activation row to e4m3 (3 mantissa bits: at most 2^-4 relative, ~1.5%
    over a dot product of random terms); block-scaled weights fall back to the widened GEMM."""
    monkeypatch.setenv(ENV_VARIABLE, "triton")
    dense, _, channel, block = _quantized_layers(seed=5)
    x = torch.randn(80, 256, generator=torch.Generator().manual_seed(6))
    expected = x @ channel.dense_weight(torch.float32).t()
    with trying("fp8_linear", "rows>64", {"path": "scaled_mm"}):
        assert channel._path(80, x) == "scaled_mm" and block._path(80, x) == "dequantize"
        error = relative_error(channel(x), expected)
        assert relative_error(block(x), x @ block.dense_weight(torch.float32).t()) < 1e-6
    assert 1e-3 < error < 0.03
    assert channel._path(80, x) == "dequantize" and channel._path(64, x) == "triton" and block._path(8, x) == "dequantize"


def test_without_the_triton_backend_the_cpu_runs_torch_int4_and_widened_fp8():
    _, int4, channel, _ = _quantized_layers(seed=7)
    x = torch.randn(2, 256)
    assert int4._path(2, x) == "torch_int4" and channel._path(2, x) == "dequantize"
    assert fused_rows_limit("int4", x.device) is None and fused_rows_limit("fp8", x.device) == 0
    assert fused_rows_limit("bf16", x.device) is None
