"""The one description of a model's architecture, parsed once from a Hugging Face `config.json`.

The engine builds its modules from it and the planner plans with it, so the two count the same
parameters and cache the same elements. Torch-free: the planner imports it where no torch is installed.

Families: `llama`, `qwen2`, `qwen3` (dense, grouped-query attention); `qwen3_moe`, `mixtral`, `llama4`
(mixture of experts); `deepseek_v3` (also inside Kimi's multimodal wrapper, `kimi_k25`), `glm4_moe` and
`glm_moe_dsa` (multi-head latent attention or GQA with MoE; `glm_moe_dsa` adds a sparse-attention
indexer). A nested `text_config` is read in place of the top level.

Components (parameters):
    attention        projections (and the MLA low-rank factors, the DSA indexer), per-head norms
    dense_ffn        SwiGLU of the dense layers
    routed_experts   all routed experts; a token uses `experts_per_token` of them per MoE layer
    shared_experts   experts every token uses, and the routers
    embeddings       input embeddings (the output head too when tied)
    head             the output head when untied
    norms            the layer and final RMSNorms
    mtp              multi-token-prediction layers: stored with the checkpoint, used only for
                     speculative decoding, so outside `total` (the published totals leave them out)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.core.errors import ConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama4", "deepseek_v3", "glm4_moe", "glm_moe_dsa")
WRAPPERS = {"kimi_k25": "deepseek_v3", "kimi_k2": "deepseek_v3", "llama4_text": "llama4"}
DECODER_COMPONENTS = ("attention", "dense_ffn", "routed_experts", "shared_experts")   # the quantizable linears
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency and an optional long-context rescaling of the frequencies
    (linear, Llama 3's smooth band, or YaRN with its attention temperature `mscale`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleaved: bool = False       # rotate (x0, x1), (x2, x3)... pairs, not the two halves (DeepSeek)

    def __post_init__(self) -> None:
        _require(self.theta > 0, f"rope theta must be positive, got {self.theta!r}")
        _require(self.rope_type in ROPE_TYPES,
                 f"unsupported rope scaling type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        _require(self.factor >= 1.0, f"rope scaling factor must be >= 1, got {self.factor!r}")

    @classmethod
    def from_hf(cls, config: dict[str, Any], interleaved_by_default: bool = False) -> RopeConfig:
        """Reads both the classic (`rope_theta` + `rope_scaling`) and the newer `rope_parameters` form."""
        merged = {**dict(config.get("rope_scaling") or {}), **dict(config.get("rope_parameters") or {})}
        theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
        return cls(
            theta=float(theta),
            rope_type=merged.get("rope_type", merged.get("type", "default")),
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
            beta_fast=float(merged.get("beta_fast", 32.0)),
            beta_slow=float(merged.get("beta_slow", 1.0)),
            mscale=float(merged.get("mscale") or 1.0),
            mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
            interleaved=bool(config.get("rope_interleave", interleaved_by_default)),
        )


@dataclass(frozen=True)
class Linear:
    """`count` weight matrices [out_features, in_features]; `shard` says how tensor parallelism splits them:
    "tp" (rows or columns over the TP group), "kv_heads" (over at most the KV heads), "replicated"."""

    out_features: int
    in_features: int
    count: int
    shard: str

    @property
    def parameters(self) -> int:
        return self.out_features * self.in_features * self.count


@dataclass(frozen=True)
class Component:
    linears: tuple[Linear, ...]
    other_parameters: int = 0       # embeddings, norms, biases, routers: kept in the float dtype

    @property
    def parameters(self) -> int:
        return sum(linear.parameters for linear in self.linears) + self.other_parameters

    @property
    def linear_parameters(self) -> int:
        return sum(linear.parameters for linear in self.linears)


@dataclass(frozen=True)
class Attention:
    """GQA: `num_kv_heads` K and V heads of `head_dim`. MLA: one latent of `kv_lora_rank` plus a shared
    rope key of `qk_rope_head_dim` per token and layer, whatever the number of heads."""

    kind: str                       # "gqa" | "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int                   # GQA; for MLA the query/key head dim (nope + rope)
    v_head_dim: int
    q_lora_rank: int = 0            # MLA: 0 when queries are not compressed
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    indexer_layers: int = 0         # DSA: layers that hold an indexer (its keys are cached per token)
    indexer_heads: int = 0
    indexer_head_dim: int = 0
    # DSA, per layer: "full" runs its own indexer, "shared" reuses the previous full layer's selection
    indexer_types: tuple[str, ...] = ()
    index_topk: int = 0             # DSA: the cached tokens each query attends to once the context is longer

    def __post_init__(self) -> None:
        _require(self.kind in ("gqa", "mla"), f"unknown attention kind {self.kind!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.kind == "mla":
            _require(self.kv_lora_rank > 0 and self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
                     f"MLA needs a positive kv_lora_rank and an even qk_rope_head_dim, got "
                     f"{self.kv_lora_rank!r} and {self.qk_rope_head_dim!r}")
        if self.indexer_types:
            _require(self.kind == "mla" and self.index_topk > 0 and self.indexer_heads > 0
                     and self.qk_rope_head_dim < self.indexer_head_dim,
                     f"a DSA indexer needs MLA, a positive index_topk and index_n_heads, and an index_head_dim above "
                     f"qk_rope_head_dim; got index_topk {self.index_topk!r}, index_n_heads {self.indexer_heads!r}, "
                     f"index_head_dim {self.indexer_head_dim!r}")

    @property
    def indexer_slots(self) -> tuple[int | None, ...]:
        """Per layer, the row of the indexer-key cache its own indexer writes (None: a layer that shares)."""
        full = [layer for layer, kind in enumerate(self.indexer_types) if kind == "full"]
        return tuple(full.index(layer) if layer in full else None for layer in range(len(self.indexer_types)))

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.kind == "mla" else self.head_dim

    def layer_linears(self, hidden: int) -> list[Linear]:
        if self.kind == "gqa":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return [Linear(q, hidden, 1, "tp"), Linear(kv, hidden, 2, "kv_heads"), Linear(hidden, q, 1, "tp")]
        qk = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        queries = ([Linear(self.q_lora_rank, hidden, 1, "replicated"), Linear(qk, self.q_lora_rank, 1, "tp")]
                   if self.q_lora_rank else [Linear(qk, hidden, 1, "tp")])
        return queries + [
            Linear(self.kv_lora_rank + self.qk_rope_head_dim, hidden, 1, "replicated"),       # the latent
            Linear(self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank, 1, "tp"),
            Linear(hidden, self.num_heads * self.v_head_dim, 1, "tp"),
        ]

    def layer_other_parameters(self) -> int:
        """Biases and norms of one layer's attention."""
        if self.kind == "gqa":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return ((q + 2 * kv) if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return self.q_lora_rank + self.kv_lora_rank

    def indexer_linears(self, hidden: int) -> list[Linear]:
        """One DSA indexer: query up-projection from the query latent, key projection, per-head weights."""
        q_in = self.q_lora_rank or hidden
        return [Linear(self.indexer_heads * self.indexer_head_dim, q_in, 1, "replicated"),
                Linear(self.indexer_head_dim, hidden, 1, "replicated"),
                Linear(self.indexer_heads, hidden, 1, "replicated")]

    def flops_per_pair(self) -> float:
        """Per (query, cached token) pair of a decode in one layer: QK over the key dim, PV over the value dim.
        MLA decodes in the latent space (absorbed): both products run over the latent."""
        if self.kind == "mla":
            return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 2.0 * self.num_heads * (self.head_dim + self.v_head_dim)

    def prefill_flops_per_pair(self) -> float:
        """Per (query, cached token) pair of a prefill in one layer: MLA prefills in the expanded form, per-head
        keys of nope + rope dims and values of v dims."""
        if self.kind == "mla":
            return 2.0 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return self.flops_per_pair()

    def expansion_flops_per_token(self) -> float:
        """MLA's prefill up-projects every latent of a chunk's context to per-head K and V (kv_b_proj) in each
        layer, not only the new tokens' (whose share is in the linear FLOPs): these FLOPs per context token."""
        if self.kind == "mla":
            return 2.0 * self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return 0.0


@dataclass(frozen=True)
class Routing:
    """How a MoE layer picks a token's experts (DeepSeek-V3's scheme and its simpler cases): scores by
    softmax or sigmoid, a per-expert correction bias that steers the choice but not the weights, the top
    `topk_group` of `n_group` expert groups (ranked by their two best biased scores), then the top
    `experts_per_token` within them; weights renormalized if `norm_topk_prob`, times `routed_scaling_factor`."""

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False

    def __post_init__(self) -> None:
        _require(self.scoring in ("softmax", "sigmoid"), f"unsupported expert scoring {self.scoring!r}")
        _require(0 < self.topk_group <= self.n_group,
                 f"topk_group {self.topk_group!r} must be in 1..n_group ({self.n_group!r})")


@dataclass(frozen=True)
class FeedForward:
    """Per layer "dense" (one SwiGLU of `dense_intermediate`) or "moe" (routed experts plus shared ones)."""

    layer_kinds: tuple[str, ...]
    dense_intermediate: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0    # total width of the shared experts of one MoE layer
    routing: Routing = field(default_factory=Routing)

    def __post_init__(self) -> None:
        _require(set(self.layer_kinds) <= {"dense", "moe"}, f"unknown layer kinds {sorted(set(self.layer_kinds))}")
        if self.moe_layers:
            _require(0 < self.experts_per_token <= self.num_experts,
                     f"experts per token {self.experts_per_token} must be in 1..{self.num_experts}")
            groups = self.routing.n_group
            _require(self.num_experts % groups == 0 and (groups == 1 or self.num_experts // groups >= 2),
                     f"{self.num_experts} experts do not split into n_group={groups} groups of at least 2 "
                     f"(groups are ranked by their two best experts)")

    @property
    def moe_layers(self) -> int:
        return sum(1 for kind in self.layer_kinds if kind == "moe")

    @property
    def dense_layers(self) -> int:
        return len(self.layer_kinds) - self.moe_layers


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention: Attention
    ffn: FeedForward
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mtp_layers: int = 0
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        _require(len(self.ffn.layer_kinds) == self.num_layers,
                 f"{len(self.ffn.layer_kinds)} feed-forward kinds for {self.num_layers} layers")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")

    @property
    def is_moe(self) -> bool:
        return self.ffn.moe_layers > 0

    def truncated(self, num_layers: int | None = None, num_experts: int | None = None) -> ModelSpec:
        """The same architecture with fewer layers (the first ones) or fewer routed experts: what fits a
        machine, every other dimension unchanged."""
        spec = self
        if num_layers is not None:
            _require(isinstance(num_layers, int) and 0 < num_layers <= self.num_layers,
                     f"--num-layers must be in 1..{self.num_layers}, got {num_layers!r}")
            attention = self.attention
            if attention.indexer_types:
                types = attention.indexer_types[:num_layers]
                attention = replace(attention, indexer_types=types, indexer_layers=types.count("full"))
            spec = replace(spec, num_layers=num_layers, attention=attention,
                           ffn=replace(spec.ffn, layer_kinds=spec.ffn.layer_kinds[:num_layers]))
        if num_experts is not None:
            ffn = spec.ffn
            _require(ffn.num_experts > 0, f"--num-experts {num_experts!r}: {self.name} has no routed experts")
            _require(isinstance(num_experts, int) and ffn.experts_per_token <= num_experts <= ffn.num_experts,
                     f"--num-experts must be in {ffn.experts_per_token}..{ffn.num_experts} "
                     f"(top-k..the config's), got {num_experts!r}")
            groups = ffn.routing.n_group
            _require(num_experts % groups == 0 and (groups == 1 or num_experts // groups >= 2),
                     f"--num-experts {num_experts} must split into the config's {groups} expert groups of at "
                     f"least 2 experts")
            spec = replace(spec, ffn=replace(ffn, num_experts=num_experts))
        return spec

    def components(self) -> dict[str, Component]:
        hidden, ffn, attention = self.hidden_size, self.ffn, self.attention
        layer = attention.layer_linears(hidden)
        attention_linears = [Linear(one.out_features, one.in_features, one.count * self.num_layers, one.shard)
                             for one in layer]
        attention_linears += [Linear(one.out_features, one.in_features, one.count * attention.indexer_layers, one.shard)
                              for one in (attention.indexer_linears(hidden) if attention.indexer_layers else [])]
        indexer_norms = attention.indexer_layers * 2 * attention.indexer_head_dim
        router_bias = ffn.moe_layers * ffn.num_experts if ffn.routing.correction_bias else 0

        def swiglu(width: int, count: int) -> list[Linear]:
            """Gate and up as one matrix, as engines store them (a block-FP8 grid spans both)."""
            return [Linear(2 * width, hidden, count, "tp"), Linear(hidden, width, count, "tp")] if width and count else []

        embeddings = Component((), self.vocab_size * hidden)
        head = () if self.tie_word_embeddings else (Linear(self.vocab_size, hidden, 1, "tp"),)
        return {
            "attention": Component(tuple(attention_linears),
                                   self.num_layers * attention.layer_other_parameters() + indexer_norms),
            "dense_ffn": Component(tuple(swiglu(ffn.dense_intermediate, ffn.dense_layers))),
            "routed_experts": Component(tuple(swiglu(ffn.expert_intermediate, ffn.moe_layers * ffn.num_experts))),
            "shared_experts": Component(tuple(swiglu(ffn.shared_intermediate, ffn.moe_layers)),
                                        ffn.moe_layers * ffn.num_experts * hidden + router_bias),   # the routers
            "embeddings": embeddings,
            "head": Component(head),
            "norms": Component((), (2 * self.num_layers + 1) * hidden),
        }

    def component_parameters(self) -> dict[str, int]:
        return {name: part.parameters for name, part in self.components().items()}

    @property
    def expert_parameters(self) -> int:
        """One routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.hidden_size * self.ffn.expert_intermediate

    @property
    def mtp_parameters(self) -> int:
        """Each MTP layer: a decoder layer like the last one, plus its projection of [embedding; hidden]."""
        if not self.mtp_layers:
            return 0
        parts = self.component_parameters()
        per_layer = (parts["attention"] / self.num_layers + 2 * self.hidden_size
                     + (parts["routed_experts"] + parts["shared_experts"]) / max(1, self.ffn.moe_layers))
        return int(self.mtp_layers * (per_layer + 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size))

    @property
    def total_parameters(self) -> int:
        return sum(self.component_parameters().values())

    @property
    def decoder_linear_parameters(self) -> int:
        """Parameters of the decoder layers' matmul weights: what weight quantization applies to (the
        output head and the embeddings stay in a float dtype)."""
        parts = self.components()
        return sum(parts[name].linear_parameters for name in DECODER_COMPONENTS)

    @property
    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (embeddings counted)."""
        parts = self.component_parameters()
        routed = self.ffn.moe_layers * self.ffn.experts_per_token * self.expert_parameters
        return self.total_parameters - parts["routed_experts"] + routed

    @property
    def linear_flops_per_token(self) -> float:
        """2 × the matmul parameters a token uses in the decoder layers (embedding lookup and head aside)."""
        parts = self.component_parameters()
        routed = self.ffn.moe_layers * self.ffn.experts_per_token * self.expert_parameters
        return 2.0 * (parts["attention"] + parts["dense_ffn"] + routed + parts["shared_experts"])

    def kernels_per_step(self, tensor_parallel: int = 1) -> int:
        """Kernels (operators, on a CPU) one decode step launches: in every layer two norms and two residual
        adds, the attention's (GQA: QKV, rope, cache write, attention, output; MLA also its latent projections,
        their norms and the absorbed up-projections), the feed-forward's (dense: gate-up, activation, down; MoE:
        router, top-k, the grouped experts' two matmuls, activation and combine, a shared expert's three), two
        all-reduces under tensor parallelism; then the embedding, the final norm, the head and sampling. What
        each costs beyond its work is the step model's `kernel_launch_s`."""
        attention = 10 if self.attention.kind == "mla" else 5
        moe = 6 + (3 if self.ffn.shared_intermediate else 0)
        collectives = 2 if tensor_parallel > 1 else 0
        return (self.num_layers * (4 + attention + collectives) + self.ffn.dense_layers * 3
                + self.ffn.moe_layers * moe + 4)

    def attention_flops(self) -> dict[str, float]:
        """Attention's FLOPs over all layers, named as the step model's costs: per decode pair, per prefill pair,
        and per context token a prefill chunk re-expands (MLA)."""
        return {"attention_flops_per_pair": self.num_layers * self.attention.flops_per_pair(),
                "prefill_attention_flops_per_pair": self.num_layers * self.attention.prefill_flops_per_pair(),
                "prefill_context_flops_per_token": self.num_layers * self.attention.expansion_flops_per_token()}

    @property
    def indexer_flops_per_pair(self) -> float:
        """DSA: per (query, cached token) pair the indexer scores, over its layers: each head's dot product,
        its relu'd score weighted into the sum. Every rank of a tensor-parallel group runs the whole indexer."""
        attention = self.attention
        return 2.0 * attention.indexer_layers * attention.indexer_heads * (attention.indexer_head_dim + 1)


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _layer_kinds(config: dict[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
    def kinds(is_moe) -> tuple[str, ...]:
        return tuple("moe" if is_moe(layer) else "dense" for layer in range(num_layers))

    if "mlp_layer_types" in config:
        return tuple("moe" if kind == "sparse" else "dense" for kind in config["mlp_layer_types"][:num_layers])
    if family in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        dense = int(config.get("first_k_dense_replace", 0))
        freq = int(config.get("moe_layer_freq", 1))
        return kinds(lambda layer: layer >= dense and layer % freq == 0)
    if family == "qwen3_moe":
        step = int(config.get("decoder_sparse_step", 1))
        dense_layers = set(config.get("mlp_only_layers") or [])
        return kinds(lambda layer: layer not in dense_layers and (layer + 1) % step == 0)
    if family == "llama4":
        if config.get("moe_layers") is not None:
            moe = set(config["moe_layers"])
            return kinds(lambda layer: layer in moe)
        step = int(config.get("interleave_moe_layer_step", 1))
        return kinds(lambda layer: (layer + 1) % step == 0)
    if family == "mixtral":
        return kinds(lambda layer: True)
    return kinds(lambda layer: False)


def _routing(config: dict[str, Any], family: str) -> Routing:
    if family not in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        return Routing(norm_topk_prob=bool(config.get("norm_topk_prob", family == "mixtral")))
    return Routing(scoring=str(config.get("scoring_func", "sigmoid")), n_group=int(config.get("n_group") or 1),
                   topk_group=int(config.get("topk_group") or 1), norm_topk_prob=bool(config.get("norm_topk_prob")),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                   correction_bias=config.get("topk_method", "noaux_tc") == "noaux_tc")


def _feed_forward(config: dict[str, Any], family: str, num_layers: int) -> FeedForward:
    layer_kinds = _layer_kinds(config, family, num_layers)
    if family == "llama4":
        return FeedForward(layer_kinds, int(config.get("intermediate_size_mlp", config["intermediate_size"])),
                           int(config["num_local_experts"]), int(config["num_experts_per_tok"]),
                           int(config["intermediate_size"]), int(config["intermediate_size"]))
    if family == "mixtral":
        return FeedForward(layer_kinds, 0, int(config["num_local_experts"]), int(config["num_experts_per_tok"]),
                           int(config["intermediate_size"]), routing=_routing(config, family))
    if "moe" not in layer_kinds:
        return FeedForward(layer_kinds, int(config["intermediate_size"]))
    expert = int(config["moe_intermediate_size"])
    shared = int(config.get("n_shared_experts") or 0) * expert
    if family == "qwen3_moe":
        shared = int(config.get("shared_expert_intermediate_size") or 0)
    return FeedForward(layer_kinds, int(config.get("intermediate_size", 0)),
                       int(_first(config, "n_routed_experts", "num_experts")), int(config["num_experts_per_tok"]),
                       expert, shared, _routing(config, family))


def _attention(config: dict[str, Any], family: str, num_layers: int) -> Attention:
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    if config.get("kv_lora_rank"):
        nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        types = _indexer_types(config, num_layers) if config.get("index_head_dim") else ()
        return Attention("mla", heads, heads, nope + rope, int(config["v_head_dim"]),
                         q_lora_rank=int(config.get("q_lora_rank") or 0), kv_lora_rank=int(config["kv_lora_rank"]),
                         qk_nope_head_dim=nope, qk_rope_head_dim=rope, indexer_layers=types.count("full"),
                         indexer_heads=int(config.get("index_n_heads") or 0),
                         indexer_head_dim=int(config.get("index_head_dim") or 0), indexer_types=types,
                         index_topk=int(config.get("index_topk") or 0) if types else 0)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return Attention("gqa", heads, int(config.get("num_key_value_heads") or heads), head_dim, head_dim,
                     qkv_bias=family == "qwen2" or bool(config.get("attention_bias")),
                     qk_norm=family in ("qwen3", "qwen3_moe") or bool(config.get("use_qk_norm")))


def _indexer_types(config: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """DSA's per-layer indexer modes: the config's `indexer_types`, else its `index_topk_pattern` ("F"/"S"),
    else transformers' rule from `index_topk_freq` and `index_skip_topk_offset` (layer i runs its own indexer
    when max(i - offset + 1, 0) is a multiple of freq: every layer up to the offset, then one in freq)."""
    types = config.get("indexer_types")
    pattern = config.get("index_topk_pattern")
    if types is None and pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(mode, mode) for mode in pattern]
    if types is None:
        freq = max(int(config.get("index_topk_freq") or 1), 1)
        offset = int(config.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    types = tuple(types)
    _require(set(types) <= {"full", "shared"}, f"indexer_types must be 'full' or 'shared', got "
                                                f"{sorted(set(types) - {'full', 'shared'})!r}")
    _require(len(types) == num_layers, f"{len(types)} indexer_types for {num_layers} layers")
    _require(not types or types[0] == "full", "the first layer's indexer type must be 'full' (a 'shared' layer "
                                              "reuses the previous full layer's selection)")
    return types


def _rope(config: dict[str, Any], family: str) -> RopeConfig:
    rope = RopeConfig.from_hf(config, interleaved_by_default=family == "deepseek_v3")
    # transformers' glm_moe_dsa rotates interleaved pairs (attention and indexer) whatever rope_interleave says
    return replace(rope, interleaved=True) if family == "glm_moe_dsa" else rope


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def spec_from_config(config: dict[str, Any], name: str) -> ModelSpec:
    """Parses a Hugging Face config (or its `text_config`); unsupported families are refused by name."""
    outer = str(config.get("model_type", ""))
    text = text_config(config)
    family = str(text.get("model_type") or outer)
    family = WRAPPERS.get(family, family)
    if family not in FAMILIES:
        raise ConfigError(f"config.json of {name!r} has the unsupported architecture {family!r} "
                          f"(supported: {', '.join(FAMILIES)})")
    try:
        num_layers = int(text["num_hidden_layers"])
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        return ModelSpec(
            name=name, family=family, num_layers=num_layers, hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]), max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            attention=_attention(text, family, num_layers), ffn=_feed_forward(text, family, num_layers),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            rope=_rope(text, family),
            bos_token_id=_first(text, "bos_token_id", default=config.get("bos_token_id")),
            eos_token_ids=_token_ids(eos), mtp_layers=int(text.get("num_nextn_predict_layers") or 0), config=config)
    except KeyError as missing:
        raise ConfigError(f"config.json of {name!r} lacks the key {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        if isinstance(bad, ConfigError):
            raise ConfigError(f"config.json of {name!r}: {bad}") from None
        raise ConfigError(f"config.json of {name!r} has a bad value: {bad}") from None
