"""The Triton kernels on CUDA against the same torch oracles, bf16 included, FP8 writes byte-exact."""
from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_cases import (
    fp8_case,
    indexer_case,
    int4_case,
    mla_case,
    ownership_case,
    paged_case,
    relative_error,
    sparse_mla_case,
    step_integrity_case,
)

from engine.kernels import reference
from engine.kernels.fp8_matmul import w8a16_matmul
from engine.kernels.indexer_scores import paged_indexer_scores
from engine.kernels.int4_matmul import w4a16_matmul
from engine.kernels.kv_write import kv_write
from engine.kernels.mla_decode import paged_mla_decode
from engine.kernels.ownership_check import ownership_check
from engine.kernels.paged_attention import paged_decode_attention
from engine.kernels.sparse_mla_decode import sparse_mla_decode
from engine.kernels.step_integrity import step_integrity_flags

DEVICE = "cuda"
FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (9, 3)])
@pytest.mark.parametrize("head_dim, page_size", [(128, 16), (64, 32)])
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                 (FP8, torch.bfloat16), (torch.float32, torch.float32)])
def test_paged_decode_attention_cuda(heads, head_dim, page_size, page_dtype, q_dtype):
    case = paged_case(17, *heads, head_dim, page_size, page_dtype, q_dtype, DEVICE, seed=1)
    out = paged_decode_attention(**case)
    assert not torch.isnan(out).any()
    assert relative_error(out, reference.paged_decode_attention(**case)) < TOLERANCE[q_dtype]


@pytest.mark.parametrize("heads", [16, 64, 128, 20])
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.bfloat16, torch.bfloat16), (FP8, torch.bfloat16),
                                                 (torch.float32, torch.float32)])
def test_paged_mla_decode_cuda(heads, page_dtype, q_dtype):
    """DeepSeek-V3 / Kimi K2.6 widths: a 512 latent and a 64 rope key per token, shared by every head."""
    case = mla_case(9, heads, 512, 64, 16, page_dtype, q_dtype, DEVICE, seed=heads)
    out = paged_mla_decode(**case)
    assert not torch.isnan(out).any()
    assert relative_error(out, reference.paged_mla_decode(**case)) < TOLERANCE[q_dtype]


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.bfloat16, torch.bfloat16), (FP8, torch.bfloat16),
                                                 (torch.float32, torch.float32)])
def test_paged_indexer_scores_cuda(page_size, page_dtype, q_dtype):
    """GLM 5.2's indexer: 32 heads of 128 dims, FP8 keys with a scale per token."""
    case = indexer_case(9, 32, 128, page_size, page_dtype, q_dtype, DEVICE, seed=page_size)
    out = paged_indexer_scores(**case)
    expected = reference.paged_indexer_scores(**case)
    seen = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(out), seen) and not torch.isnan(out).any()
    assert relative_error(out[seen], expected[seen]) < TOLERANCE[q_dtype]


@pytest.mark.parametrize("heads, topk", [(64, 128), (16, 2048), (20, 100)])
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.bfloat16, torch.bfloat16), (FP8, torch.bfloat16),
                                                 (torch.float32, torch.float32)])
def test_sparse_mla_decode_cuda(heads, topk, page_dtype, q_dtype):
    """GLM 5.2's widths: a 512 latent and a 64 rope key per token; selections shorter and longer than the
    contexts of 64-token pages."""
    case = sparse_mla_case(9, heads, 512, 64, 64, topk, page_dtype, q_dtype, DEVICE, seed=heads)
    out = sparse_mla_decode(**case)
    assert not torch.isnan(out).any()
    assert relative_error(out, reference.sparse_mla_decode(**case)) < TOLERANCE[q_dtype]


@pytest.mark.parametrize("page_dtype", [torch.bfloat16, FP8])
def test_kv_write_cuda_is_byte_exact(page_dtype):
    generator = torch.Generator().manual_seed(0)
    new_k = (torch.randn(37, 8, 128, generator=generator) * 3).to(DEVICE, torch.bfloat16)
    new_v = torch.randn(37, 8, 128, generator=generator).to(DEVICE, torch.bfloat16)
    slots = torch.randperm(64 * 16, generator=generator)[:37].to(DEVICE)
    scales = (torch.rand(8, generator=generator) * 0.01 + 0.002).to(DEVICE) if page_dtype == FP8 else None
    pages = [torch.zeros(64, 16, 8, 128, device=DEVICE).to(page_dtype) for _ in range(4)]
    kv_write(new_k, new_v, pages[0], pages[1], slots, scales, scales)
    reference.kv_write(new_k, new_v, pages[2], pages[3], slots, scales, scales)
    assert torch.equal(pages[0].view(torch.uint8), pages[2].view(torch.uint8))
    assert torch.equal(pages[1].view(torch.uint8), pages[3].view(torch.uint8))


