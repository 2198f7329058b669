"""The seed's effects on our own engine, on one CUDA device, in one run, each beside the limit it should approach.

Engines of Llama-3.1-8B's shape cut to 8 decoder layers (random weights) and of SmolLM2-135M, all resident at once;
every figure is the median over rounds that visit the engines in turn (interleaved), so drift in the device's
clock or in the host hits every engine alike. What it prints and writes (bench/results/gpu_seed_effects.json):

- decode step at batch 1, 512 tokens of context, BF16 / FP8 / INT4 weights (BF16 also with --enforce-eager), beside
  the floor: the same shapes' matmuls in plain torch replayed as one CUDA graph, and the weights' bytes at the
  device's copy bandwidth;
- SmolLM2-135M's batch-1 decode step;
- FP8 KV at twice the batch against BF16 KV at the same KV memory (4096 tokens of context): tokens/s, and FP8 KV at
  the same batch;
- integrity off / ownership / full at batch 1 and 64 (1024 tokens of context): the step and its ratio to off.

On a machine without CUDA it says so and exits 2. `scripts/gpu_check.sh` runs it first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
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


class Engines:
    """The engines under test, built once; each point timed by the engine's own profiler."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.engines: dict[str, Any] = {}
        self.profilers: dict[str, Any] = {}

    def add(self, label: str, **config: Any) -> None:
        from engine.harness.profiler import Profiler, SweepPlan
        from engine.llm import LLM

        llm = LLM(model=config.pop("model", self.model), device="cuda", **config)
        self.engines[label] = llm
        self.profilers[label] = Profiler(llm, SweepPlan(warmup=1, repeats=3))

    def decode_s(self, label: str, batch: int, context: int) -> list[float]:
        return self.profilers[label].profile_decode(batch, context, warmup=2, repeats=5)["times_s"]

    def close(self) -> None:
        for llm in self.engines.values():
            llm.close()


