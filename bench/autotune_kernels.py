"""Autotunes the engine's Triton kernels on this GPU and writes their configurations where the engine reads them
(`engine/kernels/tuned/<gpu>.json`, see `engine/kernels/tuning.py`): for each kernel and shape bucket, every candidate
(tiles, warps, pipeline stages, the programs a split aims at) is timed through the kernel's own entry point on
shapes of the reference models (Llama-3.1-8B's projections and attention, Kimi K2.6's experts), and the one with the
least total time kept. Prints a table (default against best, per bucket) and writes a JSON report too.

On a machine without CUDA it says so and exits 2.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
EXIT_NO_CUDA = 2


def candidates(space: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def gemm_cases() -> dict[str, list[Callable[[], Any]]]:
    """W4A16 and W8A16 calls by rows bucket, at Llama-3.1-8B's projection shapes."""
    from engine.core.memory import WeightFormat
    from engine.kernels.fp8_matmul import w8a16_matmul
    from engine.kernels.int4_matmul import w4a16_matmul
    from engine.model.quant import quantize_int4

    cases: dict[str, list[Callable[[], Any]]] = {}
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weight = quantize_int4(dense, WeightFormat("int4", 128, scale_dtype="bf16"))
        minimums = weight.group_minimums()
        scales = dense.float().abs().amax(dim=1) / 448.0
        values = (dense.float() / scales[:, None]).to(torch.float8_e4m3fn)
        for rows in (1, 4, 16, 64):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            bucket = f"rows<={rows}"
            cases.setdefault(f"w4a16/{bucket}", []).append(
                lambda x=x, weight=weight, minimums=minimums: w4a16_matmul(x, weight.packed, weight.scales, minimums,
                                                                         128))
            cases.setdefault(f"w8a16/{bucket}", []).append(
                lambda x=x, values=values, scales=scales: w8a16_matmul(x, values, scales))
    return cases


def attention_cases() -> dict[str, list[Callable[[], Any]]]:
    """Paged decode attention (32 query, 8 KV heads of 128) at batch 1 x 8K, 64 x 1K and 64 x 8K."""
    from engine.kernels.paged_attention import paged_decode_attention

    cases: dict[str, list[Callable[[], Any]]] = {}
    for name, dtype in (("float", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        for batch, context in ((1, 8192), (64, 1024), (64, 8192)):
            pages = batch * context // 16
            pools = [torch.randn(pages, 16, 8, 128, device="cuda").to(dtype) for _ in range(2)]
            tables = torch.randperm(pages, device="cuda").view(batch, -1)
            lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
            scales = torch.ones(8, device="cuda") if name == "fp8" else None
            cases.setdefault(f"paged_decode/{name}", []).append(
                lambda q=q, pools=pools, tables=tables, lens=lens, scales=scales: paged_decode_attention(
                    q, *pools, tables, lens, 128 ** -0.5, scales, scales))
    return cases


def moe_cases() -> dict[str, list[Callable[[], Any]]]:
    """Kimi K2.6-shaped routed experts (hidden 7168, expert width 2048; 8 of 16 experts here) at 1 and 64 tokens."""
    from engine.core.memory import WeightFormat
    from engine.kernels.fused_moe import fused_experts
    from engine.model.layers.moe import Experts
    from engine.model.quantized_linear import QuantizedExperts

    experts = Experts(16, 7168, 2048)
    for parameter in experts.parameters():
        parameter.data = torch.randn(parameter.shape, device="cuda") * 0.02       # quantized on the device
    stacks = {"int4": QuantizedExperts(experts, WeightFormat("int4", 32, symmetric=True)).fused_stacks(),
              "fp8": QuantizedExperts(experts, WeightFormat("fp8", block_size=128)).fused_stacks()}
    cases: dict[str, list[Callable[[], Any]]] = {}
    for tokens in (1, 64):
        x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(16, device="cuda")[:8] for _ in range(tokens)])
        weights = torch.rand(tokens, 8, device="cuda")
        for name, stack in stacks.items():
            cases.setdefault(f"grouped_gemm/{name}", []).append(
                lambda x=x, ids=ids, weights=weights, stack=stack: fused_experts(x, weights, ids, 0, 16, *stack))
    return cases


