"""Model specs from Hugging Face `config.json` files: shapes, parameter counts by component, KV layout.

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

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.files import read_json

CONFIGS = Path(__file__).resolve().parent / "data" / "model-configs"
PRESETS = {
    "kimi-k2.6": "kimi-k2.6.json", "glm-5.2": "glm-5.2.json", "deepseek-v3": "deepseek-v3.json",
    "llama-3.1-8b": "llama-3.1-8b.json", "llama-3.1-70b": "llama-3.1-70b.json", "qwen3-8b": "qwen3-8b.json",
    "qwen3-32b": "qwen3-32b.json", "qwen3-30b-a3b": "qwen3-30b-a3b.json",
    "qwen3-235b-a22b": "qwen3-235b-a22b.json", "llama-4-scout": "llama-4-scout.json",
    "smollm2-135m": "smollm2-135m.json",
}
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama4", "deepseek_v3", "glm4_moe", "glm_moe_dsa")
WRAPPERS = {"kimi_k25": "deepseek_v3", "kimi_k2": "deepseek_v3", "llama4_text": "llama4"}
COMPONENTS = ("attention", "dense_ffn", "routed_experts", "shared_experts", "embeddings", "head", "norms")


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

    @property
    def cache_elements_per_layer(self) -> int:
        """Elements one token caches in one layer (the indexer's keys aside)."""
        if self.kind == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

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
        """Per (query, cached token) pair in one layer: QK over the key dim, PV over the value dim.
        MLA decodes in the latent space (absorbed): both products run over the latent."""
        if self.kind == "mla":
            return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 2.0 * self.num_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class FeedForward:
    dense_layers: int
    moe_layers: int
    dense_intermediate: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0    # total width of the shared experts of one MoE layer

    def __post_init__(self) -> None:
        if self.moe_layers and not 0 < self.experts_per_token <= self.num_experts:
            raise PlannerError(f"experts per token {self.experts_per_token} must be in 1..{self.num_experts}")


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
    mtp_layers: int = 0
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.ffn.moe_layers > 0

    def components(self) -> dict[str, Component]:
        hidden, ffn, attention = self.hidden_size, self.ffn, self.attention
        layer = attention.layer_linears(hidden)
        attention_linears = [Linear(l.out_features, l.in_features, l.count * self.num_layers, l.shard) for l in layer]
        attention_linears += [Linear(l.out_features, l.in_features, l.count * attention.indexer_layers, l.shard)
                              for l in (attention.indexer_linears(hidden) if attention.indexer_layers else [])]
        indexer_norms = attention.indexer_layers * 2 * attention.indexer_head_dim

        def swiglu(width: int, count: int) -> list[Linear]:
            return [Linear(width, hidden, 2 * count, "tp"), Linear(hidden, width, count, "tp")] if width and count else []

        embeddings = Component((), self.vocab_size * hidden)
        head = () if self.tie_word_embeddings else (Linear(self.vocab_size, hidden, 1, "tp"),)
        return {
            "attention": Component(tuple(attention_linears),
                                   self.num_layers * attention.layer_other_parameters() + indexer_norms),
            "dense_ffn": Component(tuple(swiglu(ffn.dense_intermediate, ffn.dense_layers))),
            "routed_experts": Component(tuple(swiglu(ffn.expert_intermediate, ffn.moe_layers * ffn.num_experts))),
            "shared_experts": Component(tuple(swiglu(ffn.shared_intermediate, ffn.moe_layers)),
                                        ffn.moe_layers * ffn.num_experts * hidden),      # the routers
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

    def cache_elements_per_token(self) -> int:
        return self.num_layers * self.attention.cache_elements_per_layer


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _moe_layer_count(config: dict[str, Any], family: str, num_layers: int) -> int:
    if "mlp_layer_types" in config:
        return sum(1 for kind in config["mlp_layer_types"] if kind == "sparse")
    if family in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        dense = int(config.get("first_k_dense_replace", 0))
        freq = int(config.get("moe_layer_freq", 1))
        return sum(1 for layer in range(dense, num_layers) if layer % freq == 0)
    if family == "qwen3_moe":
        step = int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or [])
        return sum(1 for layer in range(num_layers) if layer not in dense and (layer + 1) % step == 0)
    if family == "llama4":
        if config.get("moe_layers") is not None:
            return len(config["moe_layers"])
        step = int(config.get("interleave_moe_layer_step", 1))
        return sum(1 for layer in range(num_layers) if (layer + 1) % step == 0)
    if family == "mixtral":
        return num_layers
    return 0


def _feed_forward(config: dict[str, Any], family: str, num_layers: int) -> FeedForward:
    moe_layers = _moe_layer_count(config, family, num_layers)
    dense_layers = num_layers - moe_layers
    if family == "llama4":
        return FeedForward(dense_layers, moe_layers, int(config.get("intermediate_size_mlp", config["intermediate_size"])),
                           int(config["num_local_experts"]), int(config["num_experts_per_tok"]),
                           int(config["intermediate_size"]), int(config["intermediate_size"]))
    if family == "mixtral":
        return FeedForward(0, moe_layers, 0, int(config["num_local_experts"]), int(config["num_experts_per_tok"]),
                           int(config["intermediate_size"]))
    if not moe_layers:
        return FeedForward(num_layers, 0, int(config["intermediate_size"]))
    expert = int(config["moe_intermediate_size"])
    shared = int(config.get("n_shared_experts") or 0) * expert
    if family == "qwen3_moe":
        shared = int(config.get("shared_expert_intermediate_size") or 0)
    return FeedForward(dense_layers, moe_layers, int(config.get("intermediate_size", 0)),
                       int(_first(config, "n_routed_experts", "num_experts")), int(config["num_experts_per_tok"]),
                       expert, shared)


def _attention(config: dict[str, Any], family: str, num_layers: int) -> Attention:
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    if config.get("kv_lora_rank"):
        nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        indexer_layers = 0
        if config.get("index_head_dim"):
            offset = int(config.get("index_skip_topk_offset", 0))
            freq = int(config.get("index_topk_freq", 1))
            indexer_layers = -(-(num_layers - offset) // freq)     # one indexer shared by `freq` sparse layers
        return Attention("mla", heads, heads, nope + rope, int(config["v_head_dim"]),
                         q_lora_rank=int(config.get("q_lora_rank") or 0), kv_lora_rank=int(config["kv_lora_rank"]),
                         qk_nope_head_dim=nope, qk_rope_head_dim=rope, indexer_layers=indexer_layers,
                         indexer_heads=int(config.get("index_n_heads") or 0),
                         indexer_head_dim=int(config.get("index_head_dim") or 0))
    head_dim = int(config.get("head_dim") or hidden // heads)
    return Attention("gqa", heads, int(config.get("num_key_value_heads") or heads), head_dim, head_dim,
                     qkv_bias=family == "qwen2" or bool(config.get("attention_bias")),
                     qk_norm=family in ("qwen3", "qwen3_moe") or bool(config.get("use_qk_norm")))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def spec_from_config(config: dict[str, Any], name: str) -> ModelSpec:
    """Parses a Hugging Face config (or its `text_config`); unsupported families are refused by name."""
    outer = str(config.get("model_type", ""))
    text = text_config(config)
    family = str(text.get("model_type") or outer)
    family = WRAPPERS.get(family, family)
    if family not in FAMILIES:
        raise PlannerError(f"config.json of {name!r} has the unsupported architecture {family!r} "
                           f"(supported: {', '.join(FAMILIES)})")
    try:
        num_layers = int(text["num_hidden_layers"])
        tie = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
        spec = ModelSpec(
            name=name, family=family, num_layers=num_layers, hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]), max_position_embeddings=int(text["max_position_embeddings"]),
            tie_word_embeddings=tie, attention=_attention(text, family, num_layers),
            ffn=_feed_forward(text, family, num_layers),
            mtp_layers=int(text.get("num_nextn_predict_layers") or 0), config=config)
    except KeyError as missing:
        raise PlannerError(f"config.json of {name!r} lacks the key {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        raise PlannerError(f"config.json of {name!r} has a bad value: {bad}") from None
    if min(spec.num_layers, spec.hidden_size, spec.vocab_size, spec.attention.num_heads) <= 0:
        raise PlannerError(f"config.json of {name!r} has a non-positive size")
    return spec


@lru_cache(maxsize=32)
def _load_file(path: str) -> dict[str, Any]:
    return read_json(path, "config file")


def model_names() -> list[str]:
    return list(PRESETS)


def get_model(name: str) -> ModelSpec:
    """A preset by name, or a path to a `config.json`."""
    if name in PRESETS:
        return spec_from_config(_load_file(str(CONFIGS / PRESETS[name])), name)
    if name.endswith(".json") or Path(name).exists():
        return spec_from_config(_load_file(name), Path(name).stem)
    raise PlannerError(f"unknown model {name!r} (choose from {', '.join(PRESETS)}, or give a path to a config.json)")