def run(rounds: int) -> dict[str, Any]:
    llama = json.loads((CONFIGS / "llama-3.1-8b.json").read_text()) | {"num_hidden_layers": LAYERS}
    folder = tempfile.mkdtemp()
    cut = Path(folder) / "llama-3.1-8b-8layers.json"
    cut.write_text(json.dumps(llama))
    copy_gb_s = copy_bandwidth_gb_s()
    floor_1, weight_bytes = matmul_floor_s(llama, 1, rounds)
    torch.cuda.empty_cache()                # the floor's weights are gone: their memory goes back for the engines
    engines = Engines(str(cut))
    kv_tokens_bf16 = 64 * (4096 + 64)
    common = {"max_model_len": 8192, "max_num_batched_tokens": 8192}
    engines.add("bf16", weights="bf16", kv_dtype="bf16", integrity="off", max_num_seqs=64, num_pages=64 * 260,
                **common)
    engines.add("bf16 eager", weights="bf16", kv_dtype="bf16", integrity="off", max_num_seqs=64, num_pages=64 * 260,
                enforce_eager=True, **common)
    engines.add("fp8", weights="fp8", kv_dtype="bf16", integrity="off", max_num_seqs=1, num_pages=64, **common)
    engines.add("int4", weights="int4", kv_dtype="bf16", integrity="off", max_num_seqs=1, num_pages=64, **common)
    engines.add("bf16 ownership", weights="bf16", kv_dtype="bf16", integrity="ownership", max_num_seqs=64,
                num_pages=64 * 70, **common)
    engines.add("bf16 full", weights="bf16", kv_dtype="bf16", integrity="full", max_num_seqs=64, num_pages=64 * 70,
                **common)
    engines.add("kv fp8", weights="bf16", kv_dtype="fp8", integrity="off", max_num_seqs=128,
                num_pages=2 * kv_tokens_bf16 // 16, **common)
    engines.add("smollm2", model="smollm2-135m", weights="bf16", kv_dtype="bf16", integrity="off", max_num_seqs=1,
                num_pages=64)
    points = {
        "batch-1 decode, BF16 weights": ("bf16", 1, 512),
        "batch-1 decode, BF16 weights, eager": ("bf16 eager", 1, 512),
        "batch-1 decode, FP8 weights": ("fp8", 1, 512),
        "batch-1 decode, INT4 weights": ("int4", 1, 512),
        "SmolLM2-135M batch-1 decode": ("smollm2", 1, 512),
        "BF16 KV, batch 64 x 4K": ("bf16", 64, 4096),
        "FP8 KV, batch 64 x 4K": ("kv fp8", 64, 4096),
        "FP8 KV, batch 128 x 4K": ("kv fp8", 128, 4096),
        "integrity off, batch 1 x 1K": ("bf16", 1, 1024),
        "integrity ownership, batch 1 x 1K": ("bf16 ownership", 1, 1024),
        "integrity full, batch 1 x 1K": ("bf16 full", 1, 1024),
        "integrity off, batch 64 x 1K": ("bf16", 64, 1024),
        "integrity ownership, batch 64 x 1K": ("bf16 ownership", 64, 1024),
        "integrity full, batch 64 x 1K": ("bf16 full", 64, 1024),
    }
    times: dict[str, list[float]] = {label: [] for label in points}
    try:
        for _ in range(rounds):
            for label, (engine, batch, context) in points.items():
                times[label] += engines.decode_s(engine, batch, context)
        memory = {label: llm.memory_by_rank()[0] for label, llm in engines.engines.items()}
    finally:
        engines.close()
    step = {label: statistics.median(values) for label, values in times.items()}
    tokens_per_s = {label: points[label][1] / seconds for label, seconds in step.items()}
    ratios = {
        "bf16 step / matmul graph floor (target <= 2.0)": step["batch-1 decode, BF16 weights"] / floor_1,
        "bf16 eager / bf16 graphs": step["batch-1 decode, BF16 weights, eager"] / step["batch-1 decode, BF16 weights"],
        "smollm2 batch-1 step ms (target < 3)": step["SmolLM2-135M batch-1 decode"] * 1e3,
        "int4 speed / bf16 (issue 46: >= 2.0 at 32 layers)": step["batch-1 decode, BF16 weights"]
        / step["batch-1 decode, INT4 weights"],
        "int4 speed / fp8 (issue 46: >= 1.3)": step["batch-1 decode, FP8 weights"] / step["batch-1 decode, INT4 weights"],
        "fp8 speed / bf16 (issue 46: >= 1.5)": step["batch-1 decode, BF16 weights"] / step["batch-1 decode, FP8 weights"],
        "fp8 kv x2 batch tokens/s / bf16 kv (issue 46: >= 1.3)": tokens_per_s["FP8 KV, batch 128 x 4K"]
        / tokens_per_s["BF16 KV, batch 64 x 4K"],
        "fp8 kv / bf16 kv same batch, speed (issue 46: >= 1.0)": step["BF16 KV, batch 64 x 4K"]
        / step["FP8 KV, batch 64 x 4K"],
        "ownership / off, batch 1 (target <= 1.01)": step["integrity ownership, batch 1 x 1K"]
        / step["integrity off, batch 1 x 1K"],
        "ownership / off, batch 64 (target <= 1.01)": step["integrity ownership, batch 64 x 1K"]
        / step["integrity off, batch 64 x 1K"],
        "full / off, batch 64": step["integrity full, batch 64 x 1K"] / step["integrity off, batch 64 x 1K"],
    }
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": rounds,
            "copy_gb_s": round(copy_gb_s, 1), "matmul_floor_batch1_s": floor_1,
            "floor_weight_bytes": weight_bytes, "weight_streaming_floor_s": weight_bytes / (copy_gb_s * 1e9 / 2),
            "step_s": step, "tokens_per_s": tokens_per_s, "ratios": {k: round(v, 3) for k, v in ratios.items()},
            "engine_memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each times every point)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_seed_effects.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("bench/gpu_seed_effects.py needs a CUDA device; this machine has none", file=sys.stderr)
        raise SystemExit(EXIT_NO_CUDA)
    result = run(args.rounds)
    print(f"{result['device']}: copy {result['copy_gb_s']:.0f} GB/s, batch-1 matmul graph floor "
          f"{result['matmul_floor_batch1_s'] * 1e3:.3f} ms, weight streaming floor "
          f"{result['weight_streaming_floor_s'] * 1e3:.3f} ms", file=sys.stderr)
    print(f"{'point':42s} {'step ms':>9s} {'tokens/s':>10s}", file=sys.stderr)
    for label, seconds in result["step_s"].items():
        print(f"{label:42s} {seconds * 1e3:9.3f} {result['tokens_per_s'][label]:10.0f}", file=sys.stderr)
    for label, ratio in result["ratios"].items():
        print(f"{label:58s} {ratio:8.3f}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
