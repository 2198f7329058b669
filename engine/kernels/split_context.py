"""Flash-decoding's two halves shared by the decode kernels: how many pages of a block table each program covers,
and the merge of the programs' partial softmax results (maximum, sum, unnormalized values) per (sequence, head).
A split past its sequence's context wrote nothing and is not read (`context_lens` given); a split of a DSA
selection that held only pads wrote a maximum of -inf and weighs nothing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import next_power_of_2

MIN_SPLIT_PAGES = 4             # a split's share of a table: at least this many pages
TARGET_PROGRAMS = 8192          # programs a decode call aims at, most exiting at once when contexts are short
BLOCK_SPLITS = 16               # splits the merge reads at a time


@triton.jit
def store_result(out_ptr, part_max_ptr, part_sum_ptr, seq, heads, heads_ok, split, cols, cols_ok, running_max,
                 running_sum, acc, stride_pb, stride_ph, stride_ob, stride_oh, WIDTH: tl.constexpr,
                 SPLIT: tl.constexpr):
    """A decode program's online-softmax result for its heads: with SPLIT the partial the merge reads (maximum, sum
    and unnormalized values per head; `out_ptr` the fp32 partials [batch, heads, splits, WIDTH]), else the
    normalized output rows."""
    mask = heads_ok[:, None] & cols_ok[None, :]
    if SPLIT:
        part = seq * stride_pb + heads * stride_ph + split
        tl.store(part_max_ptr + part, running_max, mask=heads_ok)
        tl.store(part_sum_ptr + part, running_sum, mask=heads_ok)
        tl.store(out_ptr + part[:, None] * WIDTH + cols[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + cols[None, :],
                 (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, lens_ptr, out_ptr, split_pages, num_splits,
                         stride_pb, stride_ph, stride_ob, stride_oh, num_heads,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_S: tl.constexpr, BY_LENGTH: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if BY_LENGTH:                       # the splits that had pages of the context: those that wrote a partial
        splits = tl.cdiv(tl.cdiv(tl.load(lens_ptr + seq), PAGE_SIZE), split_pages)
    else:
        splits = num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = seq * stride_pb + head * stride_ph
    total_max = tl.full([1], float("-inf"), dtype=tl.float32)
    total_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, splits, BLOCK_S):
        index = start + tl.arange(0, BLOCK_S)
        ok = index < splits
        maxima = tl.load(part_max_ptr + base + index, mask=ok, other=float("-inf"))
        sums = tl.load(part_sum_ptr + base + index, mask=ok, other=0.0)
        values = tl.load(part_acc_ptr + (base + index)[:, None] * HEAD_DIM + d[None, :],
                         mask=ok[:, None] & d_ok[None, :], other=0.0)
        new_max = tl.maximum(total_max, tl.max(maxima, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)       # nothing but pads so far: nothing to weigh
        weights = tl.where(ok & (maxima > float("-inf")), tl.exp(maxima - shift), 0.0)
        correction = tl.exp(total_max - shift)
        total_sum = total_sum * correction + tl.sum(weights * sums, axis=0)
        acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
        total_max = new_max
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, (acc / total_sum).to(out_ptr.dtype.element_ty),
             mask=d_ok)


def split_pages_for(batch: int, programs_per_split: int, table_pages: int,
                    target_programs: int = TARGET_PROGRAMS) -> int:
    """Pages of a table each split covers: few enough that a short batch spreads over many programs, enough that a
    long table does not launch far more programs than the device runs at once. A power of two, from the batch, the
    programs of each split of a sequence (its KV heads, or blocks of heads) and the table's width only (a graph's
    replays share it)."""
    wanted = -(-table_pages * batch * programs_per_split // target_programs)
    return max(MIN_SPLIT_PAGES, next_power_of_2(max(wanted, 1)))


def merge_splits(part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                 context_lens: torch.Tensor | None, out: torch.Tensor, split_pages: int = 1, page_size: int = 1) -> None:
    """Merges the partials [batch, heads, splits(, dim)] (fp32) into `out` [batch, heads, dim]: with
    `context_lens`, those of the splits of `split_pages` pages that reach into each context; without, all."""
    batch, num_heads, splits, dim = part_acc.shape
    _merge_splits_kernel[(batch, num_heads)](
        part_acc, part_max, part_sum, part_max if context_lens is None else context_lens, out, split_pages, splits,
        num_heads * splits, splits, out.stride(0), out.stride(1), num_heads, HEAD_DIM=dim,
        BLOCK_D=next_power_of_2(dim), PAGE_SIZE=page_size, BLOCK_S=BLOCK_SPLITS, BY_LENGTH=context_lens is not None)
