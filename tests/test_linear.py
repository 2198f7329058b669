"""The engine's float matmul: whichever order it multiplies in, it is `F.linear`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers.linear import SKINNY_MAX_ROWS, Linear, linear


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300])
def test_linear_matches_f_linear(threads, rows, dtype):
    generator = torch.Generator().manual_seed(rows * threads)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    x = torch.randn(rows, 3, 80, generator=generator).to(dtype)[:, 1]   # a strided view, as layers pass
    expected = F.linear(x.float(), weight.float())
    out = linear(x, weight)
    assert out.shape == (rows, 96) and out.dtype == dtype and out.is_contiguous()
    error = float((out.float() - expected).norm() / expected.norm())
    assert error < (1e-6 if dtype == torch.float32 else 1e-2), error


def test_linear_module_keeps_batch_dims_and_has_no_bias(threads):
    layer = Linear(16, 24)
    x = torch.randn(2, 5, 16)
    assert layer.bias is None
    assert torch.allclose(layer(x), F.linear(x, layer.weight), atol=1e-6)
    assert layer(x).shape == (2, 5, 24)
