"""The step's integrity check in one Triton kernel, on the device, in the step's stream: one program per request
reads every entry of its block table and every slot it writes, against the device record of page owners, and
writes one flag; a flagged request's slots are sent to the padding slot before the forward pass runs, so its
writes land nowhere that matters and nobody else's pages are touched. The host reads the flags with the
step's sampled tokens, in the same copy."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor
from engine.kernels.reference import HOLDER_SHIFT, OWNERSHIP_FLAG, SHARED_OWNER, SHARED_WRITE_FLAG

BLOCK = 128


@triton.jit
def _step_integrity_kernel(tables_ptr, leases_ptr, entry_counts_ptr, seq_ids_ptr, row_starts_ptr, row_counts_ptr,
                           slots_ptr, owners_ptr, epochs_ptr, positions_ptr, holder_keys_ptr, sealed_ptr, flags_ptr,
                           stride_table, num_pages, num_keys, search_steps, pad_slot,
                           PAGE_SIZE: tl.constexpr, SHARED: tl.constexpr, SHIFT: tl.constexpr, FULL: tl.constexpr,
                           REDIRECT: tl.constexpr, OWNERSHIP: tl.constexpr, SHARED_WRITE: tl.constexpr,
                           BLOCK: tl.constexpr):
    item = tl.program_id(0)
    seq_id = tl.load(seq_ids_ptr + item)
    count = tl.load(entry_counts_ptr + item)
    bad_entry = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, count, BLOCK):
        index = start + tl.arange(0, BLOCK)
        valid = index < count
        page = tl.load(tables_ptr + item * stride_table + index, mask=valid, other=0)
        lease = tl.load(leases_ptr + item * stride_table + index, mask=valid, other=0)
        in_range = (page >= 0) & (page < num_pages)
        safe = tl.where(in_range, page, 0)
        owner = tl.load(owners_ptr + safe, mask=valid, other=-1)
        epoch = tl.load(epochs_ptr + safe, mask=valid, other=-1)
        position = tl.load(positions_ptr + safe, mask=valid, other=-1)
        key = (safe << SHIFT) + seq_id
        low = tl.zeros([BLOCK], dtype=tl.int64)
        high = tl.zeros([BLOCK], dtype=tl.int64) + num_keys
        for _ in range(search_steps):           # lower bound: the first holder key >= key, in the sorted keys
            active = low < high
            middle = (low + high) // 2
            below = tl.load(holder_keys_ptr + middle, mask=active, other=0) < key
            low = tl.where(active & below, middle + 1, low)
            high = tl.where(active & ~below, middle, high)
        found = tl.load(holder_keys_ptr + low, mask=valid & (low < num_keys), other=-1) == key
        owned = in_range & (owner == seq_id) & (epoch == lease)
        shared = in_range & (owner == SHARED) & (epoch == lease) & (position == index) & found
        bad_entry = tl.maximum(bad_entry, (valid & ~(owned | shared)).to(tl.int32))
    row_start = tl.load(row_starts_ptr + item)
    rows = tl.load(row_counts_ptr + item)
    bad_write = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, rows, BLOCK):
        index = start + tl.arange(0, BLOCK)
        valid = index < rows
        slot = tl.load(slots_ptr + row_start + index, mask=valid, other=0)
        page = slot // PAGE_SIZE
        in_range = (page >= 0) & (page < num_pages)
        safe = tl.where(in_range, page, 0)
        read_only = tl.load(owners_ptr + safe, mask=valid, other=0) == SHARED
        if FULL:
            read_only = read_only | (tl.load(sealed_ptr + safe, mask=valid, other=0) != 0)
        bad_write = tl.maximum(bad_write, (valid & in_range & read_only).to(tl.int32))
    flag = tl.maximum(tl.max(bad_entry, axis=0) * OWNERSHIP, tl.max(bad_write, axis=0) * SHARED_WRITE)
    tl.store(flags_ptr + item, flag)
    if REDIRECT:
        if flag != 0:
            for start in range(0, rows, BLOCK):
                index = start + tl.arange(0, BLOCK)
                tl.store(slots_ptr + row_start + index, tl.zeros([BLOCK], dtype=tl.int64) + pad_slot,
                         mask=index < rows)


def step_integrity_flags(tables: torch.Tensor, leases: torch.Tensor, entry_counts: torch.Tensor,
                         seq_ids: torch.Tensor, row_starts: torch.Tensor, row_counts: torch.Tensor,
                         slots: torch.Tensor, owners: torch.Tensor, epochs: torch.Tensor, positions: torch.Tensor,
                         holder_keys: torch.Tensor, sealed: torch.Tensor | None, page_size: int,
                         pad_slot: int | None = None) -> torch.Tensor:
    """Same contract as `engine.kernels.reference.step_integrity_flags`."""
    device = tables.device
    for name, tensor, dims in (("tables", tables, 2), ("leases", leases, 2), ("entry_counts", entry_counts, 1),
                               ("seq_ids", seq_ids, 1), ("row_starts", row_starts, 1), ("row_counts", row_counts, 1),
                               ("slots", slots, 1), ("owners", owners, 1), ("epochs", epochs, 1),
                               ("positions", positions, 1), ("holder_keys", holder_keys, 1)):
        check_tensor(name, tensor, dims, (torch.int64,), device)
    items = tables.shape[0]
    check(leases.shape == tables.shape, f"leases {tuple(leases.shape)} and tables {tuple(tables.shape)} differ")
    check(tables.stride(1) == 1 and leases.stride() == tables.stride(), "tables and leases must be row-major alike")
    for name, tensor in (("entry_counts", entry_counts), ("seq_ids", seq_ids), ("row_starts", row_starts),
                         ("row_counts", row_counts)):
        check(tensor.shape[0] == items, f"{name} has {tensor.shape[0]} entries for {items} items")
    check(owners.shape == epochs.shape == positions.shape, "owners, epochs and positions must cover the same pages")
    if sealed is not None:
        check_tensor("sealed", sealed, 1, (torch.bool,), device)
        check(sealed.shape == owners.shape, f"sealed {tuple(sealed.shape)} and owners {tuple(owners.shape)} differ")
    check(slots.is_contiguous() and holder_keys.is_contiguous(), "slots and holder keys must be contiguous")
    flags = torch.empty(items, dtype=torch.int32, device=device)
    if items == 0:
        return flags
    num_keys = holder_keys.shape[0]
    _step_integrity_kernel[(items,)](
        tables, leases, entry_counts, seq_ids, row_starts, row_counts, slots, owners, epochs, positions,
        holder_keys if num_keys else owners, sealed if sealed is not None else owners, flags,
        tables.stride(0), owners.shape[0], num_keys, max(1, num_keys.bit_length()),
        -1 if pad_slot is None else pad_slot,
        PAGE_SIZE=page_size, SHARED=SHARED_OWNER, SHIFT=HOLDER_SHIFT, FULL=sealed is not None,
        REDIRECT=pad_slot is not None, OWNERSHIP=OWNERSHIP_FLAG, SHARED_WRITE=SHARED_WRITE_FLAG, BLOCK=BLOCK)
    return flags
