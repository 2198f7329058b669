"""Every Triton kernel against its pure-torch oracle, on CPU through TRITON_INTERPRET=1 (fp32/fp16 inputs:
the interpreter's bf16 tl.dot is broken). tests/gpu runs the same cases on CUDA."""
from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: a broken install fails here, never skips)
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
from engine.kernels.fused_moe import align_pairs, fused_experts
from engine.kernels.indexer_scores import paged_indexer_scores
from engine.kernels.int4_matmul import w4a16_matmul
from engine.kernels.kv_write import kv_write
from engine.kernels.mla_decode import paged_mla_decode
from engine.kernels.ownership_check import ownership_check
from engine.kernels.paged_attention import paged_decode_attention, split_pages_for
from engine.kernels.sparse_mla_decode import sparse_mla_decode
from engine.kernels.step_integrity import step_integrity_flags

DEVICE = "cpu"
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("head_dim, page_size", [(64, 16), (48, 8)])
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                 (FP8, torch.float32)])
def test_paged_decode_attention(heads, head_dim, page_size, page_dtype, q_dtype):
    case = paged_case(3, *heads, head_dim, page_size, page_dtype, q_dtype, DEVICE, seed=hash(heads) % 1000)
    out = paged_decode_attention(**case)
    expected = reference.paged_decode_attention(**case)
    assert not torch.isnan(out).any()
    assert relative_error(out, expected) < (1e-5 if q_dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.float32, torch.float32), (FP8, torch.float32)])
@pytest.mark.parametrize("batch, max_pages, spare_columns", [(3, 37, 0), (1, 9, 60), (5, 2, 0)])
def test_paged_decode_attention_splits_the_context(batch, max_pages, spare_columns, page_dtype, q_dtype):
    """Long ragged contexts over several splits merged, a table far wider than its contexts (a graph's: the splits
    past a context do nothing), and one split (short tables: the kernel writes the output itself)."""
    case = paged_case(batch, 6, 2, 48, 8, page_dtype, q_dtype, DEVICE, seed=batch + max_pages, max_pages=max_pages,
                      spare_columns=spare_columns)
    width = case["block_tables"].shape[1]
    splits = -(-width // split_pages_for(batch, 2, width))
    assert (splits > 1) == (max_pages > 4 or spare_columns > 0)
    out = paged_decode_attention(**case)
    assert not torch.isnan(out).any()
    assert relative_error(out, reference.paged_decode_attention(**case)) < 1e-5


@pytest.mark.parametrize("heads, latent_dim, rope_dim", [(4, 32, 8), (20, 64, 16), (3, 48, 24)])
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                 (FP8, torch.float32)])
def test_paged_mla_decode(heads, latent_dim, rope_dim, page_dtype, q_dtype):
    """Head counts below, above and across the kernel's block of 16; latent and rope widths not powers of two."""
    case = mla_case(3, heads, latent_dim, rope_dim, 16, page_dtype, q_dtype, DEVICE, seed=heads + latent_dim)
    out = paged_mla_decode(**case)
    expected = reference.paged_mla_decode(**case)
    assert out.shape == (3, heads, latent_dim) and not torch.isnan(out).any()
    assert relative_error(out, expected) < (1e-5 if q_dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("batch, max_pages, spare_columns", [(2, 23, 0), (1, 3, 40)])
def test_paged_mla_decode_splits_the_context(batch, max_pages, spare_columns):
    """Long ragged contexts over several merged splits, and a table much wider than its context."""
    case = mla_case(batch, 20, 64, 16, 16, torch.float32, torch.float32, DEVICE, seed=max_pages, max_pages=max_pages,
                    spare_columns=spare_columns)
    assert relative_error(paged_mla_decode(**case), reference.paged_mla_decode(**case)) < 1e-5


def test_paged_mla_decode_refuses_bad_calls():
    case = mla_case(2, 4, 32, 8, 16, torch.float32, torch.float32, DEVICE, seed=0)
    with pytest.raises(ValueError, match="page size"):
        paged_mla_decode(**{**case, "latent_pages": case["latent_pages"].reshape(-1, 8, 40)})
    with pytest.raises(ValueError, match="two scales"):
        paged_mla_decode(**{**case, "scales": torch.ones(2)})
    with pytest.raises(ValueError, match="differ"):
        paged_mla_decode(**{**case, "q": case["q"][..., :36]})


@pytest.mark.parametrize("heads, dim", [(8, 32), (20, 48), (3, 16)])
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                 (FP8, torch.float32)])
def test_paged_indexer_scores(heads, dim, page_dtype, q_dtype):
    """Head counts below and above the block of 16, a key dim that is not a power of two, ragged contexts."""
    case = indexer_case(4, heads, dim, 16, page_dtype, q_dtype, DEVICE, seed=heads + dim)
    out = paged_indexer_scores(**case)
    expected = reference.paged_indexer_scores(**case)
    seen = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(out), seen) and not torch.isnan(out).any()
    assert relative_error(out[seen], expected[seen]) < (1e-5 if q_dtype == torch.float32 else 2e-3)


