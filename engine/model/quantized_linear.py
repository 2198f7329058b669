"""Quantized linear layers and the swap that puts them into a model (primitives live in engine.model.quant).

Embeddings, norms and the (tied) output head stay in the compute dtype: they are a small part of the
bytes of big models and the most sensitive to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.memory import WeightFormat
from engine.core.spec import DECODER_COMPONENTS
from engine.kernels.backend import use_triton
from engine.kernels.expert_weights import ExpertWeights
from engine.kernels.tuning import ROWS_BUCKETS, launch_config, rows_bucket
from engine.model.layers.linear import linear
from engine.model.layers.moe import Experts, GroupedExperts
from engine.model.quant import (
    SYMMETRIC_OFFSET,
    Fp8Weight,
    Int4Weight,
    dequantize_fp8_weight,
    dequantize_int4,
    fp8_scale,
    quantize_fp8,
    quantize_fp8_weight,
    quantize_int4,
    unpack_int4,
)

CPU_INT4_INNER_K_TILES = 2
CPU_INT4_ROW_MULTIPLE = 16     # torch's CPU int4 kernel packs output rows in blocks of 16
CUDA_INT4_INNER_K_TILES = 8    # torch's CUDA int4 kernel (tinygemm): K a multiple of 8 x 16
CUDA_INT4_GROUPS = (32, 64, 128, 256)
TORCH_INT4_ACTIVATIONS = torch.bfloat16   # both of torch's int4 kernels take bf16 (the CPU one ~30x faster than fp32)
TRITON_MAX_ROWS = 64           # on CUDA, by default the fused-dequantization GEMMs serve memory-bound (decode) steps
LINEAR_PATHS = {"int4_linear": ("triton", "torch_int4", "dequantize"),
                "fp8_linear": ("triton", "scaled_mm", "dequantize")}


def default_path(rows: int) -> str:
    """Untuned: the fused-dequantization kernel for decode's few rows, a widened weight's float GEMM for prefill."""
    return "triton" if rows <= TRITON_MAX_ROWS else "dequantize"


def linear_path(kernel: str, rows: int, device: torch.device) -> str:
    """Which path serves a quantized linear of `rows` rows where Triton runs: the committed tuning's choice for the
    rows bucket (`bench/autotune_kernels.py` times every path of `LINEAR_PATHS` on the GPU), else `default_path`."""
    return launch_config(kernel, rows_bucket(rows), device).get("path", default_path(rows))


class Int4Linear(nn.Module):
    """W4A16: INT4 weights, activations in the compute dtype.

    On CPU every step runs torch's int4 kernel (`_weight_int4pack_mm_for_cpu`) on bf16 activations; its grid
    is w = (q - 8) * scale + zero, i.e. zero = minimum + 8 * scale. It beats widening the weight to fp32 for
    a float matmul at every row count (one thread: Kimi's 4096 x 7168 expert 0.9 ms at 1 row, 62 ms at 128
    against 254 ms widened, 216 ms at 512 against 474; SmolLM2's 576 x 1536 5.6 against 9.4 ms at 512 rows):
    bf16 dot products run at ~140 GFLOP/s where fp32 ones reach ~100, and nothing is written.
    Where Triton runs, `linear_path` picks per rows bucket: the Triton W4A16 kernel, torch's int4 kernel (tinygemm
    on CUDA) or a widened weight's float matmul.
    """

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("minimums", weight.minimums)       # None for a symmetric grid
        self._torch_operands: tuple[torch.Tensor, torch.Tensor] | None = None   # torch's repacking, made once

    @property
    def weight_int4(self) -> Int4Weight:
        return Int4Weight(self.packed, self.scales, self.minimums, self.group_size)

    def torch_int4_fits(self, device: torch.device) -> bool:
        """Whether torch's int4 kernel on this device takes this weight's shape."""
        if device.type == "cuda":
            return (self.in_features % (CUDA_INT4_INNER_K_TILES * 16) == 0 and self.out_features % 8 == 0
                    and self.group_size in CUDA_INT4_GROUPS)
        return device.type == "cpu" and self.out_features % CPU_INT4_ROW_MULTIPLE == 0

    def _torch_int4_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's packing of the values (per device) and its [groups, out, 2] scales and zeros."""
        if self._torch_operands is None:
            q = unpack_int4(self.packed)
            if self.packed.is_cuda:             # tinygemm wants the even index in the high nibble
                packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(),
                                                           CUDA_INT4_INNER_K_TILES)
            else:
                packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), CPU_INT4_INNER_K_TILES)
            zeros = self.weight_int4.group_minimums().float() + SYMMETRIC_OFFSET * self.scales.float()
            scales_and_zeros = torch.stack([self.scales.float(), zeros], dim=-1).transpose(0, 1).contiguous()
            self._torch_operands = (packed, scales_and_zeros.to(TORCH_INT4_ACTIVATIONS))
        return self._torch_operands

    def _path(self, rows: int, x: torch.Tensor) -> str:
        if use_triton(x):
            path = linear_path("int4_linear", rows, x.device)
            if path == "torch_int4" and not self.torch_int4_fits(x.device):
                path = default_path(rows)
            return path
        return "torch_int4" if self.torch_int4_fits(x.device) else "dequantize"

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.weight_int4, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        path = self._path(flat.shape[0], x)
        if path == "triton":
            from engine.kernels.int4_matmul import w4a16_matmul

            weight = self.weight_int4
            out = w4a16_matmul(flat.contiguous(), weight.packed, weight.scales, weight.minimums, self.group_size,
                               symmetric_offset=SYMMETRIC_OFFSET if weight.minimums is None else 0)
            return out.reshape(*x.shape[:-1], self.out_features)
        if path == "torch_int4":
            packed, scales_and_zeros = self._torch_int4_operands()
            int4_mm = torch._weight_int4pack_mm if x.is_cuda else torch._weight_int4pack_mm_for_cpu
            out = int4_mm(flat.to(TORCH_INT4_ACTIVATIONS), packed, self.group_size, scales_and_zeros)
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return linear(x, dequantize_int4(self.weight_int4, x.dtype))


