"""Configuration dataclasses of the engine, validated on construction. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import ConfigError
from engine.memory import FLOAT_DTYPES, INT4_GROUP_SIZES

KV_DTYPES = (*FLOAT_DTYPES, "fp8")
WEIGHT_DTYPES = (*FLOAT_DTYPES, "fp8", "int4", "native")
INTEGRITY_MODES = ("off", "ownership", "full")
ROPE_TYPES = ("default", "linear", "llama3")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive_int(name: str, value: Any) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency and an optional long-context rescaling of the frequencies."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _require(self.theta > 0, f"rope theta must be positive, got {self.theta!r}")
        _require(self.rope_type in ROPE_TYPES,
                 f"unsupported rope scaling type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        _require(self.factor >= 1.0, f"rope scaling factor must be >= 1, got {self.factor!r}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeConfig:
        """Reads both the classic (`rope_theta` + `rope_scaling`) and the newer `rope_parameters` form."""
        params = dict(config.get("rope_parameters") or {})
        scaling = dict(config.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, as the engine needs it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of each linear layer of one decoder layer."""
        hidden, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.intermediate_size
        return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden),
                (hidden, inter)]

    @property
    def num_linear_parameters(self) -> int:
        return self.num_layers * sum(o * i for o, i in self.linear_shapes())

    @property
    def num_parameters(self) -> int:
        """Exact parameter count: embeddings (once if tied), attention, SwiGLU, norms, head."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embeddings
        return self.num_layers * (attention + mlp + norms) + self.hidden_size + embeddings + head

    @classmethod
    def from_hf(cls, config: dict[str, Any], name: str = "model") -> ModelConfig:
        """Parses a Hugging Face `config.json` of the Llama family (a nested `text_config` too)."""
        if "text_config" in config:
            config = {**config["text_config"], "tie_word_embeddings":
                      config.get("tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))}
        try:
            num_heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                rope=RopeConfig.from_hf(config),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
            )
        except KeyError as missing:
            raise ConfigError(f"config.json of {name!r} lacks the key {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            raise ConfigError(f"config.json of {name!r} has a bad value: {bad}") from None


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of continuous batching; shared by the engine and the simulator."""

    num_pages: int
    page_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive_int(name, getattr(self, name))
        _require(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                 f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                 f"must cover max_model_len ({self.max_model_len})")

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size


@dataclass(frozen=True)
class EngineConfig:
    """What `LLM` is built from: the model, its dtypes, the KV pool and the batching limits."""

    model: str = "smollm2-135m"
    weights: str = "fp32"
    kv_dtype: str | None = None
    compute_dtype: str | None = None
    group_size: int = 128
    int4_symmetric: bool = False
    device: str = "auto"
    page_size: int = 16
    kv_cache_gib: float | None = None
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    integrity: str = "ownership"
    integrity_sample_pages: int = 0         # sealed pages verified per step in `full` mode; 0 = all
    seed: int = 0
    # CPU threads for torch's kernels (process-wide); None keeps torch's default of one per core. On a shared
    # machine one thread per engine is what stays steady: a multi-threaded step waits for its slowest thread.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        _require(self.integrity in INTEGRITY_MODES,
                 f"unknown integrity mode {self.integrity!r} (choose from {', '.join(INTEGRITY_MODES)})")
        _require(isinstance(self.integrity_sample_pages, int) and self.integrity_sample_pages >= 0,
                 f"integrity_sample_pages must be a non-negative integer, got {self.integrity_sample_pages!r}")
        _require(self.weights in WEIGHT_DTYPES,
                 f"unknown weights dtype {self.weights!r} (choose from {', '.join(WEIGHT_DTYPES)})")
        _require(self.kv_dtype is None or self.kv_dtype in KV_DTYPES,
                 f"unknown kv dtype {self.kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
        _require(self.compute_dtype is None or self.compute_dtype in FLOAT_DTYPES,
                 f"unknown compute dtype {self.compute_dtype!r} (choose from {', '.join(FLOAT_DTYPES)})")
        _require(self.compute_dtype is None or self.weights not in FLOAT_DTYPES
                 or self.compute_dtype == self.weights,
                 f"float weights ({self.weights}) compute in their own dtype, not {self.compute_dtype!r}")
        _require(self.group_size in INT4_GROUP_SIZES,
                 f"group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {self.group_size!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        if self.num_pages is not None:
            _positive_int("num_pages", self.num_pages)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        _require(self.kv_cache_gib is None or self.kv_cache_gib > 0,
                 f"kv cache size must be positive GiB, got {self.kv_cache_gib!r}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def resolved_compute_dtype(self, on_gpu: bool) -> str:
        """Float weights compute in their dtype; quantized ones in bf16 on a GPU and fp32 on CPU."""
        if self.weights in FLOAT_DTYPES:
            return self.weights
        return self.compute_dtype or ("bf16" if on_gpu else "fp32")

    def resolved_kv_dtype(self, on_gpu: bool) -> str:
        """The KV cache is stored in the compute dtype unless told otherwise."""
        return self.kv_dtype or self.resolved_compute_dtype(on_gpu)
