"""The kernels' launch configurations: defaults, a GPU's committed tuning, the autotuner's candidates."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO
from kernel_cases import int4_case, relative_error

from engine.kernels import reference
from engine.kernels.int4_matmul import w4a16_matmul
from engine.kernels.tuning import DEFAULTS, gpu_key, launch_config, rows_bucket, trying


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
