"""Decode throughput of the engine against transformers' `generate`, same prompts, same run, fp32 on CPU.

Both sides generate exactly `--new-tokens` tokens per prompt (EOS ignored); throughput is completion
tokens over wall time of the whole call, the median of interleaved repetitions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.core.reference_text import cut_prompts, reference_text
from engine.core.sequence import SamplingParams
from engine.llm import LLM
from engine.model.loader import resolve

RESULTS = Path(__file__).resolve().parent / "results"


def english_prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    return cut_prompts(llm.tokenizer.encode(reference_text(slice(60))), [length] * count, stride=200)


def time_engine(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == new_tokens for r in results)
    return len(prompts) * new_tokens / elapsed


def time_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])          # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_vs_hf.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    llm = LLM(model="smollm2-135m", weights="fp32", device="cpu")
    gguf = resolve("smollm2-135m").path
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    prompts = english_prompts(llm, 16, args.prompt_tokens)
    samples: dict[str, list[float]] = {}
    for batch in (1, 16):
        batch_prompts = prompts[:batch]
        time_engine(llm, batch_prompts, 4)                         # warm-up both
        time_hf(hf, batch_prompts, 4, pad_id=2)
        for _ in range(args.repeats):
            samples.setdefault(f"engine_tok_s_b{batch}", []).append(time_engine(llm, batch_prompts, args.new_tokens))
            samples.setdefault(f"hf_tok_s_b{batch}", []).append(time_hf(hf, batch_prompts, args.new_tokens, 2))
    result = {key: round(statistics.median(values), 2) for key, values in samples.items()}
    result = {key: result[key] for key in ("engine_tok_s_b1", "engine_tok_s_b16", "hf_tok_s_b1", "hf_tok_s_b16")}
    ratios = {f"speedup_b{b}": round(result[f"engine_tok_s_b{b}"] / result[f"hf_tok_s_b{b}"], 2) for b in (1, 16)}
    report = {**result, **ratios, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
              "repeats": args.repeats, "threads": torch.get_num_threads(), "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'batch':>5} {'engine tok/s':>13} {'hf tok/s':>9} {'speedup':>8}", file=sys.stderr)
    for b in (1, 16):
        print(f"{b:>5} {result[f'engine_tok_s_b{b}']:>13.1f} {result[f'hf_tok_s_b{b}']:>9.1f} "
              f"{ratios[f'speedup_b{b}']:>7.2f}x", file=sys.stderr)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
