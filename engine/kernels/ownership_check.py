"""Ownership check in Triton: every page of a step's block tables against the device ownership table."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor

BLOCK = 256


@triton.jit
def _ownership_check_kernel(entries_ptr, owners_ptr, epochs_ptr, bad_ptr, n, num_pages, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n
    page = tl.load(entries_ptr + offsets, mask=valid, other=0)
    expected_owner = tl.load(entries_ptr + n + offsets, mask=valid, other=0)
    expected_epoch = tl.load(entries_ptr + 2 * n + offsets, mask=valid, other=0)
    in_range = (page >= 0) & (page < num_pages)
    safe = tl.where(in_range, page, 0)
    owner = tl.load(owners_ptr + safe, mask=valid, other=-1)
    epoch = tl.load(epochs_ptr + safe, mask=valid, other=-1)
    bad = (page < 0) | (page >= num_pages) | (owner != expected_owner) | (epoch != expected_epoch)
    tl.store(bad_ptr + offsets, bad.to(tl.int8), mask=valid)


def ownership_check(entries: torch.Tensor, owners: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.ownership_check`."""
    device = entries.device
    check_tensor("entries", entries, 2, (torch.int64,), device)
    check_tensor("owners", owners, 1, (torch.int64,), device)
    check_tensor("epochs", epochs, 1, (torch.int64,), device)
    check(entries.shape[0] == 3, f"entries must have 3 rows (page, owner, epoch), got {entries.shape[0]}")
    check(owners.shape == epochs.shape, f"owners {tuple(owners.shape)} and epochs {tuple(epochs.shape)} differ")
    entries = entries.contiguous()
    n = entries.shape[1]
    bad = torch.empty(n, dtype=torch.int8, device=device)
    if n:
        _ownership_check_kernel[(triton.cdiv(n, BLOCK),)](entries, owners, epochs, bad, n, owners.shape[0],
                                                          BLOCK=BLOCK)
    return bad.bool()