class Fp8Linear(nn.Module):
    """W8A16: e4m3 weights with a scale per output channel (or per 128 x 128 block, as DeepSeek ships them),
    activations in the compute dtype.

    On CUDA, decode steps of per-channel weights run the Triton W8A16 kernel; otherwise the weight is widened
    for a float matmul.
    """

    def __init__(self, weight: Fp8Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.values.shape
        self.block_size = weight.block_size
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)

    @property
    def weight_fp8(self) -> Fp8Weight:
        return Fp8Weight(self.values, self.scales, self.block_size)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_weight(self.weight_fp8, dtype)

    def _path(self, rows: int, x: torch.Tensor) -> str:
        path = linear_path("fp8_linear", rows, x.device) if use_triton(x) else "dequantize"
        channel_scales = self.block_size is None
        if path == "scaled_mm" and not (channel_scales and self.in_features % 16 == 0 and self.out_features % 16 == 0):
            path = default_path(rows)
        return path if path != "triton" or channel_scales else "dequantize"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        path = self._path(flat.shape[0], x)
        if path == "triton":
            from engine.kernels.fp8_matmul import w8a16_matmul

            out = w8a16_matmul(flat.contiguous(), self.values, self.scales.float())
        elif path == "scaled_mm":
            out = scaled_mm_per_row(flat, self.values, self.scales)
        else:
            return linear(x, dequantize_fp8_weight(self.weight_fp8, x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)


def scaled_mm_per_row(x: torch.Tensor, values: torch.Tensor, channel_scales: torch.Tensor) -> torch.Tensor:
    """W8A8 through `torch._scaled_mm`: each row of x quantized to e4m3 with its own scale (dynamic per token, as
    vLLM runs FP8 checkpoints), the weight's per-channel scales applied in the GEMM's epilogue. Compute-bound
    steps run at the FP8 tensor cores' rate and read the weight as stored; the price is the activations' rounding."""
    row_scales = fp8_scale(x.float().abs().amax(dim=-1, keepdim=True))
    return torch._scaled_mm(quantize_fp8(x.float(), row_scales), values.t(), scale_a=row_scales,
                            scale_b=channel_scales.float()[None, :], out_dtype=x.dtype)


def fused_rows_limit(weights: str, device: torch.device) -> int | None:
    """The most rows a quantized linear serves without widening its weight to the compute dtype; None where
    it is never widened (float weights, INT4 on CPU). Beyond it each step dequantizes every weight: the
    profiler counts that traffic, since it is what the step really moves."""
    if weights not in ("int4", "fp8", "native"):
        return None
    if device.type != "cuda":
        return None if weights in ("int4", "native") else 0
    kernel = "fp8_linear" if weights == "fp8" else "int4_linear"
    served = 0
    for rows in (*(int(bucket.removeprefix("rows<=")) for bucket in ROWS_BUCKETS), TRITON_MAX_ROWS + 1):
        if linear_path(kernel, rows, device) == "dequantize":
            return served
        served = rows
    return None


def quantize_linear(layer: nn.Linear, fmt: WeightFormat, search: bool = False) -> nn.Module:
    if layer.bias is not None:
        raise ValueError("quantized layers here have no bias; the families served have none")
    if fmt.dtype == "int4":
        return Int4Linear(quantize_int4(layer.weight.data, fmt, search))
    if fmt.dtype == "fp8":
        return Fp8Linear(quantize_fp8_weight(layer.weight.data, fmt.block_size))
    raise ValueError(f"{fmt.dtype!r} is not a quantized format")


class QuantizedExperts(GroupedExperts):
    """A layer's routed experts, quantized and still stacked: each buffer [experts, ...] holds every expert's
    packed values (and scales, minimums) of one projection. Each expert the step touches multiplies through a
    quantized linear over views of its slice, so the kernels of `Int4Linear` / `Fp8Linear` serve experts too."""

    def __init__(self, experts: Experts, fmt: WeightFormat, search: bool = False) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        self.first_expert = experts.first_expert
        self.fmt = fmt
        for name in ("gate_up_proj", "down_proj"):
            parts = [quantize_linear_weight(matrix, fmt, search) for matrix in getattr(experts, name).data]
            for field, tensors in _weight_fields(parts).items():
                self.register_buffer(f"{name}_{field}", None if tensors is None else torch.stack(tensors))
        self._linears: dict[tuple[int, str], nn.Module] = {}

    def _linear(self, index: int, name: str) -> nn.Module:
        key = (index, name)
        if key not in self._linears:
            if self.fmt.dtype == "int4":
                minimums = getattr(self, f"{name}_minimums")
                weight = Int4Weight(getattr(self, f"{name}_packed")[index], getattr(self, f"{name}_scales")[index],
                                    None if minimums is None else minimums[index], self.fmt.group_size)
                self._linears[key] = Int4Linear(weight)
            else:
                self._linears[key] = Fp8Linear(Fp8Weight(getattr(self, f"{name}_values")[index],
                                                         getattr(self, f"{name}_scales")[index], self.fmt.block_size))
        return self._linears[key]

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(index, "gate_up_proj")(x).split(self.intermediate_size, dim=-1)
        return self._linear(index, "down_proj")(F.silu(gate) * up)

    def fused_stacks(self) -> tuple[ExpertWeights, ExpertWeights] | None:
        """INT4 stacks (a symmetric grid's minimums made in the kernel from its scales) or FP8 ones (channel or block
        scales)."""
        def stack(name: str) -> ExpertWeights:
            scales = getattr(self, f"{name}_scales")
            if self.fmt.dtype == "fp8":
                return ExpertWeights(getattr(self, f"{name}_values"), scales, block_size=self.fmt.block_size or 0)
            minimums = getattr(self, f"{name}_minimums")
            return ExpertWeights(getattr(self, f"{name}_packed"), scales, minimums, self.fmt.group_size,
                                 symmetric_offset=SYMMETRIC_OFFSET if minimums is None else 0)
        return stack("gate_up_proj"), stack("down_proj")


def quantize_linear_weight(weight: torch.Tensor, fmt: WeightFormat, search: bool = False) -> Int4Weight | Fp8Weight:
    if fmt.dtype == "int4":
        return quantize_int4(weight, fmt, search)
    if fmt.dtype == "fp8":
        return quantize_fp8_weight(weight, fmt.block_size)
    raise ValueError(f"{fmt.dtype!r} is not a quantized format")


def _weight_fields(parts: list[Int4Weight] | list[Fp8Weight]) -> dict[str, list[torch.Tensor] | None]:
    if isinstance(parts[0], Int4Weight):
        return {"packed": [p.packed for p in parts], "scales": [p.scales for p in parts],
                "minimums": None if parts[0].minimums is None else [p.minimums for p in parts]}
    return {"values": [p.values for p in parts], "scales": [p.scales for p in parts]}


def component_of(module_name: str) -> str:
    """The planner's component a decoder module belongs to, from its (full or layer-relative) name."""
    parts = module_name.split(".")
    if "experts" in parts:
        return "routed_experts"
    if "shared_experts" in parts:
        return "shared_experts"
    return "attention" if "self_attn" in parts else "dense_ffn"


def quantize_model(model: nn.Module, scheme: dict[str, WeightFormat], search: bool = False) -> nn.Module:
    """Quantizes each decoder component's linears (and stacked experts) in its format of `scheme`; components
    the scheme leaves out, the router, the embeddings and the output head stay float. In place; returns the
    model. `search` turns on the INT4 clipping search (see engine.model.quant.quantize_int4)."""
    for module_name, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            fmt = scheme.get(component_of(f"{module_name}.{name}" if module_name else name))
            if fmt is None or fmt.dtype not in ("int4", "fp8") or name == "lm_head":
                continue
            if isinstance(child, nn.Linear):
                setattr(module, name, quantize_linear(child, fmt, search))
            elif isinstance(child, Experts):
                setattr(module, name, QuantizedExperts(child, fmt, search))
    return model


def quantize_linears(model: nn.Module, fmt: WeightFormat, search: bool = False) -> nn.Module:
    """Every decoder linear in one format."""
    return quantize_model(model, dict.fromkeys(DECODER_COMPONENTS, fmt), search)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes the decoder layers' matmul weights occupy as stored (packed values, scales, minimums; stacked
    experts too); the output head is not counted."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, (Int4Linear, Fp8Linear, QuantizedExperts)):
            total += sum(b.nbytes for b in module.buffers(recurse=False))
        elif isinstance(module, Experts):
            total += sum(p.nbytes for p in module.parameters(recurse=False))
        elif isinstance(module, nn.Linear) and not name.endswith("lm_head"):
            total += module.weight.nbytes
    return total


def allocated_bytes_by_component(model: nn.Module) -> dict[str, int]:
    """The bytes of every weight tensor the model holds (packed values, scales, norms, embeddings), by the
    planner's components: what `planner.cost.memory_plan` predicts for one device."""
    totals: dict[str, int] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("embed_tokens."):
            component = "embeddings"
        elif name.startswith("lm_head."):
            component = "head"
        elif name == "norm.weight" or (name.endswith("layernorm.weight") and ".self_attn." not in name):
            component = "norms"
        elif ".mlp.gate." in name:
            component = "shared_experts"                    # the routers, as the planner counts them
        else:
            component = component_of(name)
        totals[component] = totals.get(component, 0) + tensor.nbytes
    return totals