def path_cases() -> dict[str, list[Callable[[], Any]]]:
    """Quantized linears through their forward, by rows bucket, at Llama-3.1-8B's projection shapes: the Triton kernel,
    torch's own (tinygemm for INT4, `_scaled_mm` for FP8) and the widened weight's GEMM, up to prefill's 4096 rows."""
    from engine.core.memory import WeightFormat
    from engine.kernels.tuning import rows_bucket
    from engine.model.quant import quantize_fp8_weight, quantize_int4
    from engine.model.quantized_linear import Fp8Linear, Int4Linear

    cases: dict[str, list[Callable[[], Any]]] = {}
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        layers = {"int4_linear": Int4Linear(quantize_int4(dense, WeightFormat("int4", 128, scale_dtype="bf16"))),
                  "fp8_linear": Fp8Linear(quantize_fp8_weight(dense))}
        for rows in (1, 4, 16, 64, 512, 4096):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            for kernel, layer in layers.items():
                cases.setdefault(f"{kernel}/{rows_bucket(rows)}", []).append(lambda x=x, layer=layer: layer(x))
    return cases


SPACES = {
    "w4a16": {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "target_programs": (256, 1024)},
    "w8a16": {"block_n": (32, 64, 128), "block_k": (64, 128), "num_warps": (4, 8), "target_programs": (256, 1024)},
    "paged_decode": {"num_warps": (2, 4, 8), "num_stages": (1, 2, 3), "target_programs": (2048, 8192, 32768)},
    "grouped_gemm": {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)},
    "int4_linear": {"path": ("triton", "torch_int4", "dequantize")},      # engine.model.quantized_linear.LINEAR_PATHS
    "fp8_linear": {"path": ("triton", "scaled_mm", "dequantize")},
}


def tune(cases: dict[str, list[Callable[[], Any]]]) -> dict[str, dict[str, Any]]:
    """Per kernel/bucket: the candidate of least total time over its cases, the defaults' time, the best's."""
    from triton.testing import do_bench

    from engine.kernels.tuning import trying

    found: dict[str, dict[str, Any]] = {}
    for key, calls in cases.items():
        kernel, bucket = key.split("/")
        timed = []
        for config in [{}] + candidates(SPACES[kernel]):
            with trying(kernel, bucket, config):
                try:
                    timed.append((sum(do_bench(call, warmup=5, rep=20) for call in calls), config))
                except Exception as error:      # noqa: BLE001 - a candidate the GPU cannot run (registers, shared memory)
                    print(f"{key} {config}: {type(error).__name__}", file=sys.stderr)
        default_ms = timed[0][0]
        best_ms, best = min(timed, key=lambda pair: pair[0])
        found[key] = {"config": best, "best_ms": best_ms, "default_ms": default_ms}
        print(f"{key:26s} default {default_ms:8.3f} ms  best {best_ms:8.3f} ms  {best}", file=sys.stderr)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="substring of the kernel/bucket keys to tune")
    parser.add_argument("--report", type=Path, default=RESULTS / "autotune_kernels.json")
    parser.add_argument("--tuned-dir", type=Path, default=None,
                        help="where to write <gpu>.json (default engine/kernels/tuned, where the engine reads it)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/autotune_kernels.py needs a CUDA device; this machine has none", file=sys.stderr)
        raise SystemExit(EXIT_NO_CUDA)
    from engine.kernels.tuning import TUNED, gpu_key, reread_tuned_files

    tuned_dir = args.tuned_dir or TUNED
    tuned_dir.mkdir(parents=True, exist_ok=True)
    path = tuned_dir / f"{gpu_key(torch.cuda.get_device_name())}.json"
    found: dict[str, dict[str, Any]] = {}
    for stage in (gemm_cases() | attention_cases() | moe_cases(), path_cases()):     # paths timed on tuned kernels
        stage_found = tune({key: calls for key, calls in stage.items() if args.only is None or args.only in key})
        tuned = json.loads(path.read_text()) if path.exists() else {}
        for key, result in stage_found.items():
            kernel, bucket = key.split("/")
            tuned.setdefault(kernel, {})[bucket] = result["config"]
        path.write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")
        if tuned_dir == TUNED:
            reread_tuned_files()
        found |= stage_found
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps({"device": torch.cuda.get_device_name(), "tuned": found}, indent=1) + "\n")
    print(f"written: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
