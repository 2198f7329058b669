"""The seed's effects on our own engine, on one CUDA device, in one run, each beside the limit it should approach.

Random weights of the catalogue's configs. Engines of a phase are resident at once and every figure is the median
over rounds that visit them in turn (interleaved), so drift in the device's clock or in the host hits every engine
alike; each point is timed by the engine's own profiler. What it prints and writes
(bench/results/gpu_seed_effects.json):

- `--suite overheads` (issue 45): Llama-3.1-8B cut to 8 layers, batch-1 decode at 512 tokens with CUDA graphs and
  eagerly, beside the same shapes' matmuls in plain torch replayed as one CUDA graph; SmolLM2-135M's batch-1 step;
  integrity off / ownership / full at batch 1 and 64 (1024 tokens).
- `--suite seed` (issue 46): Llama-3.1-8B at full depth, batch 1, BF16 / FP8 / INT4 weights; FP8 KV at twice the
  batch against BF16 KV at the same KV memory (8 layers, 4096 tokens), and at the same batch; paged decode attention
  at batch 64 x 8K against the copy bandwidth; Kimi K2.6 cut to 4 layers (native INT4 experts) at batch 64 against
  its weights' streaming floor, and its FP8 KV at twice the batch; GLM 5.2 cut to 4 layers, FP8 against INT4.

On a machine without CUDA it says so and exits 2. `scripts/gpu_check.sh` runs it first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = Path(__file__).resolve().parent.parent / "planner" / "data" / "model-configs"
LAYERS = 8
EXIT_NO_CUDA = 2


def copy_bandwidth_gb_s() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written per second."""
    from triton.testing import do_bench

    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.nbytes / (do_bench(lambda: target.copy_(source)) * 1e-3) / 1e9


def matmul_floor_s(config: dict[str, Any], batch: int, repeats: int) -> tuple[float, int]:
    """One decode step's matmuls at `batch` rows for the model's shapes (BF16 weights, attention left out), in
    plain torch, replayed as one CUDA graph: what a step cannot beat without reading fewer weight bytes; and
    those weights' bytes."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
              (2 * config["intermediate_size"], hidden), (hidden, config["intermediate_size"])]
    weights = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.01
               for _ in range(config["num_hidden_layers"]) for shape in shapes]
    weights.append(torch.randn(config["vocab_size"], hidden, dtype=torch.bfloat16, device="cuda") * 0.01)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=torch.bfloat16, device="cuda") for w in weights}

    def step() -> None:
        for weight in weights:
            inputs[weight.shape[1]] @ weight.t()

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10 * 1e-3)
    return statistics.median(times), sum(w.nbytes for w in weights)


def streaming_floor_s(num_bytes: int, copy_gb_s: float) -> float:
    """Reading `num_bytes` once at the device's copy rate (bytes read plus written per second): the time no step
    that reads them can beat."""
    return num_bytes / (copy_gb_s * 1e9)


def run_phase(engines: dict[str, dict[str, Any]], points: dict[str, tuple[str, int, int]],
              rounds: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Builds the engines (all resident at once), times every point once a round, rounds interleaved; the median
    step of each point and what each engine holds. Each point times 5 steps after 2 warm-up ones, by the engine's
    own profiler."""
    from engine.harness.profiler import Profiler, SweepPlan
    from engine.llm import LLM

    built: dict[str, Any] = {}
    times: dict[str, list[float]] = {label: [] for label in points}
    try:
        for label, config in engines.items():
            built[label] = LLM(device="cuda", **config)
        profilers = {label: Profiler(llm, SweepPlan(warmup=1, repeats=3)) for label, llm in built.items()}
        for _ in range(rounds):
            for label, (engine, batch, context) in points.items():
                times[label] += profilers[engine].profile_decode(batch, context, warmup=2, repeats=5)["times_s"]
        memory = {label: llm.memory_by_rank()[0] for label, llm in built.items()}
    finally:
        for llm in built.values():
            llm.close()
        torch.cuda.empty_cache()
    return {label: statistics.median(values) for label, values in times.items()}, memory


def weight_bytes(memory: dict[str, Any]) -> int:
    return sum(memory["weight_bytes_by_component"].values())


