"""All byte arithmetic of the engine and the planner: one home, so the two cannot disagree.

Torch-free: the planner imports it where no torch is installed. Element sizes come from
`DTYPE_BYTES`, never from a literal at the call site.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.core.errors import ConfigError
from engine.core.spec import DECODER_COMPONENTS

if TYPE_CHECKING:
    from engine.core.spec import Linear, ModelSpec

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FLOAT_DTYPES = ("fp32", "bf16", "fp16")
INT4_GROUP_SIZES = (32, 64, 128)
GIB = 1 << 30
KV_SCALE_DTYPE = "fp32"        # static FP8 KV scales: per layer, KV head and K/V (GQA); latent and rope key (MLA)
FP8_WEIGHT_SCALE_DTYPE = "fp32"  # per output channel; fp16 would underflow for rows with small weights
INT4_BITS = 4
# NVFP4 (Blackwell): 4-bit E2M1 values, an E4M3 scale per block of 16 values, an fp32 scale per tensor
NVFP4 = "nvfp4"
NVFP4_BLOCK = 16
NVFP4_TENSOR_SCALE_DTYPE = "fp32"
CACHE_DTYPES = (*DTYPE_BYTES, NVFP4)       # what a KV cache may be stored in (the planner's; the engine runs fewer)


def packed_bytes(elements: int, dtype: str) -> int:
    """Bytes of `elements` values stored in `dtype`: whole bytes each, or NVFP4's half byte each plus its FP8
    block scale per 16 (a partial block still has one)."""
    if dtype == NVFP4:
        return ceil_div(elements, 2) + ceil_div(elements, NVFP4_BLOCK) * dtype_bytes("fp8")
    return elements * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})") from None


@dataclass(frozen=True)
class KVLayout:
    """What one token costs in the paged cache of each layer.

    GQA caches K and V of each KV head (`num_kv_heads` x `head_dim` each); MLA one latent (`latent_dim`, the
    kv_lora_rank) and the rope key it shares across heads (`rope_dim`). FP8 pages carry static fp32 scales per
    layer: one per KV head for K and for V, or one for the latent and one for the rope key (they differ in
    range: the latent is RMS-normalized, the rope key is not).

    A DSA model also caches, in each of its `indexer_layers` (those that run their own indexer), the token's
    indexer key (`indexer_dim`) under the same pages: in the KV dtype, and in FP8 with one fp32 scale per token
    (a LayerNorm'd key needs no calibration then, and it is the layout DeepSeek's sparse kernels read).
    """

    num_layers: int
    dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    rope_dim: int = 0
    indexer_layers: int = 0
    indexer_dim: int = 0

    def __post_init__(self) -> None:
        names = ("num_layers", "latent_dim", "rope_dim") if self.latent_dim else ("num_layers", "num_kv_heads", "head_dim")
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.latent_dim and (self.num_kv_heads or self.head_dim):
            raise ConfigError("a KV layout is either GQA (heads, head dim) or MLA (latent, rope dims), not both")
        if self.dtype not in CACHE_DTYPES:
            raise ConfigError(f"unknown KV dtype {self.dtype!r} (known: {', '.join(CACHE_DTYPES)})")
        if self.indexer_layers < 0 or (self.indexer_layers > 0) != (self.indexer_dim > 0):
            raise ConfigError(f"an indexer cache needs both its layers and its key dim, got {self.indexer_layers!r} "
                              f"and {self.indexer_dim!r}")

    @property
    def kind(self) -> str:
        return "mla" if self.latent_dim else "gqa"

    @property
    def elements_per_layer(self) -> int:
        if self.kind == "mla":
            return self.latent_dim + self.rope_dim
        return 2 * self.num_kv_heads * self.head_dim            # K and V x KV heads x head dim

    @property
    def scales_per_layer(self) -> int:
        return 2 if self.kind == "mla" else 2 * self.num_kv_heads


def kv_layout(spec: ModelSpec, dtype: str, attention_tp: int = 1) -> KVLayout:
    """The model's cache on one device of a tensor-parallel group of `attention_tp`: GQA heads split over at
    most their number (each device holds at least one), the MLA latent replicated (it has no heads)."""
    attention = spec.attention
    if attention.kind == "mla":
        return KVLayout(spec.num_layers, dtype, latent_dim=attention.kv_lora_rank, rope_dim=attention.qk_rope_head_dim,
                        indexer_layers=attention.indexer_layers, indexer_dim=attention.indexer_head_dim)
    return KVLayout(spec.num_layers, dtype, num_kv_heads=ceil_div(attention.num_kv_heads, attention_tp),
                    head_dim=attention.head_dim)


def with_draft_layers(layout: KVLayout, draft_layers: int) -> KVLayout:
    """The cache of a model whose MTP draft module runs too: its layers cache like the main ones, after them."""
    return replace(layout, num_layers=layout.num_layers + draft_layers) if draft_layers else layout


def kv_bytes_per_token(layout: KVLayout) -> int:
    # layers  x  elements per layer in the cache's dtype, and the indexer's keys
    return layout.num_layers * packed_bytes(layout.elements_per_layer, layout.dtype) + indexer_bytes_per_token(layout)


def indexer_bytes_per_token(layout: KVLayout) -> int:
    """A DSA model's indexer keys of one token (0 without an indexer): what its indexer scans per cached token."""
    return cache_bytes_per_token(layout.indexer_layers, layout.indexer_dim, layout.dtype, scales_per_layer=1)


