"""Byte arithmetic: exact values, and the direction of change."""
from __future__ import annotations

import pytest

from engine.core.errors import ConfigError
from engine.core.memory import (
    GIB,
    KVLayout,
    kv_bytes_per_page,
    kv_bytes_per_token,
    kv_pages_for_budget,
    pages_for_tokens,
    weight_bytes,
)

SMOLLM = dict(num_layers=30, num_kv_heads=3, head_dim=64)


def test_exact_kv_bytes():
    assert kv_bytes_per_token(KVLayout(**SMOLLM, dtype="fp32")) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(KVLayout(**SMOLLM, dtype="bf16")) == 23040
    assert kv_bytes_per_page(KVLayout(**SMOLLM, dtype="fp32"), 16) == 737280
    assert kv_pages_for_budget(GIB, KVLayout(**SMOLLM, dtype="fp32"), 16) == GIB // 737280 == 1456
    assert pages_for_tokens(0, 16) == 0 and pages_for_tokens(16, 16) == 1 and pages_for_tokens(17, 16) == 2
    assert weight_bytes(1000, "bf16") == 2000


def test_direction():
    fp32, bf16 = KVLayout(**SMOLLM, dtype="fp32"), KVLayout(**SMOLLM, dtype="bf16")
    assert kv_bytes_per_token(bf16) * 2 == kv_bytes_per_token(fp32)
    budgets = [0, 10 ** 6, 10 ** 8, GIB, 4 * GIB]
    pages = [kv_pages_for_budget(b, bf16, 16) for b in budgets]
    assert pages == sorted(pages)
    assert kv_pages_for_budget(GIB, bf16, 16) >= 2 * kv_pages_for_budget(GIB, fp32, 16)


@pytest.mark.parametrize("bad", [dict(dtype="int3"), dict(num_layers=0), dict(head_dim=-1)])
def test_bad_layouts_are_rejected(bad):
    with pytest.raises(ConfigError):
        KVLayout(**{**SMOLLM, "dtype": "fp32", **bad})


def test_bad_budgets_are_rejected():
    with pytest.raises(ConfigError, match="page size"):
        kv_bytes_per_page(KVLayout(**SMOLLM, dtype="fp32"), 0)
    with pytest.raises(ConfigError, match="negative"):
        kv_pages_for_budget(-1, KVLayout(**SMOLLM, dtype="fp32"), 16)


def test_cache_allocates_exactly_what_the_memory_model_says(engine):
    assert engine.core.kv_cache.nbytes == engine.core.kv_cache.expected_nbytes
    assert engine.core.kv_cache.num_pages == kv_pages_for_budget(GIB, engine.kv_layout, 16)


def test_parameter_count_matches_the_checkpoint(engine, smollm_path):
    from engine.model.loader import _read_gguf

    reader, _ = _read_gguf(smollm_path)
    assert engine.model_config.total_parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert engine.model_config.total_parameters == sum(p.numel() for p in engine.core.model.parameters())


def test_tiling_copies_the_written_pages_over_the_whole_pool_in_order():
    """The profiler's seeded decodes read real K/V: pages 3 and 5, written, repeat over all 11 pages, also where
    a tile is smaller than the pool (a 3-page budget) and the last tile is cut short."""
    import torch

    from engine.model.kv_cache import PagedKVCache

    for max_tile_bytes in (1 << 30, 3 * 2 * 2 * 8 * 4 * 4):
        cache = PagedKVCache(KVLayout(2, "fp32", num_kv_heads=2, head_dim=8), 11, 4, "cpu")
        for pool in cache.pools:
            pool[:, 3] = 1.0
            pool[:, 5] = 2.0
        cache.tile([3, 5], max_tile_bytes)
        for pool in cache.pools:
            assert [float(pool[0, page].mean()) for page in range(11)] == [1.0, 2.0] * 5 + [1.0]
            assert torch.equal(pool[1], pool[0])
