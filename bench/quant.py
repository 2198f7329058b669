"""Quantization on the real model: memory, step time and perplexity per (weights, KV) combination.

On CPU: SmolLM2-135M, every combination, in one run (the same prompts, interleaved repetitions,
medians). On CUDA, add `--kernels`: W4A16 vs bf16 matmul vs torch's int4 kernel, and FP8 vs BF16
paged decode attention, in GB/s next to the device's measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.core.memory import WeightFormat, kv_bytes_per_token
from engine.core.reference_text import reference_text
from engine.core.sequence import SamplingParams
from engine.harness.perplexity import perplexity
from engine.llm import LLM
from engine.model.quantized_linear import linear_weight_bytes, quantize_linears

RESULTS = Path(__file__).resolve().parent / "results"
BENCH_KV_GIB = 0.25
# (label, engine options, INT4 clipping search on a float-loaded model)
COMBINATIONS = [
    ("fp32 / kv fp32", dict(weights="fp32"), False),
    ("fp32 / kv bf16", dict(weights="fp32", kv_dtype="bf16"), False),
    ("fp32 / kv fp8", dict(weights="fp32", kv_dtype="fp8"), False),
    ("bf16 / kv bf16", dict(weights="bf16"), False),
    ("fp8 / kv fp32", dict(weights="fp8"), False),
    ("int4 g32 / kv fp32", dict(weights="int4", group_size=32), False),
    ("int4 g64 / kv fp32", dict(weights="int4", group_size=64), False),
    ("int4 g64 search / kv fp32", dict(weights="fp32"), True),
    ("int4 g32 sym / kv fp32", dict(weights="int4", group_size=32, int4_symmetric=True), False),
    ("native / kv fp32", dict(weights="native"), False),
    ("native / kv fp8", dict(weights="native", kv_dtype="fp8"), False),
]


def build(options: dict, search: bool) -> LLM:
    llm = LLM(model="smollm2-135m", kv_cache_gib=BENCH_KV_GIB, **options)
    if search:
        quantize_linears(llm.core.model, WeightFormat("int4", 64), search=True)
    return llm


def decode_step_ms(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    llm.step()                                   # the prefill
    llm.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
    while llm.has_unfinished():
        llm.step()
    return statistics.median(times) * 1e3


def prefill_ms(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.score(prompt)
    return (time.perf_counter() - start) * 1e3


def run_cpu(args: argparse.Namespace) -> dict:
    """All engines are built first, then timed in interleaved rounds, so drift hits every row alike."""
    chosen = [c for c in COMBINATIONS if args.only is None or args.only in c[0]]
    engines = {label: build(options, search) for label, options, search in chosen}
    any_engine = next(iter(engines.values()))
    ids = any_engine.tokenizer.encode(reference_text(slice(60)))
    prompts = [ids[i * 150:i * 150 + 128] for i in range(16)]
    samples: dict[str, dict[str, list[float]]] = {label: {} for label in engines}
    for _ in range(args.repeats):
        for label, llm in engines.items():
            row = samples[label]
            row.setdefault("b1", []).append(decode_step_ms(llm, prompts[:1], args.steps))
            row.setdefault("b16", []).append(decode_step_ms(llm, prompts, args.steps))
            row.setdefault("prefill", []).append(prefill_ms(llm, ids[:512]))
    rows = []
    for label, llm in engines.items():
        times = {key: statistics.median(values) for key, values in samples[label].items()}
        rows.append({
            "label": label,
            "kv_dtype": llm.kv_layout.dtype,
            "model_bytes": sum(t.nbytes for t in llm.core.model.state_dict().values()),   # rotary tables are not state
            "linear_weight_bytes": linear_weight_bytes(llm.core.model),
            "kv_bytes_per_token": kv_bytes_per_token(llm.kv_layout),
            "decode_step_ms_b1": round(times["b1"], 2),
            "decode_step_ms_b16": round(times["b16"], 2),
            "prefill_512_ms": round(times["prefill"], 1),
            "perplexity": round(perplexity(llm, windows=args.windows).perplexity, 4),
        })
    baseline = rows[0]
    for row in rows:
        row["perplexity_vs_first_pct"] = round((row["perplexity"] / baseline["perplexity"] - 1) * 100, 2)
        row["decode_b1_speedup"] = round(baseline["decode_step_ms_b1"] / row["decode_step_ms_b1"], 2)
        row["decode_b16_speedup"] = round(baseline["decode_step_ms_b16"] / row["decode_step_ms_b16"], 2)
    return {"device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
            "repeats": args.repeats, "steps": args.steps, "windows": args.windows, "rows": rows}


def _gb_per_s(num_bytes: int, ms: float) -> float:
    return round(num_bytes / (ms * 1e-3) / 1e9, 1)


def run_kernel_benchmarks() -> dict:
    """CUDA only: kernels against their dense/bf16 counterparts, timed with triton.testing.do_bench."""
    from triton.testing import do_bench

    from engine.kernels.fp8_matmul import w8a16_matmul
    from engine.kernels.int4_matmul import w4a16_matmul
    from engine.kernels.paged_attention import paged_decode_attention
    from engine.kernels.tuning import rows_bucket, trying
    from engine.model.quant import quantize_int4
    from engine.model.quantized_linear import Int4Linear, scaled_mm_per_row

    if not torch.cuda.is_available():
        raise SystemExit("--kernels needs a CUDA GPU")
    device = torch.device("cuda")
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_gb_s = _gb_per_s(2 * source.nbytes, do_bench(lambda: target.copy_(source)))
    source = target = None          # the 2 GiB go back before the kernels' buffers are made
    gemm = []
    for n, k in ((4096, 4096), (14336, 4096)):
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        weight = quantize_int4(dense, WeightFormat("int4", 128, scale_dtype="bf16"))
        minimums = weight.group_minimums()
        layer = Int4Linear(weight)                   # torch's own int4 kernel (tinygemm) as the engine runs it
        for m in (1, 16, 64):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bf16_ms = do_bench(lambda: x @ dense.t())
            w4_ms = do_bench(lambda: w4a16_matmul(x, weight.packed, weight.scales, minimums, 128))
            row = {"n": n, "k": k, "m": m, "bf16_ms": bf16_ms, "w4a16_ms": w4_ms,
                   "bf16_gb_s": _gb_per_s(dense.nbytes, bf16_ms),
                   "w4a16_gb_s": _gb_per_s(weight.packed.nbytes + 2 * weight.scales.nbytes, w4_ms),
                   "w4a16_speedup": round(bf16_ms / w4_ms, 2)}
            try:
                with trying("int4_linear", rows_bucket(m), {"path": "torch_int4"}):
                    row["torch_int4_ms"] = do_bench(lambda: layer(x))
            except (RuntimeError, TypeError) as error:
                print(f"torch int4 kernel unavailable: {error}", file=sys.stderr)
            gemm.append(row)
    fp8 = []
    for n, k in ((4096, 4096), (14336, 4096)):
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        weight_scales = dense.float().abs().amax(dim=1) / 448.0
        values = (dense.float() / weight_scales[:, None]).to(torch.float8_e4m3fn)
        for m in (1, 16, 64):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row = {"n": n, "k": k, "m": m, "bf16_ms": do_bench(lambda: x @ dense.t()),
                   "w8a16_ms": do_bench(lambda: w8a16_matmul(x, values, weight_scales))}
            row["w8a16_gb_s"] = _gb_per_s(values.nbytes, row["w8a16_ms"])
            try:                                     # torch's FP8 GEMM: each activation row quantized too
                row["scaled_mm_ms"] = do_bench(lambda: scaled_mm_per_row(x, values, weight_scales))
            except (RuntimeError, TypeError) as error:
                print(f"torch._scaled_mm unavailable: {error}", file=sys.stderr)
            fp8.append(row)
    attention = []
    for batch, context in ((8, 1024), (8, 8192), (64, 8192), (1, 512), (8, 32768)):
        rows = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            heads, kv_heads, dim, page = 32, 8, 128, 16
            pages = batch * context // page
            keys = torch.randn(pages, page, kv_heads, dim, device=device).to(dtype)
            values = torch.randn(pages, page, kv_heads, dim, device=device).to(dtype)
            tables = torch.arange(pages, device=device, dtype=torch.int32).view(batch, -1)
            lens = torch.full((batch,), context, device=device, dtype=torch.int32)
            q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
            scales = torch.ones(kv_heads, device=device) if name == "fp8" else None
            ms = do_bench(lambda: paged_decode_attention(q, keys, values, tables, lens, dim ** -0.5, scales, scales))
            rows[name] = {"ms": ms, "gb_s": _gb_per_s(keys.nbytes + values.nbytes, ms)}
        attention.append({"batch": batch, "context": context,
                          **{f"{k}_{m}": v for k, d in rows.items() for m, v in d.items()},
                          "bf16_of_copy": round(rows["bf16"]["gb_s"] / copy_gb_s, 3),
                          "fp8_time_of_bf16": round(rows["fp8"]["ms"] / rows["bf16"]["ms"], 3)})
    return {"device": torch.cuda.get_device_name(), "copy_gb_s": copy_gb_s, "w4a16": gemm, "w8a16": fp8,
            "paged_attention": attention}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens")
    parser.add_argument("--only", default=None, help="substring of the combinations to run")
    parser.add_argument("--kernels", action="store_true", help="CUDA kernel microbenchmarks")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "quant_cpu.json")
    args = parser.parse_args()
    if args.kernels:
        report = run_kernel_benchmarks()
    else:
        report = run_cpu(args)
        print(f"{'combination':26s} {'model MB':>9s} {'KV B/tok':>8s} {'b1 ms':>7s} {'b16 ms':>7s} "
              f"{'pf512 ms':>8s} {'ppl':>8s} {'Δppl %':>7s}", file=sys.stderr)
        for r in report["rows"]:
            print(f"{r['label']:26s} {r['model_bytes'] / 1e6:9.1f} {r['kv_bytes_per_token']:8d} "
                  f"{r['decode_step_ms_b1']:7.1f} {r['decode_step_ms_b16']:7.1f} {r['prefill_512_ms']:8.0f} "
                  f"{r['perplexity']:8.3f} {r['perplexity_vs_first_pct']:7.2f}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