def cache_bytes_per_token(num_layers: int, elements_per_layer: int, dtype: str, scales_per_layer: int = 0) -> int:
    """Any per-token cache: layers x (its elements in `dtype` + per-token fp32 scales, FP8 only).

    GQA caches 2 x KV heads x head dim elements per layer, MLA its latent plus the rope key, a sparse-attention
    indexer its key (in FP8 with one scale per token, as serving engines store it; NVFP4 carries its block
    scales instead).
    """
    scales = scales_per_layer * dtype_bytes(KV_SCALE_DTYPE) if dtype == "fp8" else 0
    return num_layers * (packed_bytes(elements_per_layer, dtype) + scales)


def kv_scale_bytes(layout: KVLayout) -> int:
    """FP8 pages share static scales (per layer: per KV head and K/V, or latent and rope key), NVFP4 ones their
    tensor scales, as many: a fixed cost, not per token."""
    if layout.dtype not in ("fp8", NVFP4):
        return 0
    return layout.num_layers * layout.scales_per_layer * dtype_bytes(KV_SCALE_DTYPE)


def kv_bytes_per_page(layout: KVLayout, page_size: int) -> int:
    if page_size <= 0:
        raise ConfigError(f"page size must be a positive number of tokens, got {page_size!r}")
    return page_size * kv_bytes_per_token(layout)


def handoff_bytes(layout: KVLayout, num_tokens: int, page_size: int) -> int:
    """What a disaggregated prefill sends its decode replica for a prompt of `num_tokens`: every page the prompt
    touched, whole (the last one partly filled), in every layer and pool. The scales stay behind: they are the
    same static ones on both sides (checked on arrival)."""
    return pages_for_tokens(num_tokens, page_size) * kv_bytes_per_page(layout, page_size)


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