def test_paged_indexer_scores_refuses_bad_calls():
    case = indexer_case(2, 4, 32, 16, FP8, torch.float32, DEVICE, seed=0)
    with pytest.raises(ValueError, match="per-token scales"):
        paged_indexer_scores(**{**case, "key_scales": None})
    with pytest.raises(ValueError, match="head_weights"):
        paged_indexer_scores(**{**case, "head_weights": case["head_weights"][:, :3].contiguous()})
    with pytest.raises(ValueError, match="page size"):
        paged_indexer_scores(**{**case, "key_pages": case["key_pages"].reshape(-1, 8, 32),
                                "key_scales": case["key_scales"].reshape(-1, 8)})


@pytest.mark.parametrize("heads, latent_dim, rope_dim, topk", [(4, 32, 8, 24), (20, 64, 16, 40), (3, 48, 24, 16),
                                                         (4, 32, 8, 64)])   # 64: the first row (32 tokens) ends in splits of pads only
@pytest.mark.parametrize("page_dtype, q_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                 (FP8, torch.float32)])
def test_sparse_mla_decode(heads, latent_dim, rope_dim, topk, page_dtype, q_dtype):
    """Selections shorter than a block of 16, across blocks, and padded where a context is shorter than top-k."""
    case = sparse_mla_case(3, heads, latent_dim, rope_dim, 16, topk, page_dtype, q_dtype, DEVICE,
                           seed=heads + latent_dim)
    out = sparse_mla_decode(**case)
    expected = reference.sparse_mla_decode(**case)
    assert out.shape == (3, heads, latent_dim) and not torch.isnan(out).any()
    assert relative_error(out, expected) < (1e-5 if q_dtype == torch.float32 else 2e-3)


def test_sparse_mla_decode_of_every_position_is_the_dense_decode():
    case = mla_case(3, 4, 32, 8, 16, torch.float32, torch.float32, DEVICE, seed=2)
    lengths = case.pop("context_lens")
    width = int(lengths.max())
    positions = torch.stack([torch.where(torch.arange(width) < n, torch.arange(width), -1) for n in lengths.tolist()])
    dense = reference.paged_mla_decode(**case, context_lens=lengths)
    assert relative_error(sparse_mla_decode(**case, positions=positions), dense) < 1e-5


@pytest.mark.parametrize("page_dtype", [torch.float32, torch.float16, FP8])
@pytest.mark.parametrize("tokens", [1, 7])
def test_kv_write(page_dtype, tokens):
    num_pages, page_size, heads, dim = 6, 8, 3, 40
    generator = torch.Generator().manual_seed(tokens)
    new_k = torch.randn(tokens, heads, dim, generator=generator) * 3
    new_v = torch.randn(tokens, 2 * heads, dim, generator=generator)[:, 1::2]     # strided, as the engine's
    slots = torch.randperm(num_pages * page_size, generator=generator)[:tokens]
    scales = (torch.rand(heads, generator=generator) * 0.01 + 0.002) if page_dtype == FP8 else None
    pages = [torch.zeros(num_pages, page_size, heads, dim).to(page_dtype) for _ in range(4)]
    kv_write(new_k, new_v, pages[0], pages[1], slots, scales, scales)
    reference.kv_write(new_k, new_v, pages[2], pages[3], slots, scales, scales)
    for ours, theirs in ((pages[0].float(), pages[2].float()), (pages[1].float(), pages[3].float())):
        assert not torch.isnan(ours).any()
        mismatch = ours != theirs
        if page_dtype != FP8:           # fp32 and fp16 pages: the very values
            assert not mismatch.any()
            continue
        # Triton's interpreter loses the carry when fp32 -> e4m3 rounding crosses a power of two (it gives
        # 16 for 31.7); CUDA converts in hardware and tests/gpu demands identical bytes.
        carry_bug = (theirs == 2 * ours) & (torch.frexp(theirs.abs()).mantissa == 0.5)
        assert not (mismatch & ~carry_bug).any()
        assert mismatch.float().mean() < 0.05
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert (pages[0].float().view(-1, heads, dim)[untouched] == 0).all()


@pytest.mark.parametrize("m, n, k, group_size", [(1, 64, 64, 32), (5, 96, 128, 64), (17, 40, 256, 128),
                                                 (33, 128, 192, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w4a16_matmul(m, n, k, group_size, dtype):
    case = int4_case(m, n, k, group_size, dtype, DEVICE, seed=m + n)
    out = w4a16_matmul(*case)
    expected = reference.w4a16_matmul(*case)
    assert out.shape == (m, n) and out.dtype == dtype and not torch.isnan(out).any()
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_w4a16_matmul_of_a_symmetric_grid_makes_its_minimums():
    """No minimums tensor, the offset instead: as the explicit minimums -8 x scale."""
    x, packed, scales, _, group_size = int4_case(3, 80, 128, 32, torch.float32, DEVICE, seed=5)
    out = w4a16_matmul(x, packed, scales, None, group_size, symmetric_offset=8)
    assert relative_error(out, reference.w4a16_matmul(x, packed, scales, -8 * scales, group_size)) < 1e-5
    with pytest.raises(ValueError, match="not both"):
        w4a16_matmul(x, packed, scales, -8 * scales, group_size, symmetric_offset=8)


@pytest.mark.parametrize("split_k", [1, 3, 5])
def test_w4a16_matmul_splits_k(split_k):
    """One row, K of 5 blocks of 64 shared by 1, 3 (two blocks each, the last split short) or 5 programs."""
    case = int4_case(1, 72, 320, 64, torch.float32, DEVICE, seed=split_k)
    out = w4a16_matmul(*case, split_k=split_k)
    assert relative_error(out, reference.w4a16_matmul(*case)) < 1e-5
    assert out.shape == (1, 72) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="split_k must be in 1..5"):
        w4a16_matmul(*case, split_k=6)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_w8a16_matmul_splits_k(split_k):
    """One row, K of 3 blocks of 64 with the last one partial (K=170), shared by 1, 2 or 3 programs."""
    case = fp8_case(1, 48, 170, torch.float32, DEVICE, seed=split_k)
    assert relative_error(w8a16_matmul(*case, split_k=split_k), reference.w8a16_matmul(*case)) < 1e-5


@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (7, 80, 100), (20, 33, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8a16_matmul(m, n, k, dtype):
    case = fp8_case(m, n, k, dtype, DEVICE, seed=m)
    out = w8a16_matmul(*case)
    expected = reference.w8a16_matmul(*case)
    assert out.shape == (m, n) and not torch.isnan(out).any()
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_wrappers_reject_bad_arguments():
    case = paged_case(2, 4, 2, 32, 8, torch.float32, torch.float32, DEVICE, seed=0)
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention(**{**case, "q": torch.randn(2, 3, 32)})
    with pytest.raises(ValueError, match="FP8 pages need"):
        paged_decode_attention(**{**case, "k_scales": torch.ones(2)})
    x, packed, scales, minimums, _ = int4_case(4, 32, 64, 32, torch.float32, DEVICE, seed=0)
    with pytest.raises(ValueError, match="group size 48"):
        w4a16_matmul(x, packed, scales, minimums, 48)
    with pytest.raises(ValueError, match="contiguous"):
        w4a16_matmul(torch.randn(64, 4).t(), packed, scales, minimums, 32)


@pytest.mark.parametrize("num_entries, num_pages", [(1, 1), (37, 11), (300, 97), (0, 5)])
def test_ownership_check(num_entries, num_pages):
    case, fate = ownership_case(num_entries, num_pages, DEVICE, seed=num_entries)
    bad = ownership_check(**case)
    assert torch.equal(bad, reference.ownership_check(**case))
    assert torch.equal(bad.cpu(), (fate >= 1) & (fate <= 4))


@pytest.mark.parametrize(("items", "pages", "width", "full"), [(1, 4, 3, False), (7, 40, 9, False), (13, 97, 20, True),
                                                                (5, 300, 140, True)])
def test_step_integrity_flags(items, pages, width, full):
    """Ragged tables (140 entries: more than one block), shared pages found by binary search among the holder keys,
    flagged items' slots sent to the padding slot."""
    case, _, _ = step_integrity_case(items, pages, width, 4, DEVICE, seed=items * 31 + width, full=full)
    expected_slots = case["slots"].clone()
    expected = reference.step_integrity_flags(**(case | {"slots": expected_slots}), pad_slot=7)
    flags = step_integrity_flags(**case, pad_slot=7)
    assert torch.equal(flags, expected) and torch.equal(case["slots"], expected_slots)
    assert items == 1 or 0 < int((flags != 0).sum()) < items


@pytest.mark.parametrize(("tokens", "top_k", "first_expert", "num_experts"), [(1, 2, 0, 6), (9, 3, 0, 6),
                                                                               (7, 4, 2, 3)])
def test_align_pairs_sorts_each_local_pair_once_into_blocks_of_its_expert(tokens, top_k, first_expert, num_experts):
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(8, generator=generator)[:top_k] for _ in range(tokens)])
    sorted_pairs, block_experts = align_pairs(ids, first_expert, num_experts, block_m=4)
    local = ids.flatten() - first_expert
    mine = [pair for pair in range(ids.numel()) if 0 <= local[pair] < num_experts]
    assert sorted(p for p in sorted_pairs.tolist() if p >= 0) == mine
    for block, expert in enumerate(block_experts.tolist()):
        rows = [p for p in sorted_pairs[4 * block:4 * block + 4].tolist() if p >= 0]
        assert (expert >= 0) == bool(rows) and all(local[p] == expert for p in rows)


@pytest.mark.parametrize("weights_format", ["float", "int4", "int4-symmetric", "fp8", "fp8-block"])
@pytest.mark.parametrize(("tokens", "first_expert"), [(1, 0), (11, 0), (6, 2)])
def test_fused_experts_match_the_loop_over_experts(tokens, first_expert, weights_format):
    """One grouped GEMM per projection against the per-expert loop: float experts, INT4 ones (group 32, with minimums
    or symmetric: minimums made in the kernel) and FP8 ones
    (scales per channel, or per 32 x 32 block) against the loop over their dequantized weights, and a rank holding
    experts 2..5 of 8 (the others' pairs contribute nothing)."""
    from engine.core.memory import WeightFormat
    from engine.model.layers.moe import Experts
    from engine.model.quant import Fp8Weight, dequantize_fp8_weight, dequantize_int4
    from engine.model.quantized_linear import QuantizedExperts

    generator = torch.Generator().manual_seed(tokens + len(weights_format))
    experts = Experts(4 if first_expert else 8, 64, 40 if weights_format == "float" else 96)    # K=40: a partial block
    experts.first_expert = first_expert
    for parameter in experts.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1
    x = torch.randn(tokens, 64, generator=generator)
    ids = torch.stack([torch.randperm(8, generator=generator)[:3] for _ in range(tokens)])
    weights = torch.rand(tokens, 3, generator=generator)
    module = experts
    if weights_format != "float":
        fmt = WeightFormat("int4", 32, symmetric=weights_format == "int4-symmetric") if "int4" in weights_format \
            else WeightFormat("fp8", block_size=32 if weights_format == "fp8-block" else None)
        module = QuantizedExperts(experts, fmt)
        for name in ("gate_up_proj", "down_proj"):          # the loop's weights: the quantized ones, dequantized
            if "int4" in weights_format:
                stacked = [dequantize_int4(module._linear(e, name).weight_int4) for e in range(experts.num_experts)]
            else:
                stacked = [dequantize_fp8_weight(Fp8Weight(getattr(module, f"{name}_values")[e],
                                                           getattr(module, f"{name}_scales")[e], fmt.block_size))
                           for e in range(experts.num_experts)]
            getattr(experts, name).data = torch.stack(stacked)
    fused = fused_experts(x, weights, ids, first_expert, experts.num_experts, *module.fused_stacks())
    expected = experts.grouped(x, weights, ids)
    assert not torch.isnan(fused).any()
    assert relative_error(fused, expected) < 1e-5
