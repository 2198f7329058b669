"""Random kernel inputs shared by the CPU (interpreter) and CUDA tests: ragged block tables, partly
filled last pages, GQA groups that are not powers of two."""
from __future__ import annotations

import random

import torch

from engine.kernels import reference


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def ragged_tables(batch: int, page_size: int, generator: torch.Generator, max_pages: int = 5,
                  spare_columns: int = 0):
    """Context lengths of up to `max_pages` pages (one ending on an exactly full page), block tables of pages
    scattered over the pool (`spare_columns` more than the longest needs, as a graph's tables are), and the pool's
    page count (a few spare)."""
    lengths = torch.randint(1, max_pages * page_size, (batch,), generator=generator)
    lengths[0] = page_size * 2
    pages_per_seq = (lengths + page_size - 1) // page_size
    num_pages = int(pages_per_seq.sum()) + 3
    order = torch.randperm(num_pages, generator=generator)
    tables = torch.zeros(batch, int(pages_per_seq.max()) + spare_columns, dtype=torch.int32)
    cursor = 0
    for b, count in enumerate(pages_per_seq.tolist()):
        tables[b, :count] = order[cursor:cursor + count].to(torch.int32)
        cursor += count
    return lengths, tables, num_pages


def paged_case(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
               page_dtype: torch.dtype, q_dtype: torch.dtype, device: str, seed: int, max_pages: int = 5,
               spare_columns: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths, tables, num_pages = ragged_tables(batch, page_size, generator, max_pages, spare_columns)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    keys = torch.randn(shape, generator=generator)
    values = torch.randn(shape, generator=generator)
    k_scales = v_scales = None
    if page_dtype == torch.float8_e4m3fn:
        k_scales = keys.abs().amax(dim=(0, 1, 3)) / reference.FP8_MAX
        v_scales = values.abs().amax(dim=(0, 1, 3)) / reference.FP8_MAX
        keys = (keys / k_scales[:, None]).to(page_dtype)
        values = (values / v_scales[:, None]).to(page_dtype)
        k_scales, v_scales = k_scales.to(device), v_scales.to(device)
    else:
        keys, values = keys.to(page_dtype), values.to(page_dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=generator).to(q_dtype)
    return dict(q=q.to(device), key_pages=keys.to(device), value_pages=values.to(device),
                block_tables=tables.to(device), context_lens=lengths.to(device), scale=head_dim ** -0.5,
                k_scales=k_scales, v_scales=v_scales)


def mla_case(batch: int, num_heads: int, latent_dim: int, rope_dim: int, page_size: int, page_dtype: torch.dtype,
             q_dtype: torch.dtype, device: str, seed: int, max_pages: int = 5, spare_columns: int = 0):
    """Latent pages scattered over the pool, ragged lengths, a latent and a rope key of different ranges."""
    generator = torch.Generator().manual_seed(seed)
    lengths, tables, num_pages = ragged_tables(batch, page_size, generator, max_pages, spare_columns)
    rows = torch.cat([torch.randn(num_pages, page_size, latent_dim, generator=generator),
                      torch.randn(num_pages, page_size, rope_dim, generator=generator) * 4], dim=-1)
    scales = None
    if page_dtype == torch.float8_e4m3fn:
        scales = torch.stack([rows[..., :latent_dim].abs().amax(), rows[..., latent_dim:].abs().amax()]) / reference.FP8_MAX
        row_scale = torch.cat([scales[0].expand(latent_dim), scales[1].expand(rope_dim)])
        rows = (rows / row_scale).to(page_dtype)
        scales = scales.to(device)
    else:
        rows = rows.to(page_dtype)
    q = (torch.randn(batch, num_heads, latent_dim + rope_dim, generator=generator) * 0.3).to(q_dtype)
    return dict(q=q.to(device), latent_pages=rows.to(device), block_tables=tables.to(device),
                context_lens=lengths.to(device), scale=(latent_dim + rope_dim) ** -0.5, latent_dim=latent_dim,
                scales=scales)


def indexer_case(batch: int, num_heads: int, dim: int, page_size: int, page_dtype: torch.dtype, q_dtype: torch.dtype,
                 device: str, seed: int):
    """DSA indexer keys, one per token over scattered pages; FP8 ones with a scale per token (their ranges
    differ by 10x from token to token); signed head weights."""
    generator = torch.Generator().manual_seed(seed)
    lengths, tables, num_pages = ragged_tables(batch, page_size, generator)
    keys = torch.randn(num_pages, page_size, dim, generator=generator)
    keys *= torch.rand(num_pages, page_size, 1, generator=generator) * 10 + 0.1
    key_scales = None
    if page_dtype == torch.float8_e4m3fn:
        key_scales = keys.abs().amax(dim=-1) / reference.FP8_MAX
        keys = keys / key_scales[..., None]
        key_scales = key_scales.to(device)
    q = (torch.randn(batch, num_heads, dim, generator=generator) * 0.3).to(q_dtype)
    return dict(q=q.to(device), head_weights=torch.randn(batch, num_heads, generator=generator).to(device),
                key_pages=keys.to(page_dtype).to(device), block_tables=tables.to(device),
                context_lens=lengths.to(device), scale=dim ** -0.5, key_scales=key_scales)


def sparse_mla_case(batch: int, num_heads: int, latent_dim: int, rope_dim: int, page_size: int, topk: int,
                    page_dtype: torch.dtype, q_dtype: torch.dtype, device: str, seed: int):
    """`mla_case` with a selection per sequence: min(topk, length) distinct positions in random order, the rest
    of the row -1 (a short sequence selects all it has)."""
    case = mla_case(batch, num_heads, latent_dim, rope_dim, page_size, page_dtype, q_dtype, "cpu", seed)
    generator = torch.Generator().manual_seed(seed + 1)
    positions = torch.full((batch, topk), -1, dtype=torch.int64)
    for b, length in enumerate(case.pop("context_lens").tolist()):
        chosen = torch.randperm(length, generator=generator)[:topk]
        positions[b, :len(chosen)] = chosen
    case["positions"] = positions
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in case.items()}


