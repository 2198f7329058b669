"""Pure-torch oracles of every Triton kernel: the definition each kernel is tested against.

Layouts shared with the kernels:
- pages: [num_pages, page_size, num_kv_heads, head_dim]; block_tables: [batch, max_pages] int32;
  FP8 pages carry one scale per KV head (k_scales, v_scales: [num_kv_heads] float32).
- INT4 weights: packed [N, K // 2] uint8 (even k in the low nibble), scales and minimums [N, K // group],
  w[n, k] = q * scale + minimum.
- FP8 weights: values [N, K] e4m3, scales [N] float32, w[n, k] = value * scale.
- MLA latent pages: [num_pages, page_size, latent_dim + rope_dim], one row per token shared by all heads;
  FP8 pages carry two scales per layer (latent, rope key).
- DSA indexer key pages: [num_pages, page_size, dim], one key per token; FP8 pages carry one scale per token
  ([num_pages, page_size] float32). Selected positions: [batch, k] int, -1 pads.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0


def _dequantize_pages(pages: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    values = pages.float()
    return values if scales is None else values * scales.float()[:, None]


def paged_decode_attention(q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q: [batch, num_heads, head_dim], one query per sequence → [batch, num_heads, head_dim] in q's dtype."""
    batch, num_heads, _ = q.shape
    page_size, num_kv_heads = key_pages.shape[1], key_pages.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(context_lens[b])
        pages = block_tables[b, :(length + page_size - 1) // page_size].long()
        keys = _dequantize_pages(key_pages[pages], k_scales).flatten(0, 1)[:length]       # [L, kv_heads, D]
        values = _dequantize_pages(value_pages[pages], v_scales).flatten(0, 1)[:length]
        keys = keys.repeat_interleave(group, dim=1)                                           # [L, heads, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values).to(q.dtype)
    return out


def _latent_row_scale(scales: torch.Tensor | None, latent_dim: int, width: int) -> torch.Tensor:
    """A latent cache row's two FP8 scales spread over it (latent, rope key); ones for float pages."""
    if scales is None:
        return torch.ones(width)
    return torch.cat([scales[0].float().cpu().expand(latent_dim), scales[1].float().cpu().expand(width - latent_dim)])


def paged_mla_decode(q: torch.Tensor, latent_pages: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, latent_dim: int,
                     scales: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed decode. q: [batch, heads, latent_dim + rope_dim] (W_UKᵀ q_nope | q_rope); latent_pages:
    [num_pages, page_size, latent_dim + rope_dim] rows shared by all heads; FP8 pages carry two scales (latent,
    rope key). → [batch, heads, latent_dim]: the softmax-weighted sum of the latents, in q's dtype."""
    batch, _, width = q.shape
    page_size = latent_pages.shape[1]
    row_scale = _latent_row_scale(scales, latent_dim, width)
    out = torch.empty(batch, q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
    for b in range(batch):
        length = int(context_lens[b])
        pages = block_tables[b, :(length + page_size - 1) // page_size].long()
        rows = latent_pages[pages].float().flatten(0, 1)[:length] * row_scale.to(q.device)      # [L, width]
        scores = q[b].float() @ rows.t() * scale                                              # [heads, L]
        out[b] = (scores.softmax(dim=-1) @ rows[:, :latent_dim]).to(q.dtype)
    return out


def kv_write(keys: torch.Tensor, values: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Stores [T, kv_heads, head_dim] at flat slots; FP8 pages get x / scale, saturated at ±448."""
    for new, pages, scales in ((keys, key_pages, k_scales), (values, value_pages, v_scales)):
        flat = pages.view(-1, *pages.shape[2:])
        if scales is None:
            flat[slot_mapping.long()] = new.to(pages.dtype)
        else:
            scaled = (new.float() / scales.float()[None, :, None]).clamp(-FP8_MAX, FP8_MAX)
            flat[slot_mapping.long()] = scaled.to(pages.dtype)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).float()
    n, k = q.shape
    groups = q.reshape(n, k // group_size, group_size)
    return (groups * scales.float()[..., None] + minimums.float()[..., None]).reshape(n, k)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x [M, K] @ dequantized W [N, K]^T, accumulated in fp32, returned in x's dtype."""
    return (x.float() @ dequantize_int4(packed, scales, minimums, group_size).t()).to(x.dtype)


def w8a16_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (x.float() @ (values.float() * scales.float()[:, None]).t()).to(x.dtype)


def ownership_check(entries: torch.Tensor, owners: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor:
    """entries: [3, n] int64 rows (page, expected owner, expected epoch) → [n] bool, True where an entry fails.

    An entry fails when its page is out of range, owned by someone else, or granted at another epoch.
    """
    pages, expected_owners, expected_epochs = entries
    in_range = (pages >= 0) & (pages < owners.shape[0])
    safe = torch.where(in_range, pages, 0)
    return ~in_range | (owners[safe] != expected_owners) | (epochs[safe] != expected_epochs)


SHARED_OWNER = -2          # a published page's owner in the integrity record; its holders are keys page·2³² + holder
HOLDER_SHIFT = 32
OWNERSHIP_FLAG = 1         # step_integrity_flags' codes: the integrity checker's violation kinds
SHARED_WRITE_FLAG = 3


def step_integrity_flags(tables: torch.Tensor, leases: torch.Tensor, entry_counts: torch.Tensor,
                         seq_ids: torch.Tensor, row_starts: torch.Tensor, row_counts: torch.Tensor,
                         slots: torch.Tensor, owners: torch.Tensor, epochs: torch.Tensor, positions: torch.Tensor,
                         holder_keys: torch.Tensor, sealed: torch.Tensor | None, page_size: int,
                         pad_slot: int | None = None) -> torch.Tensor:
    """A step's check, one flag per item (int32): OWNERSHIP_FLAG where an entry of its table (the first
    `entry_counts` of its row of `tables`, granted at `leases`) is out of range, or neither its own page at that
    lease nor a shared page it holds at that lease and table position; SHARED_WRITE_FLAG (the larger, it wins)
    where one of its rows (`row_counts` from `row_starts` in `slots`) writes into a shared page, or into a sealed one
    (`sealed` given: full mode); 0 otherwise. With `pad_slot`, a flagged item's slots are set to it, in place.
    The record: `owners` (a sequence id, -1 free, SHARED_OWNER), `epochs`, `positions` of shared pages, and the
    sorted `holder_keys` page·2³² + holder."""
    num_pages = owners.shape[0]
    index = torch.arange(tables.shape[1], device=tables.device)
    valid = index[None, :] < entry_counts[:, None]
    in_range = (tables >= 0) & (tables < num_pages)
    safe = torch.where(in_range, tables, 0)
    held = in_range & (epochs[safe] == leases)
    owned = held & (owners[safe] == seq_ids[:, None])
    member = torch.isin((safe << HOLDER_SHIFT) + seq_ids[:, None], holder_keys)
    shared = held & (owners[safe] == SHARED_OWNER) & (positions[safe] == index[None, :]) & member
    bad_entry = (valid & ~(owned | shared)).any(dim=1)
    item_of_row = torch.repeat_interleave(torch.arange(len(row_counts), device=slots.device), row_counts)
    rows = torch.cat([torch.arange(start, start + count, device=slots.device)
                      for start, count in zip(row_starts.tolist(), row_counts.tolist())] or [index[:0]])
    pages = slots[rows] // page_size
    page_in_range = (pages >= 0) & (pages < num_pages)
    safe_pages = torch.where(page_in_range, pages, 0)
    read_only = owners[safe_pages] == SHARED_OWNER
    if sealed is not None:
        read_only |= sealed[safe_pages]
    bad_write = torch.zeros(len(row_counts), dtype=torch.bool, device=slots.device)
    bad_write.index_fill_(0, item_of_row[page_in_range & read_only], True)
    flags = torch.maximum(bad_entry.int() * OWNERSHIP_FLAG, bad_write.int() * SHARED_WRITE_FLAG).to(torch.int32)
    if pad_slot is not None:
        slots[rows[flags[item_of_row] != 0]] = pad_slot
    return flags


def paged_indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, key_pages: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """DSA's lightning indexer for one query row per sequence: Σ_h w_h relu(q_h · k_t · scale) for every cached
    token t. q: [batch, heads, dim]; head_weights: [batch, heads]; key_pages: [num_pages, page_size, dim], one
    key per token; FP8 pages carry one scale per token (key_scales: [num_pages, page_size] float32).
    → [batch, max_pages * page_size] float32, -inf past each context."""
    batch, page_size = q.shape[0], key_pages.shape[1]
    out = torch.full((batch, block_tables.shape[1] * page_size), float("-inf"), device=q.device)
    for b in range(batch):
        length = int(context_lens[b])
        pages = block_tables[b, :(length + page_size - 1) // page_size].long()
        keys = key_pages[pages].float()
        if key_scales is not None:
            keys = keys * key_scales[pages].float()[..., None]
        keys = keys.flatten(0, 1)[:length]                                                       # [L, dim]
        scores = (q[b].float() @ keys.t() * scale).relu()                                         # [heads, L]
        out[b, :length] = head_weights[b].float() @ scores
    return out


def sparse_mla_decode(q: torch.Tensor, latent_pages: torch.Tensor, block_tables: torch.Tensor,
                      positions: torch.Tensor, scale: float, latent_dim: int,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed decode over selected tokens only (DSA): as `paged_mla_decode`, but each sequence attends to
    the positions in its row of `positions` ([batch, k], -1 pads; at least one selected per row), not to its
    whole context. → [batch, heads, latent_dim] in q's dtype."""
    batch, _, width = q.shape
    page_size = latent_pages.shape[1]
    row_scale = _latent_row_scale(scales, latent_dim, width)
    out = torch.empty(batch, q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
    for b in range(batch):
        chosen = positions[b][positions[b] >= 0].long()
        pages = block_tables[b].long()[chosen // page_size]
        rows = latent_pages[pages, chosen % page_size].float() * row_scale.to(q.device)          # [k, width]
        scores = q[b].float() @ rows.t() * scale
        out[b] = (scores.softmax(dim=-1) @ rows[:, :latent_dim]).to(q.dtype)
    return out
