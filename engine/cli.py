"""`engine` command line: generate, info, eval, profile and serve. Thin: the work is done in the engine's modules."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from engine.core.config import INTEGRITY_MODES, KV_DTYPES, WEIGHT_DTYPES, EngineConfig
from engine.core.errors import EXIT_BAD_INPUT, ConfigError, EngineError, OneLineParser, RequestError

DEFAULT_MAX_BODY_BYTES = 4 << 20       # engine.server.app's default (the server is imported only to serve)


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m, a .gguf file, a Hugging Face folder or a config.json (random weights)")
    parser.add_argument("--weights", default="fp32",
                        help=f"weights: {'|'.join(WEIGHT_DTYPES)} (native: as the checkpoint ships, e.g. GGUF Q4_1)")
    parser.add_argument("--group-size", type=int, default=128, help="INT4 group size: 32, 64 or 128")
    parser.add_argument("--symmetric", action="store_true", help="symmetric INT4 grid (no per-group minimum)")
    parser.add_argument("--kv-dtype", default=None,
                        help=f"KV cache dtype: {'|'.join(KV_DTYPES)} (default: the compute dtype)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="KV cache budget in GiB (default: 1 GiB on CPU, 90%% of the GPU less what is in use)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for the engine's kernels (default: one per core)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep the first N decoder layers of a big config (nothing else changes)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="keep the first E routed experts of each MoE layer (top-k..the config's)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="ranks of tensor parallelism: worker processes this command starts (gloo on CPU, "
                             "NCCL on GPUs 0..N-1)")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="deal the routed experts out whole over the --tensor-parallel ranks")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="recompute every prompt instead of reusing the KV pages of a prefix computed before")
    parser.add_argument("--speculative", default=None, metavar="METHOD:K",
                        help="speculative decoding: ngram:K proposes the K tokens that followed the latest earlier "
                             "occurrence of the last tokens (prompt lookup)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly (on CUDA, decode steps otherwise replay CUDA graphs)")
    parser.add_argument("--max-graph-batch", type=int, default=None, metavar="N",
                        help="capture decode graphs for batches up to N (default: up to --max-num-seqs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="engine", description="A paged-KV inference engine (Llama, DeepSeek-V3 / Kimi).")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    generate = commands.add_parser("generate", help="generate text for one prompt")
    _engine_options(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (wrapped in the chat template unless --raw)")
    prompt.add_argument("--prompt-token-ids", type=int, nargs="+", help="token ids, for models without a tokenizer")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    generate.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    generate.add_argument("--integrity", choices=INTEGRITY_MODES, default="ownership",
                          help="KV-cache integrity checks: off, ownership (page owners checked every step) "
                               "or full (also page checksums)")

    info = commands.add_parser("info", help="memory arithmetic of a model: weights, KV per token, pages")
    _engine_options(info)
    info.add_argument("--load", action="store_true",
                      help="also build the engine on --device and report what each rank holds (weights, KV pool, "
                           "CUDA graphs: their memory and capture time)")
    info.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (with --load)")

    evaluate = commands.add_parser("eval", help="perplexity on a fixed English text shipped with Python")
    _engine_options(evaluate)
    evaluate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evaluate.add_argument("--window", type=int, default=512, help="tokens per scored window")
    evaluate.add_argument("--windows", type=int, default=8, help="number of consecutive windows")
    profile = commands.add_parser("profile", help="time real engine steps (prefill, decode, mixed) into a profile")
    _engine_options(profile)
    profile.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    profile.add_argument("--out", required=True, help="where to write the profile JSON")
    profile.add_argument("--prefill-tokens", type=int, nargs="+", default=None, help="prefill sizes to time")
    profile.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes")
    profile.add_argument("--contexts", type=int, nargs="+", default=None, help="decode context lengths")
    profile.add_argument("--repeats", type=int, default=3, help="timed repetitions per point (median kept)")
    profile.add_argument("--warmup", type=int, default=1, help="untimed steps before each point")
    profile.add_argument("--max-kv-tokens", type=int, default=None,
                         help="leave out decode and mixed points reading more cached tokens than this")
    profile.add_argument("--seed", type=int, default=0)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, /metrics)")
    _engine_options(serve)
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--max-num-seqs", type=int, default=256, help="largest running batch")
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (prefill chunks)")
    serve.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    serve.add_argument("--integrity", choices=INTEGRITY_MODES, default="ownership", help="KV-cache integrity checks")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--step-trace", default=None, metavar="FILE",
                       help="append every step (start, duration, batch) to FILE as JSON lines")
    serve.add_argument("--api-key", default=os.environ.get("KVPLAN_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 (default: $KVPLAN_API_KEY; without a key "
                            "serve on loopback only)")
    serve.add_argument("--metrics-api-key", default=os.environ.get("KVPLAN_METRICS_API_KEY"),
                       help="require this key on /metrics too (default: $KVPLAN_METRICS_API_KEY; else /metrics is open)")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's context)")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body; larger ones get 413")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds requests in flight may run on after SIGTERM before they are aborted")
    serve.add_argument("--fault-injection", action="store_true",
                       help="testing only: POST /debug/faults injects KV-cache integrity faults (the chaos soak)")
    serve.add_argument("--role", choices=("single", "prefill", "decode"), default="single",
                       help="disaggregated serving: prefill answers POST /v1/prefill with a prompt's KV pages; decode "
                            "pulls them for requests that name a prefill replica (engine proxy sends those)")

    proxy = commands.add_parser("proxy", help="one OpenAI endpoint in front of prefill and decode replicas (xPyD)")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill replicas (--role prefill)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode replicas (--role decode)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    return parser


def engine_config(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    return EngineConfig(model=args.model, weights=args.weights, kv_dtype=args.kv_dtype, page_size=args.page_size,
                        kv_cache_gib=args.memory_gib, group_size=args.group_size, int4_symmetric=args.symmetric,
                        num_threads=args.threads, num_layers=args.num_layers, num_experts=args.num_experts,
                        tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel,
                        enable_prefix_caching=args.prefix_caching, speculative=args.speculative,
                        enforce_eager=args.enforce_eager, max_graph_batch=args.max_graph_batch, **extra)


def _emit(payload: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(payload) if as_json else text)


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.core.sequence import SamplingParams
    from engine.llm import LLM

    if args.prompt is not None and not args.prompt.strip():
        raise RequestError("the prompt is empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    with LLM(engine_config(args, device=args.device, integrity=args.integrity)) as llm:
        prompt = args.prompt if args.prompt is not None else args.prompt_token_ids
        if args.prompt is not None and not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        result = llm.generate([prompt], params)[0]
    payload = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "prompt_tokens": len(result.prompt_token_ids), "completion_tokens": len(result.token_ids)}
    if args.speculative is not None:
        payload.update(llm.draft_stats.summary(), acceptance_rate=llm.acceptance_rate)
    _emit(payload, args.json, result.text)


def cmd_info(args: argparse.Namespace) -> None:
    from engine.core.memory import kv_bytes_per_token, kv_layout, kv_scale_bytes
    from engine.model.loader import check_shardable, read_model_config, resolve, weight_bytes_report
    from engine.model.sharding import rank_spec

    config = engine_config(args)
    source = resolve(config.model)
    check_shardable(config.model, config)
    if config.expert_parallel:
        raise ConfigError("engine info --expert-parallel: a rank's experts are `planner plan --expert-parallel`'s "
                          "per-GPU bytes; info prints tensor-parallel shares only")
    model_config = rank_spec(read_model_config(source).truncated(config.num_layers, config.num_experts),
                             config.tensor_parallel)       # one rank's share (all of it on one device)
    layout = kv_layout(model_config, config.resolved_kv_dtype(on_gpu=False))
    pages = config.kv_pool_pages(layout)
    weights = weight_bytes_report(source, model_config, config)
    payload = {
        "tensor_parallel": config.tensor_parallel,
        "weight_bytes": weights["weight_bytes"],
        "linear_weight_bytes": weights["linear_weight_bytes"],
        "weight_bytes_by_component": weights["weight_bytes_by_component"],
        "weight_bytes_by_dtype": weights["weight_bytes_by_dtype"],
        "kv_bytes_per_token": kv_bytes_per_token(layout),
        "kv_scale_bytes": kv_scale_bytes(layout),
        "page_size": config.page_size,
        "kv_pages": pages,
        "kv_capacity_tokens": pages * config.page_size,
    }
    if args.load:
        from engine.llm import LLM

        with LLM(engine_config(args, device=args.device)) as llm:
            payload["ranks"] = llm.memory_by_rank()
    _emit(payload, args.json, "\n".join(f"{key:22s} {value}" for key, value in payload.items()))


def cmd_eval(args: argparse.Namespace) -> None:
    from engine.harness.perplexity import perplexity
    from engine.llm import LLM

    with LLM(engine_config(args, device=args.device)) as llm:
        result = perplexity(llm, args.window, args.windows)
    payload = {"perplexity": result.perplexity, "tokens": result.tokens, "kv_dtype": llm.kv_layout.dtype,
               "weights": args.weights}
    _emit(payload, args.json, f"perplexity {result.perplexity:.4f} over {result.tokens} tokens "
                              f"(weights {args.weights}, kv {llm.kv_layout.dtype})")


def cmd_profile(args: argparse.Namespace) -> None:
    from dataclasses import replace
    from pathlib import Path

    from engine.harness.profiler import Profiler, SweepPlan
    from engine.llm import LLM

    plan = SweepPlan(warmup=args.warmup, repeats=args.repeats, max_kv_tokens=args.max_kv_tokens)
    for name, value in (("prefill_tokens", args.prefill_tokens), ("decode_batches", args.batches),
                        ("decode_contexts", args.contexts)):
        if value is not None:
            plan = replace(plan, **{name: tuple(value)})
    out = Path(args.out)
    if out.parent and not out.parent.is_dir():
        raise ConfigError(f"the folder of --out {str(out)!r} does not exist")
    with LLM(engine_config(args, device=args.device, max_num_batched_tokens=max(max(plan.prefill_tokens), 2048),
                           seed=args.seed)) as llm:
        profile = Profiler(llm, plan, args.seed).run()
    out.write_text(json.dumps(profile, indent=1) + "\n")
    summary = {"out": str(out), "samples": len(profile["samples"]), "fingerprint": profile["fingerprint"]}
    _emit(summary, args.json, f"{len(profile['samples'])} points written to {out}")


def cmd_serve(args: argparse.Namespace) -> None:
    from engine.harness.fault_campaign import inject
    from engine.llm import LLM
    from engine.server.app import ServerConfig, run_server

    config = ServerConfig(args.served_model_name or args.model, args.host, args.port, args.max_waiting,
                          args.step_trace, args.api_key, args.metrics_api_key, args.max_body_bytes,
                          args.drain_timeout, args.role)
    with LLM(engine_config(args, device=args.device, integrity=args.integrity, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                           max_model_len=args.max_model_len)) as llm:
        print(config.startup_notice(llm.capacity_tokens), file=sys.stderr, flush=True)
        run_server(llm, config, inject if args.fault_injection else None)


def cmd_proxy(args: argparse.Namespace) -> None:
    from engine.server.proxy import ProxyConfig, run_proxy

    config = ProxyConfig(tuple(args.prefill), tuple(args.decode), args.host, args.port)
    print(f"engine: proxy on http://{config.host}:{config.port}: {len(config.prefill_urls)} prefill and "
          f"{len(config.decode_urls)} decode replicas", file=sys.stderr, flush=True)
    run_proxy(config)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "info": cmd_info, "eval": cmd_eval, "profile": cmd_profile,
         "serve": cmd_serve, "proxy": cmd_proxy}[args.command](args)
    except EngineError as error:
        print(f"engine: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