def run_overheads(rounds: int, copy_gb_s: float) -> dict[str, Any]:
    """Issue 45's figures: CUDA graphs against the matmul floor, SmolLM2's step, the integrity check's cost."""
    llama = json.loads((CONFIGS / "llama-3.1-8b.json").read_text()) | {"num_hidden_layers": LAYERS}
    floor_1, floor_bytes = matmul_floor_s(llama, 1, rounds)
    torch.cuda.empty_cache()                # the floor's weights are gone: their memory goes back for the engines
    llama_cut = {"model": str(CONFIGS / "llama-3.1-8b.json"), "num_layers": LAYERS, "weights": "bf16",
                 "kv_dtype": "bf16", "max_model_len": 8192, "max_num_batched_tokens": 8192}
    engines = {
        "bf16": llama_cut | {"integrity": "off", "max_num_seqs": 64, "num_pages": 64 * 70},
        "bf16 eager": llama_cut | {"integrity": "off", "max_num_seqs": 1, "num_pages": 64, "enforce_eager": True},
        "bf16 ownership": llama_cut | {"integrity": "ownership", "max_num_seqs": 64, "num_pages": 64 * 70},
        "bf16 full": llama_cut | {"integrity": "full", "max_num_seqs": 64, "num_pages": 64 * 70},
        "smollm2": {"model": "smollm2-135m", "weights": "bf16", "kv_dtype": "bf16", "integrity": "off",
                    "max_num_seqs": 1, "num_pages": 64},
    }
    points = {
        "batch-1 decode, BF16, graphs": ("bf16", 1, 512),
        "batch-1 decode, BF16, eager": ("bf16 eager", 1, 512),
        "SmolLM2-135M batch-1 decode": ("smollm2", 1, 512),
        "integrity off, batch 1 x 1K": ("bf16", 1, 1024),
        "integrity ownership, batch 1 x 1K": ("bf16 ownership", 1, 1024),
        "integrity full, batch 1 x 1K": ("bf16 full", 1, 1024),
        "integrity off, batch 64 x 1K": ("bf16", 64, 1024),
        "integrity ownership, batch 64 x 1K": ("bf16 ownership", 64, 1024),
        "integrity full, batch 64 x 1K": ("bf16 full", 64, 1024),
    }
    step, memory = run_phase(engines, points, rounds)
    ratios = {
        "bf16 graphs step / matmul graph floor (target <= 2.0)": step["batch-1 decode, BF16, graphs"] / floor_1,
        "bf16 eager / graphs": step["batch-1 decode, BF16, eager"] / step["batch-1 decode, BF16, graphs"],
        "smollm2 batch-1 step ms (target < 3)": step["SmolLM2-135M batch-1 decode"] * 1e3,
        "ownership / off, batch 1 (target <= 1.01)": step["integrity ownership, batch 1 x 1K"]
        / step["integrity off, batch 1 x 1K"],
        "ownership / off, batch 64 (target <= 1.01)": step["integrity ownership, batch 64 x 1K"]
        / step["integrity off, batch 64 x 1K"],
        "full / off, batch 64": step["integrity full, batch 64 x 1K"] / step["integrity off, batch 64 x 1K"],
    }
    return {"step_s": step, "ratios": ratios, "engine_memory": memory, "matmul_floor_batch1_s": floor_1,
            "matmul_floor_weight_bytes": floor_bytes,
            "matmul_floor_streaming_s": streaming_floor_s(floor_bytes, copy_gb_s)}


