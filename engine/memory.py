"""All byte arithmetic of the engine and the planner: one home, so the two cannot disagree.

Torch-free: the planner imports it where no torch is installed. Element sizes come from
`DTYPE_BYTES`, never from a literal at the call site.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 1 << 30


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})") from None


@dataclass(frozen=True)
class KVLayout:
    """What one token costs in the KV cache: K and V, for every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        dtype_bytes(self.dtype)


def kv_bytes_per_token(layout: KVLayout) -> int:
    # K and V  x  layers  x  KV heads  x  head dim  x  bytes per element
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * dtype_bytes(layout.dtype)


def kv_bytes_per_page(layout: KVLayout, page_size: int) -> int:
    if page_size <= 0:
        raise ConfigError(f"page size must be a positive number of tokens, got {page_size!r}")
    return page_size * kv_bytes_per_token(layout)


def kv_pages_for_budget(budget_bytes: int, layout: KVLayout, page_size: int) -> int:
    """The whole pages that fit in a byte budget (a partial page is useless)."""
    if budget_bytes < 0:
        raise ConfigError(f"KV memory budget must not be negative, got {budget_bytes!r} bytes")
    return budget_bytes // kv_bytes_per_page(layout, page_size)


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def weight_bytes(num_parameters: int, dtype: str) -> int:
    return num_parameters * dtype_bytes(dtype)
