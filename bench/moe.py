"""MoE decode on CPU: the engine against transformers' DeepSeek-V3 on the same weights, and the engine's MoE
layer (grouped by expert) against a loop over tokens.

The model is Kimi K2.6 at full width (hidden 7168, 64 heads, MLA 512 + 64, experts of 2048) cut to
`--layers` layers (a dense first layer, then MoE) and `--experts` routed experts, with the vocabulary cut to
`--vocab` so that both copies fit in memory (the head is the same matmul on both sides). Random weights are
saved by transformers and loaded by the engine from that folder, fp32. A decode step's time is the median
over the steps of a greedy generation of `--new-tokens` tokens at batch 1 and 16 (each side's own cache),
the two sides' steps timed alternately so that a machine slowing down slows both; its achieved GB/s is the weights it must read (everything but the routed experts, plus the experts the
step's tokens touch, counted from the engine's router) over that time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.core.memory import dtype_bytes
from engine.core.sequence import SamplingParams
from engine.llm import LLM
from engine.model.layers.moe import MoE, Router

RESULTS = Path(__file__).resolve().parent / "results"
KIMI = Path(__file__).resolve().parent.parent / "planner" / "data" / "model-configs" / "kimi-k2.6.json"


def kimi_cut(layers: int, experts: int, vocab: int) -> dict:
    text = json.loads(KIMI.read_text())["text_config"]
    drop = ("auto_map", "architectures", "quantization_config", "_name_or_path")
    config = {k: v for k, v in text.items() if k not in drop}
    config.update(num_hidden_layers=layers, n_routed_experts=experts, vocab_size=vocab, bos_token_id=0,
                  eos_token_id=1, pad_token_id=None)
    return config


def save_random_model(config: dict, folder: Path):
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    model.save_pretrained(folder)
    return model


def prompts(batch: int, prompt_tokens: int) -> list[list[int]]:
    return [[2 + (index * 7 + i) % 1000 for i in range(prompt_tokens)] for index in range(batch)]


def lockstep_decode_times(llm: LLM, model, batch: int, prompt_tokens: int,
                          new_tokens: int) -> tuple[list[float], list[float], list[int]]:
    """Seconds of each decode step of the engine and of transformers, timed alternately (engine step,
    transformers step, ...) so that both see the same machine, and the distinct experts per MoE layer each
    engine step touched."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts(batch, prompt_tokens):
        llm.add_request(prompt, params)
    touched: list[int] = []
    in_step: list[int] = []
    routers = [m for m in llm.core.model.modules() if isinstance(m, Router)]
    hooks = [r.register_forward_hook(lambda _m, _i, out: in_step.append(int(out[1].unique().numel())))
             for r in routers]
    engine_times: list[float] = []
    hf_times: list[float] = []
    try:
        with torch.inference_mode():
            out = model(torch.tensor(prompts(batch, prompt_tokens)), use_cache=True)
        cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        while llm.has_unfinished():
            running = llm.core.scheduler.running
            decoding = bool(running) and not llm.core.scheduler.waiting and all(
                seq.num_computed_tokens >= len(seq.prompt_token_ids) for seq in running)
            in_step.clear()
            start = time.perf_counter()
            llm.step()
            if not decoding:
                continue
            engine_times.append(time.perf_counter() - start)
            touched.extend(in_step)
            with torch.inference_mode():
                start = time.perf_counter()
                out = model(token, cache=cache, use_cache=True)
                hf_times.append(time.perf_counter() - start)
            cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    finally:
        for hook in hooks:
            hook.remove()
    return engine_times, hf_times, touched


def moe_layer_vs_token_loop(llm: LLM, tokens: int, repeats: int) -> dict:
    """The engine's MoE module against the same experts run token by token, expert by expert."""
    moe = next(m for m in llm.core.model.modules() if isinstance(m, MoE))
    x = torch.randn(tokens, llm.model_config.hidden_size) * 0.5

    def token_loop() -> torch.Tensor:
        weights, ids = moe.gate(x)
        out = torch.zeros_like(x)
        for t in range(tokens):
            for k in range(ids.shape[1]):
                out[t] += weights[t, k] * moe.experts.expert(int(ids[t, k]), x[t:t + 1])[0]
        return out + moe.shared_experts(x)

    with torch.inference_mode():
        grouped, looped = moe(x), token_loop()
        error = float((grouped - looped).norm() / looped.norm())
        timings = {"grouped_s": [], "token_loop_s": []}
        for _ in range(repeats):
            for name, run in (("grouped_s", lambda: moe(x)), ("token_loop_s", token_loop)):
                start = time.perf_counter()
                run()
                timings[name].append(time.perf_counter() - start)
    return {"tokens": tokens, "relative_error": error, **{k: statistics.median(v) for k, v in timings.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    args = parser.parse_args()
    config = kimi_cut(args.layers, args.experts, args.vocab)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = save_random_model(config, Path(folder))
        llm = LLM(model=folder, kv_dtype="fp32", num_pages=64 * max(args.batches), page_size=16,
                  max_num_seqs=max(args.batches))
        spec = llm.model_config
        parts = spec.components()
        element = dtype_bytes("fp32")
        expert_bytes = element * spec.expert_parameters
        fixed_bytes = element * (spec.total_parameters - parts["routed_experts"].parameters
                                 - parts["embeddings"].parameters)
        for batch in args.batches:
            engine_times, hf_times, touched = lockstep_decode_times(llm, model, batch, args.prompt_tokens,
                                                                    args.new_tokens)
            per_step_touched = statistics.mean(touched) if touched else 0
            weights_read = fixed_bytes + spec.ffn.moe_layers * per_step_touched * expert_bytes
            engine_s, hf_s = statistics.median(engine_times), statistics.median(hf_times)
            rows.append({"batch": batch, "engine_step_s": engine_s, "transformers_step_s": hf_s,
                         "engine_vs_transformers": hf_s / engine_s, "experts_touched_per_layer": per_step_touched,
                         "weights_read_bytes": weights_read, "engine_gb_s": weights_read / engine_s / 1e9,
                         "transformers_gb_s": weights_read / hf_s / 1e9})
            print(f"batch {batch:3d}: engine {engine_s * 1e3:8.1f} ms  transformers {hf_s * 1e3:8.1f} ms  "
                  f"(engine {hf_s / engine_s:.2f}x)  experts touched/layer {per_step_touched:.1f}  "
                  f"{rows[-1]['engine_gb_s']:.1f} vs {rows[-1]['transformers_gb_s']:.1f} GB/s", file=sys.stderr)
        layer = moe_layer_vs_token_loop(llm, 16, 3)
        print(f"MoE layer, 16 tokens: grouped {layer['grouped_s'] * 1e3:.1f} ms, token loop "
              f"{layer['token_loop_s'] * 1e3:.1f} ms (error {layer['relative_error']:.1e})", file=sys.stderr)
    result = {"model": {"base": "kimi-k2.6", "layers": args.layers, "experts": args.experts, "vocab": args.vocab,
                        "dtype": "fp32", "threads": torch.get_num_threads()},
              "decode": rows, "moe_layer": layer}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
