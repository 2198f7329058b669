"""CUDA-only tests: skipped where no GPU is present (the CPU suite covers the same kernels in the
Triton interpreter)."""
import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _cuda_only():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
