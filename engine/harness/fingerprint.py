"""What a profile says about where it was measured: the device and its measured peaks (copy bandwidth, matmul
FLOP/s), the engine's configuration, and the model's shape and per-step costs, in the fields the planner reads
(`engine.core.step_shape`)."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from engine.core.memory import (
    dtype_bytes,
    indexer_bytes_per_token,
    kv_bytes_per_token,
    tensor_parallel_traffic,
)
from engine.core.step_shape import engine_version
from engine.kernels.backend import use_triton
from engine.llm import LLM
from engine.model.layers.moe import GroupedExperts
from engine.model.quantized_linear import fused_rows_limit, linear_weight_bytes

COPY_BYTES = 256 << 20             # the copy that measures the device's memory bandwidth
MATMUL_SIZE = 2048                 # the square matmul that measures its FLOP/s


def _device_fingerprint(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": "cuda", "device_name": props.name, "sm_count": props.multi_processor_count,
                "memory_bytes": props.total_memory, "cores": None, "threads": None}
    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu_name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"device": "cpu", "device_name": cpu_name, "sm_count": None, "memory_bytes": memory,
            "cores": os.cpu_count(), "threads": torch.get_num_threads()}


def hardware_key(device_name: str, device_type: str) -> str | None:
    """The planner catalogue's name for a device, where it has one."""
    if device_type == "cpu":
        return "cpu"
    name = device_name.lower()
    for key, marker in (("h200", "h200"), ("h100-sxm", "h100"), ("b200", "b200"), ("a100-80gb", "a100"),
                        ("l40s", "l40s"), ("l4", "l4")):
        if marker in name:
            return key
    return None


def model_name(model: str) -> str:
    """A preset's name, or a config.json's file stem (random weights of that shape time the same)."""
    path = Path(model)
    return path.stem if path.suffix in (".json", ".gguf") else path.name if path.is_dir() else model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peaks(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """What this device really moves and computes: a large copy (bytes read + written) and a large matmul."""
    source = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(dtype)
    copies, matmuls = [], []
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        matmuls.append(time.perf_counter() - start)
    return {"copy_bandwidth_bytes_per_s": 2 * COPY_BYTES / min(copies),
            "matmul_flops_per_s": 2 * MATMUL_SIZE ** 3 / min(matmuls)}


def fingerprint(llm: LLM) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = _device_fingerprint(llm.device)
    return {
        "engine_version": engine_version(),
        **device,
        "hardware": hardware_key(device["device_name"], device["device"]),
        "torch": torch.__version__,
        "triton": triton_version,
        "model": model_name(llm.config.model),
        "model_source": llm.config.model,
        "num_layers": llm.config.num_layers,          # where a config too big for the machine was cut
        "num_experts": llm.config.num_experts,
        "weights": llm.config.weights,
        "group_size": llm.config.group_size if llm.config.weights == "int4" else None,
        "kv_dtype": llm.kv_layout.dtype,
        "compute_dtype": llm.core.compute_dtype,
        "integrity": llm.config.integrity,
        "page_size": llm.config.page_size,
        "tensor_parallel": llm.config.tensor_parallel,
        "expert_parallel": llm.config.expert_parallel,
        **measure_peaks(llm.device, next(llm.core.model.parameters()).dtype),
    }


def model_section(llm: LLM) -> dict[str, Any]:
    config = llm.model_config
    head = llm.core.model.head_weight
    return {
        "name": config.name, "num_layers": config.num_layers, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn.dense_intermediate, "num_heads": config.attention.num_heads,
        "num_kv_heads": config.attention.num_kv_heads, "head_dim": config.attention.head_dim,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "num_parameters": config.total_parameters,
        "num_linear_parameters": config.decoder_linear_parameters,
        "linear_weight_bytes": linear_weight_bytes(llm.core.model),
        "head_weight_bytes": head.nbytes,
        "weight_bytes": sum(t.nbytes for t in llm.core.model.state_dict().values()),
        "kv_bytes_per_token": kv_bytes_per_token(llm.kv_layout),
        "kernels_per_step": config.kernels_per_step(llm.config.tensor_parallel),
        # a step of more rows than this widens every quantized weight: written, then read by the matmul
        "fused_max_tokens": fused_rows_limit(llm.config.weights, llm.device),
        "dequantized_weight_bytes": 2 * config.decoder_linear_parameters * head.element_size(),
        **_cost_fields(llm),
        # the pure-torch decode attention reads every decode's pages padded to the batch's longest
        "decode_padding_page": None if use_triton(head) else llm.config.page_size,
        **_collective_fields(llm),
    }


def _collective_fields(llm: LLM) -> dict[str, Any]:
    """Under tensor parallelism: the step's collectives and their bytes (`engine.core.memory.tensor_parallel_traffic`;
    the model's FLOP fields stay the whole model's: the planner takes a rank's share)."""
    ranks = llm.config.tensor_parallel
    if ranks == 1:
        return {}
    config = llm.model_config
    traffic = tensor_parallel_traffic(config.num_layers, config.hidden_size, config.vocab_size, ranks,
                                      dtype_bytes(llm.core.compute_dtype))
    return {"tensor_parallel": ranks, "collective_calls_per_step": traffic.calls_per_step,
            "allreduce_bytes_per_token": traffic.allreduce_bytes_per_token,
            "gather_bytes_per_sequence": traffic.gather_bytes_per_sequence}


def routed_experts(model: torch.nn.Module) -> list[GroupedExperts]:
    return [module for module in model.modules() if isinstance(module, GroupedExperts)]


def _cost_fields(llm: LLM) -> dict[str, Any]:
    """What a step of this architecture computes and reads beyond a dense model's shape: FLOPs per token and
    per attention pair (MLA decodes in the latent space, prefills expanded, and re-expands a chunk's context),
    and for MoE the bytes of one routed expert as allocated, which the step reads only for the experts its
    tokens touch."""
    config = llm.model_config
    fields = {"family": config.family, "attention_kind": config.attention.kind,
              "linear_flops_per_token": config.linear_flops_per_token, **config.attention_flops()}
    if config.attention.index_topk:      # this engine's prefill attends under a selection mask: densely
        fields |= {"index_topk": config.attention.index_topk, "indexer_bytes_per_token": indexer_bytes_per_token(
            llm.kv_layout), "indexer_flops_per_pair": config.indexer_flops_per_pair, "sparse_prefill": False}
    experts = routed_experts(llm.core.model)
    if experts:
        ffn, local = config.ffn, experts[0].num_experts         # under expert parallelism: this rank's share
        allocated = sum(t.nbytes for module in experts for t in [*module.parameters(), *module.buffers()])
        fields |= {"num_moe_layers": ffn.moe_layers, "num_experts": ffn.num_experts,
                   "experts_per_token": ffn.experts_per_token,
                   "expert_weight_bytes": allocated / (ffn.moe_layers * local),
                   **({"local_experts": local} if local != ffn.num_experts else {})}
    return fields