@pytest.mark.parametrize("m", [1, 16, 64, 100])
@pytest.mark.parametrize("n, k, group_size", [(4096, 4096, 128), (576, 576, 32), (1000, 1536, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_matmul_cuda(m, n, k, group_size, dtype):
    case = int4_case(m, n, k, group_size, dtype, DEVICE, seed=m)
    out = w4a16_matmul(*case)
    assert not torch.isnan(out).any()
    assert relative_error(out, reference.w4a16_matmul(*case)) < TOLERANCE[dtype]


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1000, 1536)])
def test_w8a16_matmul_cuda(m, n, k):
    case = fp8_case(m, n, k, torch.bfloat16, DEVICE, seed=m)
    out = w8a16_matmul(*case)
    assert relative_error(out, reference.w8a16_matmul(*case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_entries, num_pages", [(1, 1), (37, 11), (300, 97), (0, 5)])
def test_ownership_check_cuda(num_entries, num_pages):
    case, fate = ownership_case(num_entries, num_pages, DEVICE, seed=num_entries)
    bad = ownership_check(**case)
    assert torch.equal(bad, reference.ownership_check(**case))
    assert torch.equal(bad.cpu(), (fate >= 1) & (fate <= 4))


@pytest.mark.parametrize(("items", "pages", "width", "full"), [(1, 4, 3, False), (64, 900, 64, False),
                                                                (13, 97, 300, True)])
def test_step_integrity_flags(items, pages, width, full):
    case, _, _ = step_integrity_case(items, pages, width, 16, DEVICE, seed=items + width, full=full)
    expected_slots = case["slots"].clone()
    expected = reference.step_integrity_flags(**(case | {"slots": expected_slots}), pad_slot=5)
    flags = step_integrity_flags(**case, pad_slot=5)
    assert torch.equal(flags, expected) and torch.equal(case["slots"], expected_slots)


@pytest.mark.parametrize("page_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("batch, max_pages, spare_columns", [(1, 64, 448), (8, 300, 0), (64, 8, 0)])
def test_paged_decode_attention_splits_long_contexts_cuda(batch, max_pages, spare_columns, page_dtype):
    """Flash-decoding's splits and merge on the device: one long context in a graph-wide table, several long ones,
    many short ones."""
    case = paged_case(batch, 32, 8, 128, 16, page_dtype, torch.bfloat16, DEVICE, seed=batch, max_pages=max_pages,
                      spare_columns=spare_columns)
    out = paged_decode_attention(**case)
    assert not torch.isnan(out).any()
    assert relative_error(out, reference.paged_decode_attention(**case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("m, n, k, group_size", [(1, 4096, 4096, 128), (3, 14336, 4096, 64), (16, 4096, 14336, 32)])
def test_w4a16_split_k_cuda(m, n, k, group_size):
    case = int4_case(m, n, k, group_size, torch.bfloat16, DEVICE, seed=m)
    assert relative_error(w4a16_matmul(*case), reference.w4a16_matmul(*case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_experts_cuda(tokens, int4):
    """Kimi-like routing (8 of 64 experts here, hidden 1024, expert width 256) against the loop over experts."""
    from engine.core.memory import WeightFormat
    from engine.kernels.fused_moe import fused_experts
    from engine.model.layers.moe import Experts
    from engine.model.quant import dequantize_int4
    from engine.model.quantized_linear import QuantizedExperts

    generator = torch.Generator().manual_seed(tokens)
    experts = Experts(64, 1024, 256)
    for parameter in experts.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.05
    module = experts
    if int4:
        module = QuantizedExperts(experts, WeightFormat("int4", 32, symmetric=True))
        for name in ("gate_up_proj", "down_proj"):
            getattr(experts, name).data = torch.stack([dequantize_int4(module._linear(e, name).weight_int4)
                                                       for e in range(64)])
    experts, module = experts.to(DEVICE, torch.bfloat16), module.to(DEVICE)
    x = (torch.randn(tokens, 1024, generator=generator) * 0.5).to(DEVICE, torch.bfloat16)
    ids = torch.stack([torch.randperm(64, generator=generator)[:8] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, 8, generator=generator).to(DEVICE)
    fused = fused_experts(x, weights, ids, 0, 64, *module.fused_stacks())
    assert relative_error(fused, experts.grouped(x, weights, ids)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_every_quantized_linear_path_cuda(rows):
    """Each path the autotuner may choose (Triton, torch's tinygemm / _scaled_mm, the widened weight) against the
    widened weight's product; and the rows the default tuning serves unwidened."""
    from engine.core.memory import WeightFormat
    from engine.kernels.tuning import rows_bucket, trying
    from engine.model.quant import quantize_fp8_weight, quantize_int4
    from engine.model.quantized_linear import LINEAR_PATHS, Fp8Linear, Int4Linear, fused_rows_limit

    generator = torch.Generator().manual_seed(rows)
    dense = (torch.randn(4096, 1024, generator=generator) * 0.02).to(DEVICE, torch.bfloat16)
    layers = {"int4_linear": Int4Linear(quantize_int4(dense, WeightFormat("int4", 128, scale_dtype="bf16"))),
              "fp8_linear": Fp8Linear(quantize_fp8_weight(dense))}
    x = torch.randn(rows, 1024, generator=generator).to(DEVICE, torch.bfloat16)
    for kernel, layer in layers.items():
        expected = x.float() @ layer.dense_weight(torch.float32).t()
        for path in LINEAR_PATHS[kernel]:
            with trying(kernel, rows_bucket(rows), {"path": path}):
                assert layer._path(rows, x) == path
                tolerance = 0.04 if path == "scaled_mm" else TOLERANCE[torch.bfloat16]
                assert relative_error(layer(x), expected) < tolerance, (kernel, path)
    with contextlib.ExitStack() as paths:
        for bucket, path in (("rows<=1", "torch_int4"), ("rows<=4", "triton"), ("rows<=16", "dequantize")):
            paths.enter_context(trying("int4_linear", bucket, {"path": path}))
        assert fused_rows_limit("int4", x.device) == 4