def attention_microbench(copy_gb_s: float) -> dict[str, float]:
    """Paged decode attention at batch 64 x 8K (Llama-8B's 32 query and 8 KV heads of 128): BF16 pages' share of
    the copy bandwidth, and FP8 pages' time against BF16's."""
    from triton.testing import do_bench

    from engine.kernels.paged_attention import paged_decode_attention

    batch, context, heads, kv_heads, dim, page = 64, 8192, 32, 8, 128, 16
    pages = batch * context // page
    tables = torch.randperm(pages, device="cuda").view(batch, -1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    result = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        pools = [torch.randn(pages, page, kv_heads, dim, device="cuda").to(dtype) for _ in range(2)]
        scales = torch.ones(kv_heads, device="cuda") if name == "fp8" else None
        ms = do_bench(lambda: paged_decode_attention(q, *pools, tables, lens, dim ** -0.5, scales, scales))
        result[f"{name}_ms"] = ms
        result[f"{name}_gb_s"] = sum(pool.nbytes for pool in pools) / (ms * 1e-3) / 1e9
        pools.clear()
    result["bf16 share of copy bandwidth (target >= 0.6)"] = result["bf16_gb_s"] / copy_gb_s
    result["fp8 time / bf16 (target <= 0.6)"] = result["fp8_ms"] / result["bf16_ms"]
    return result


def run_seed(rounds: int, copy_gb_s: float) -> dict[str, Any]:
    """Issue 46's figures: the seed's FP8 KV and INT4 effects on our engine (Llama-3.1-8B at full depth, its 8-layer
    cut for the KV comparison, Kimi K2.6 and GLM 5.2 cut in depth at full width)."""
    llama = {"model": str(CONFIGS / "llama-3.1-8b.json"), "kv_dtype": "bf16", "integrity": "off",
             "max_model_len": 8192, "max_num_batched_tokens": 8192}
    kv_pages = 64 * (4096 + 64) // 16               # BF16 pages of batch 64 at 4K; FP8 pages: twice as many
    engines = {
        "llama bf16": llama | {"weights": "bf16", "max_num_seqs": 1, "num_pages": 64},
        "llama fp8": llama | {"weights": "fp8", "max_num_seqs": 1, "num_pages": 64},
        "llama int4": llama | {"weights": "int4", "max_num_seqs": 1, "num_pages": 64},
        "kv bf16": llama | {"weights": "bf16", "num_layers": LAYERS, "max_num_seqs": 64, "num_pages": kv_pages},
        "kv fp8": llama | {"weights": "bf16", "num_layers": LAYERS, "kv_dtype": "fp8", "max_num_seqs": 128,
                           "num_pages": 2 * kv_pages},
    }
    points = {
        "Llama-3.1-8B batch-1 decode, BF16 weights": ("llama bf16", 1, 512),
        "Llama-3.1-8B batch-1 decode, FP8 weights": ("llama fp8", 1, 512),
        "Llama-3.1-8B batch-1 decode, INT4 weights": ("llama int4", 1, 512),
        "8 layers, BF16 KV, batch 64 x 4K": ("kv bf16", 64, 4096),
        "8 layers, FP8 KV, batch 64 x 4K": ("kv fp8", 64, 4096),
        "8 layers, FP8 KV, batch 128 x 4K": ("kv fp8", 128, 4096),
    }
    step, memory = run_phase(engines, points, rounds)
    kimi = {"model": str(CONFIGS / "kimi-k2.6.json"), "num_layers": 4, "weights": "native", "integrity": "off",
            "max_model_len": 8192, "max_num_batched_tokens": 8192}
    kimi_points = {"Kimi K2.6 4 layers, BF16 KV, batch 64 x 4K": ("kimi kv bf16", 64, 4096),
                   "Kimi K2.6 4 layers, FP8 KV, batch 128 x 4K": ("kimi kv fp8", 128, 4096)}
    kimi_step, kimi_memory = run_phase({
        "kimi kv bf16": kimi | {"kv_dtype": "bf16", "max_num_seqs": 64, "num_pages": kv_pages},
        "kimi kv fp8": kimi | {"kv_dtype": "fp8", "max_num_seqs": 128, "num_pages": 2 * kv_pages},
    }, kimi_points, rounds)
    glm = {"model": str(CONFIGS / "glm-5.2.json"), "num_layers": 4, "kv_dtype": "bf16", "integrity": "off",
           "max_num_seqs": 1, "num_pages": 128, "max_model_len": 8192}
    glm_points = {"GLM 5.2 4 layers batch-1 decode, FP8": ("glm fp8", 1, 1024),
                  "GLM 5.2 4 layers batch-1 decode, INT4": ("glm int4", 1, 1024)}
    glm_step, glm_memory = run_phase({"glm fp8": glm | {"weights": "fp8"}, "glm int4": glm | {"weights": "int4"}},
                                     glm_points, rounds)
    step |= kimi_step | glm_step
    memory |= kimi_memory | glm_memory
    kimi_floor = streaming_floor_s(weight_bytes(kimi_memory["kimi kv bf16"]), copy_gb_s)
    batches = {label: batch for label, (_, batch, _) in (points | kimi_points | glm_points).items()}
    tokens_per_s = {label: batches[label] / seconds for label, seconds in step.items()}
    ratios = {
        "Llama INT4 speed / BF16 (target >= 2.0; bytes 3.0)": step["Llama-3.1-8B batch-1 decode, BF16 weights"]
        / step["Llama-3.1-8B batch-1 decode, INT4 weights"],
        "Llama INT4 speed / FP8 (target >= 1.3; bytes 1.6)": step["Llama-3.1-8B batch-1 decode, FP8 weights"]
        / step["Llama-3.1-8B batch-1 decode, INT4 weights"],
        "Llama FP8 speed / BF16 (target >= 1.5; bytes 1.9)": step["Llama-3.1-8B batch-1 decode, BF16 weights"]
        / step["Llama-3.1-8B batch-1 decode, FP8 weights"],
        "FP8 KV x2 batch tokens/s / BF16 KV (target >= 1.3)": tokens_per_s["8 layers, FP8 KV, batch 128 x 4K"]
        / tokens_per_s["8 layers, BF16 KV, batch 64 x 4K"],
        "FP8 KV speed / BF16 KV, same batch (target >= 1.0)": step["8 layers, BF16 KV, batch 64 x 4K"]
        / step["8 layers, FP8 KV, batch 64 x 4K"],
        "Kimi batch-64 step / weight streaming floor (target <= 3)": step["Kimi K2.6 4 layers, BF16 KV, batch 64 x 4K"]
        / kimi_floor,
        "Kimi FP8 KV x2 batch tokens/s / BF16 KV": tokens_per_s["Kimi K2.6 4 layers, FP8 KV, batch 128 x 4K"]
        / tokens_per_s["Kimi K2.6 4 layers, BF16 KV, batch 64 x 4K"],
        "GLM INT4 speed / FP8 (seed: 92 / 60 tokens/s)": step["GLM 5.2 4 layers batch-1 decode, FP8"]
        / step["GLM 5.2 4 layers batch-1 decode, INT4"],
    }
    return {"step_s": step, "tokens_per_s": tokens_per_s, "ratios": ratios, "engine_memory": memory,
            "kimi_weight_streaming_floor_s": kimi_floor, "attention": attention_microbench(copy_gb_s)}


def run(suites: list[str], rounds: int) -> dict[str, Any]:
    copy_gb_s = copy_bandwidth_gb_s()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": rounds,
                              "copy_gb_s": round(copy_gb_s, 1)}
    for suite in suites:
        result[suite] = (run_overheads if suite == "overheads" else run_seed)(rounds, copy_gb_s)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each times every point)")
    parser.add_argument("--suite", choices=("overheads", "seed", "all"), default="all",
                        help="overheads: graphs, SmolLM2, integrity (issue 45); seed: INT4/FP8 weights and FP8 KV at "
                             "full depth, Kimi K2.6, GLM 5.2 (issue 46)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_seed_effects.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("bench/gpu_seed_effects.py needs a CUDA device; this machine has none", file=sys.stderr)
        raise SystemExit(EXIT_NO_CUDA)
    result = run(["overheads", "seed"] if args.suite == "all" else [args.suite], args.rounds)
    print(f"{result['device']}: copy {result['copy_gb_s']:.0f} GB/s", file=sys.stderr)
    for suite in ("overheads", "seed"):
        if suite not in result:
            continue
        print(f"{'point':50s} {'step ms':>9s}", file=sys.stderr)
        for label, seconds in result[suite]["step_s"].items():
            print(f"{label:50s} {seconds * 1e3:9.3f}", file=sys.stderr)
        for label, ratio in result[suite]["ratios"].items():
            print(f"{label:62s} {ratio:8.3f}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
