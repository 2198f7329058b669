"""All byte arithmetic of the engine and the planner: one home, so the two cannot disagree.

Torch-free: the planner imports it where no torch is installed. Element sizes come from
`DTYPE_BYTES`, never from a literal at the call site.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FLOAT_DTYPES = ("fp32", "bf16", "fp16")
INT4_GROUP_SIZES = (32, 64, 128)
GIB = 1 << 30
KV_SCALE_DTYPE = "fp32"        # one static scale per (layer, KV head) for K and for V
FP8_WEIGHT_SCALE_DTYPE = "fp32"  # per output channel; fp16 would underflow for rows with small weights
INT4_BITS = 4


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


def cache_bytes_per_token(num_layers: int, elements_per_layer: int, dtype: str, scales_per_layer: int = 0) -> int:
    """Any per-token cache: layers x (elements x element size + per-token fp32 scales, FP8 only).

    GQA caches 2 x KV heads x head dim elements per layer, MLA its latent plus the rope key, a sparse-attention
    indexer its key (in FP8 with one scale per token, as serving engines store it).
    """
    scales = scales_per_layer * dtype_bytes(KV_SCALE_DTYPE) if dtype == "fp8" else 0
    return num_layers * (elements_per_layer * dtype_bytes(dtype) + scales)


def kv_scale_bytes(layout: KVLayout) -> int:
    """FP8 pages share static scales, one per layer, KV head and K/V: a fixed cost, not per token."""
    if layout.dtype != "fp8":
        return 0
    return 2 * layout.num_layers * layout.num_kv_heads * dtype_bytes(KV_SCALE_DTYPE)


def kv_bytes_per_page(layout: KVLayout, page_size: int) -> int:
    if page_size <= 0:
        raise ConfigError(f"page size must be a positive number of tokens, got {page_size!r}")
    return page_size * kv_bytes_per_token(layout)


def kv_pages_for_budget(budget_bytes: int, layout: KVLayout, page_size: int) -> int:
    """The whole pages that fit in a byte budget (a partial page is useless)."""
    if budget_bytes < 0:
        raise ConfigError(f"KV memory budget must not be negative, got {budget_bytes!r} bytes")
    return max(0, budget_bytes - kv_scale_bytes(layout)) // kv_bytes_per_page(layout, page_size)


def kv_cache_bytes(layout: KVLayout, num_pages: int, page_size: int) -> int:
    """What a pool of `num_pages` really occupies: the pages and their scales."""
    return num_pages * kv_bytes_per_page(layout, page_size) + kv_scale_bytes(layout)


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return ceil_div(num_tokens, page_size)


def weight_bytes(num_parameters: int, dtype: str) -> int:
    """Bytes of parameters kept in a plain float dtype (embeddings, norms, unquantized layers)."""
    return num_parameters * dtype_bytes(dtype)


@dataclass(frozen=True)
class WeightFormat:
    """How a linear layer's weight [out_features, in_features] is stored.

    fp8: e4m3 values with one fp32 scale per output channel, or per `block_size` x `block_size` block when
    `block_size` is set (DeepSeek's checkpoints). int4: two values per byte, one scale per group of
    `group_size` inputs, plus one minimum per group when asymmetric (w = q * scale + minimum).
    """

    dtype: str
    group_size: int = 128
    symmetric: bool = False
    scale_dtype: str = "fp16"
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in (*FLOAT_DTYPES, "fp8", "int4"):
            raise ConfigError(f"unknown weight dtype {self.dtype!r} (choose from fp32, bf16, fp16, fp8, int4)")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                              f"got {self.group_size!r}")
        if self.scale_dtype not in ("fp16", "bf16", "fp32"):
            raise ConfigError(f"unknown scale dtype {self.scale_dtype!r}")
        if self.block_size is not None and (self.dtype != "fp8" or self.block_size <= 0):
            raise ConfigError(f"block scales are for fp8 weights, with a positive block size, got {self.block_size!r}")

    def check_shape(self, out_features: int, in_features: int) -> None:
        if self.dtype == "int4" and in_features % self.group_size:
            raise ConfigError(f"group size {self.group_size} does not divide the input dimension {in_features}")

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        self.check_shape(out_features, in_features)
        numel = out_features * in_features
        if self.dtype in FLOAT_DTYPES:
            return numel * dtype_bytes(self.dtype)
        if self.dtype == "fp8":
            scales = out_features if self.block_size is None else (
                ceil_div(out_features, self.block_size) * ceil_div(in_features, self.block_size))
            return numel * dtype_bytes("fp8") + scales * dtype_bytes(FP8_WEIGHT_SCALE_DTYPE)
        groups = numel // self.group_size
        per_group = dtype_bytes(self.scale_dtype) * (1 if self.symmetric else 2)
        return numel * INT4_BITS // 8 + groups * per_group


def model_weight_bytes(linear_shapes: list[tuple[int, int]], num_layers: int, num_other_parameters: int,
                       fmt: WeightFormat, other_dtype: str) -> int:
    """Linear layers in `fmt`; embeddings, norms and the output head in `other_dtype`."""
    per_layer = sum(fmt.linear_bytes(out_features, in_features) for out_features, in_features in linear_shapes)
    return num_layers * per_layer + weight_bytes(num_other_parameters, other_dtype)
