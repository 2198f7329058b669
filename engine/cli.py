"""`engine` command line: generate and info. Thin: the work is done by `engine.llm` and `engine.memory`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from engine.config import KV_DTYPES, WEIGHT_DTYPES, EngineConfig
from engine.errors import EngineError, RequestError

EXIT_BAD_INPUT = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), like every other bad input."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m, a .gguf file, a Hugging Face folder or a config.json (random weights)")
    parser.add_argument("--weights", default="fp32", help=f"weight dtype: {'|'.join(WEIGHT_DTYPES)}")
    parser.add_argument("--kv-dtype", default=None, help=f"KV cache dtype: {'|'.join(KV_DTYPES)} (default: weights)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="KV cache budget in GiB (default: 1 GiB on CPU, 90%% of the GPU less what is in use)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="engine", description="A paged-KV inference engine for Llama-family models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    generate = commands.add_parser("generate", help="generate text for one prompt")
    _engine_options(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    generate.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")

    info = commands.add_parser("info", help="memory arithmetic of a model: weights, KV per token, pages")
    _engine_options(info)
    return parser


def _emit(payload: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(payload) if as_json else text)


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.llm import LLM
    from engine.sequence import SamplingParams

    if not args.prompt.strip():
        raise RequestError("the prompt is empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    config = EngineConfig(model=args.model, weights=args.weights, kv_dtype=args.kv_dtype, device=args.device,
                          page_size=args.page_size, kv_cache_gib=args.memory_gib)
    llm = LLM(config)
    prompt = args.prompt
    if not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    result = llm.generate([prompt], params)[0]
    _emit({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
           "prompt_tokens": len(result.prompt_token_ids), "completion_tokens": len(result.token_ids)},
          args.json, result.text)


def cmd_info(args: argparse.Namespace) -> None:
    from engine.llm import CPU_DEFAULT_KV_GIB, kv_layout
    from engine.loader import read_model_config, resolve
    from engine.memory import GIB, kv_bytes_per_token, kv_pages_for_budget, weight_bytes

    config = EngineConfig(model=args.model, weights=args.weights, kv_dtype=args.kv_dtype, page_size=args.page_size,
                          kv_cache_gib=args.memory_gib)
    model_config = read_model_config(resolve(config.model))
    layout = kv_layout(model_config, config.resolved_kv_dtype)
    budget = int((config.kv_cache_gib or CPU_DEFAULT_KV_GIB) * GIB)
    pages = kv_pages_for_budget(budget, layout, config.page_size)
    payload = {
        "weight_bytes": weight_bytes(model_config.num_parameters, config.weights),
        "kv_bytes_per_token": kv_bytes_per_token(layout),
        "page_size": config.page_size,
        "kv_pages": pages,
        "kv_capacity_tokens": pages * config.page_size,
    }
    _emit(payload, args.json, "\n".join(f"{key:20s} {value}" for key, value in payload.items()))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "info": cmd_info}[args.command](args)
    except EngineError as error:
        print(f"engine: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