def pages_filled(table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """The pages of `table` that writing positions start..end-1 completes (integrity's `full` mode seals them)."""
    return table[start // page_size:end // page_size]


def pages_written(table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """The pages of `table` that positions start..end-1 are written into (none of them may be shared)."""
    return table[start // page_size:(end - 1) // page_size + 1]


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
    `group_size` inputs, plus one minimum per group when asymmetric (w = q * scale + minimum). nvfp4: two E2M1
    values per byte, an E4M3 scale per 16 inputs and one fp32 scale for the matrix.
    """

    dtype: str
    group_size: int = 128
    symmetric: bool = False
    scale_dtype: str = "fp16"
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in (*FLOAT_DTYPES, "fp8", "int4", NVFP4):
            raise ConfigError(f"unknown weight dtype {self.dtype!r} (choose from fp32, bf16, fp16, fp8, int4, nvfp4)")
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
        if self.dtype == NVFP4 and in_features % NVFP4_BLOCK:
            raise ConfigError(f"NVFP4's blocks of {NVFP4_BLOCK} do not divide the input dimension {in_features}")

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        self.check_shape(out_features, in_features)
        numel = out_features * in_features
        if self.dtype in FLOAT_DTYPES:
            return numel * dtype_bytes(self.dtype)
        if self.dtype == NVFP4:
            return packed_bytes(numel, NVFP4) + dtype_bytes(NVFP4_TENSOR_SCALE_DTYPE)
        if self.dtype == "fp8":
            scales = out_features if self.block_size is None else (
                ceil_div(out_features, self.block_size) * ceil_div(in_features, self.block_size))
            return numel * dtype_bytes("fp8") + scales * dtype_bytes(FP8_WEIGHT_SCALE_DTYPE)
        groups = numel // self.group_size
        per_group = dtype_bytes(self.scale_dtype) * (1 if self.symmetric else 2)
        return numel * INT4_BITS // 8 + groups * per_group


# Families whose checkpoints ship FP8 with one scale per 128 x 128 block: `fp8` means that layout for them
BLOCK_FP8_FAMILIES = ("deepseek_v3", "glm_moe_dsa")
FP8_BLOCK = 128
# What a checkpoint ships in when its config does not say (by its outer `model_type`); the rest stays float.
NATIVE_SCHEMES: dict[str, dict[str, WeightFormat]] = {
    # Kimi K2 and K2.6: routed experts in INT4, groups of 32, symmetric, bf16 scales (quantization-aware trained)
    **{kimi: {"routed_experts": WeightFormat("int4", 32, symmetric=True, scale_dtype="bf16")}
       for kimi in ("kimi_k25", "kimi_k2")},
    # DeepSeek-V3: every decoder linear in FP8 e4m3, one fp32 scale per 128 x 128 block
    "deepseek_v3": {name: WeightFormat("fp8", block_size=FP8_BLOCK) for name in DECODER_COMPONENTS},
}


def native_scheme(config: dict[str, Any]) -> dict[str, WeightFormat]:
    """The decoder components a checkpoint ships quantized, and how: its `quantization_config` where it has
    one (block FP8 is read), else what its family is known to ship; {} means all float."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    quant = config.get("quantization_config") or text.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        block = (quant.get("weight_block_size") or [None])[0]
        return {name: WeightFormat("fp8", block_size=block) for name in DECODER_COMPONENTS}
    return dict(NATIVE_SCHEMES.get(str(config.get("model_type", "")), {}))


def weight_scheme(spec: ModelSpec, weights: str, group_size: int = 128, symmetric: bool = False,
                  scale_dtype: str = "bf16") -> dict[str, WeightFormat]:
    """The format of each decoder component's linears under a weights choice ({}: all float). `native` is
    what the checkpoint ships; `fp8` is per output channel, or per 128 x 128 block for the families that ship
    it so; `int4` is group-wise; `nvfp4` in blocks of 16."""
    if weights == "native":
        return native_scheme(spec.config)
    if weights == "fp8":
        fmt = WeightFormat("fp8", block_size=FP8_BLOCK if spec.family in BLOCK_FP8_FAMILIES else None)
    elif weights == "int4":
        fmt = WeightFormat("int4", group_size, symmetric, scale_dtype)
    elif weights == NVFP4:
        fmt = WeightFormat(NVFP4)
    else:
        return {}
    return dict.fromkeys(DECODER_COMPONENTS, fmt)


def unsplit(component: str, linear: Linear | None) -> tuple[int, bool]:
    return 1, False


def component_weight_bytes(spec: ModelSpec, scheme: dict[str, WeightFormat], float_dtype: str,
                           split: Callable[[str, Linear | None], tuple[int, bool]] = unsplit) -> dict[str, int]:
    """Weight bytes by component: each decoder linear in its component's format (float where the scheme has
    none), everything else in `float_dtype`. `split(component, linear)` says over how many devices a linear
    (None: the component's other parameters) is divided, and whether whole matrices are dealt out (experts
    over expert-parallel ranks) rather than each matrix cut: then the bytes are one device's share."""
    float_format = WeightFormat(float_dtype)
    result = {}
    for name, part in spec.components().items():
        fmt = scheme.get(name, float_format) if name in DECODER_COMPONENTS else float_format
        total = 0
        for linear in part.linears:
            per_matrix = fmt.linear_bytes(linear.out_features, linear.in_features)
            shards, whole_matrices = split(name, linear)
            total += (ceil_div(linear.count, shards) * per_matrix if whole_matrices
                      else linear.count * ceil_div(per_matrix, shards))
        total += ceil_div(weight_bytes(part.other_parameters, float_dtype), split(name, None)[0])
        result[name] = total
    return result


def check_scheme_fits(spec: ModelSpec, scheme: dict[str, WeightFormat]) -> None:
    """ConfigError where a component's format cannot hold one of its linears (an INT4 group size that does not
    divide its input dimension): the loader asks before it reads a weight, not after seconds of reading them."""
    parts = spec.components()
    for name, fmt in scheme.items():
        for linear in parts[name].linears if name in parts else ():
            fmt.check_shape(linear.out_features, linear.in_features)


def decoder_linear_bytes(spec: ModelSpec, scheme: dict[str, WeightFormat], float_dtype: str) -> int:
    """The decoder layers' matmul weights alone (no norms, routers, embeddings or head), each component's
    in its format: what quantization changes."""
    parts = spec.components()
    return sum(scheme.get(name, WeightFormat(float_dtype)).linear_bytes(linear.out_features, linear.in_features)
               * linear.count for name in DECODER_COMPONENTS for linear in parts[name].linears)


@dataclass(frozen=True)
class TensorParallelTraffic:
    """What one step's collectives carry under tensor parallelism: an all-reduce of the vocab-parallel
    embeddings, one after attention and one after the feed-forward of every layer (each a new token's hidden
    state), and an all-gather of each sampled row's logits (one rank's vocabulary share)."""

    calls_per_step: int
    allreduce_bytes_per_token: int
    gather_bytes_per_sequence: int


def tensor_parallel_traffic(num_layers: int, hidden_size: int, vocab_size: int, ranks: int, activation_bytes: int,
                            attention_parallel: bool = True) -> TensorParallelTraffic:
    """The engine's collectives (its profiles record them) and the planner's. With data-parallel attention the
    layers' attention all-reduce goes; the feed-forward's stays."""
    if ranks == 1:
        return TensorParallelTraffic(0, 0, 0)
    all_reduces = 1 + (2 if attention_parallel else 1) * num_layers
    return TensorParallelTraffic(all_reduces + 1, all_reduces * hidden_size * activation_bytes,
                                 ceil_div(vocab_size, ranks) * activation_bytes)