def int4_case(m: int, n: int, k: int, group_size: int, dtype: torch.dtype, device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(n, k // group_size, generator=generator) * 0.02 + 0.001).to(torch.float16)
    minimums = (-8 * scales.float() + torch.randn(n, k // group_size, generator=generator) * 0.01).to(torch.float16)
    x = torch.randn(m, k, generator=generator).to(dtype)
    return [t.to(device) for t in (x, packed, scales, minimums)] + [group_size]


def fp8_case(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator)
    scales = w.abs().amax(dim=1) / reference.FP8_MAX
    values = (w / scales[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=generator).to(dtype)
    return [x.to(device), values.to(device), scales.to(device)]


def ownership_case(num_entries: int, num_pages: int, device: str, seed: int):
    """A random ownership table and entries of which about a third fail in each way (owner, epoch, range)."""
    generator = torch.Generator().manual_seed(seed)
    owners = torch.randint(-1, 40, (num_pages,), generator=generator)
    epochs = torch.randint(0, 9, (num_pages,), generator=generator)
    pages = torch.randint(0, num_pages, (num_entries,), generator=generator)
    expected_owners, expected_epochs = owners[pages].clone(), epochs[pages].clone()
    fate = torch.randint(0, 6, (num_entries,), generator=generator)
    expected_owners[fate == 1] += 1
    expected_epochs[fate == 2] -= 1
    pages[fate == 3] = num_pages + pages[fate == 3]
    pages[fate == 4] = -1 - pages[fate == 4]
    entries = torch.stack([pages, expected_owners, expected_epochs])
    return {"entries": entries.to(device), "owners": owners.to(device), "epochs": epochs.to(device)}, fate


def step_integrity_case(num_items: int, num_pages: int, width: int, page_size: int, device: str, seed: int,
                        full: bool = False):
    """A random page record (free, owned and shared pages, each shared one with holders and a table position) and a
    step's items: tables of the item's own pages and the shared ones it holds at their position, rows writing into
    its own unsealed pages; every third item (the first included) carries one fault, in turn a foreign page, a stale
    lease, an entry out of range, a shared page at another position or not held, a write into a shared or (`full`)
    sealed page. Returns
    the kernel's arguments and the record's updates and sealed pages, for a `PageRecord` to check the same step."""
    rng = random.Random(seed)
    seq_ids = rng.sample(range(100, 10_000), num_items)
    owners, epochs, positions = [-1] * num_pages, [rng.randrange(4) for _ in range(num_pages)], [-1] * num_pages
    holders: dict[int, set[int]] = {}
    for page in range(num_pages):
        kind = rng.random()
        if page < num_items or kind < 0.5:
            owners[page] = seq_ids[page % num_items]
        elif kind < 0.8:
            owners[page], positions[page] = -2, rng.randrange(width)
            holders[page] = set(rng.sample(seq_ids, rng.randrange(1, num_items + 1)))
    sealed = [full and page >= num_items and rng.random() < 0.3 for page in range(num_pages)]
    tables, leases, counts, slots, row_counts = [], [], [], [], []
    for item, seq_id in enumerate(seq_ids):
        own = [p for p in range(num_pages) if owners[p] == seq_id]
        fault = (item // 3) % 5 if item % 3 == 0 else None
        count = rng.randrange(fault is not None and fault < 4, width + 1)
        table, lease = [], []
        for position in range(count):
            shared = [p for p in holders if seq_id in holders[p] and positions[p] == position]
            table.append(rng.choice(shared) if shared and rng.random() < 0.5 else rng.choice(own))
            lease.append(epochs[table[-1]])
        rows = rng.randrange(1, 4)
        writes = [rng.choice([p for p in own if not sealed[p]]) for _ in range(rows)]
        if fault is not None and fault < 4:
            entry = rng.randrange(count)
            if fault == 0:
                table[entry] = rng.choice([p for p in range(num_pages) if owners[p] not in (seq_id, -2)] or [-1])
            elif fault == 1:
                lease[entry] += 1
            elif fault == 2:
                table[entry] = rng.choice([-1 - rng.randrange(3), num_pages + rng.randrange(3)])
            else:                   # a shared page at the wrong position, or one it does not hold
                others = [p for p in holders if positions[p] != entry or seq_id not in holders[p]]
                if others:
                    table[entry] = rng.choice(others)
                    lease[entry] = epochs[table[entry]]
        elif fault == 4:
            writes[-1] = rng.choice([p for p in range(num_pages) if owners[p] == -2 or sealed[p]] or writes)
        counts.append(count)
        tables.append(table + [rng.randrange(num_pages) for _ in range(width - count)])
        leases.append(lease + [0] * (width - count))
        row_counts.append(rows)
        slots += [page * page_size + rng.randrange(page_size) for page in writes]
    row_starts = [sum(row_counts[:i]) for i in range(num_items)]
    keys = sorted((page << 32) + holder for page, members in holders.items() for holder in members)

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    case = {"tables": tensor(tables).reshape(num_items, width), "leases": tensor(leases).reshape(num_items, width),
            "entry_counts": tensor(counts), "seq_ids": tensor(seq_ids), "row_starts": tensor(row_starts),
            "row_counts": tensor(row_counts), "slots": tensor(slots), "owners": tensor(owners),
            "epochs": tensor(epochs), "positions": tensor(positions), "holder_keys": tensor(keys),
            "sealed": torch.tensor(sealed, device=device) if full else None, "page_size": page_size}
    updates = [(page, owners[page], epochs[page], positions[page], tuple(sorted(holders.get(page, ()))), (), True)
               for page in range(num_pages)]
    return case, updates, [page for page in range(num_pages) if sealed[page]]
