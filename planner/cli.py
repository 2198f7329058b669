"""`planner` command line. Thin: the work is done in the planner's modules."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.errors import EXIT_BAD_INPUT, OneLineParser
from planner.catalog.engines import ENGINES, check_engine
from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.simulation.workload import Workload


def _emit(payload: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(payload) if as_json else text)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="planner", description="Capacity planning for LLM serving, calibrated on a real engine.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    calibrate = commands.add_parser("calibrate", help="fit the step-time model to an engine profile, a live server or "
                                                      "serving benchmark results")
    calibrate.add_argument("profile", nargs="?", help="a profile written by `engine profile`")
    calibrate.add_argument("other_depths", nargs="*", metavar="profile_at_other_depth",
                           help="profiles of the same setup at other --num-layers: the cost per kernel is fitted too")
    calibrate.add_argument("--out", required=True, help="where to write the calibration JSON")
    calibrate.add_argument("--max-mape", type=float, default=None,
                           help="refuse a fit whose error in any regime is above this percentage (default 15)")
    calibrate.add_argument("--endpoint", default=None,
                           help="an OpenAI-compatible server (kvplan, vLLM, SGLang) to time from the outside")
    calibrate.add_argument("--benchmark", nargs="+", default=None, metavar="FILE",
                           help="serving benchmark results: vLLM --save-result JSON, SGLang bench_serving JSONL, "
                                "guidellm report JSON, or the planner's CSV (planner/data/benchmarks/README.md)")
    calibrate.add_argument("--model", default=None,
                           help="--endpoint, --benchmark: the model it serves (a preset or config.json)")
    calibrate.add_argument("--hardware", default=None, help="--endpoint, --benchmark: the GPU kind it runs on")
    calibrate.add_argument("--gpus", type=int, default=None, help="--endpoint (default 1), --benchmark: GPUs of one "
                                                                 "replica")
    calibrate.add_argument("--tp", type=int, default=None, help="tensor parallelism (default: all GPUs)")
    calibrate.add_argument("--expert-parallel", action="store_true", help="experts spread over the GPUs")
    calibrate.add_argument("--weights", default=None,
                           help="the weights it serves, as the planner names them (--endpoint default: bf16)")
    calibrate.add_argument("--kv", default=None, help="its KV dtype (--endpoint default: bf16)")
    calibrate.add_argument("--hold-out", default="", metavar="MODELS",
                           help="--benchmark: comma-separated models whose points are predicted, not fitted")
    calibrate.add_argument("--max-cv-error", type=float, default=None,
                           help="--benchmark: refuse a fit whose cross-validated median error of TPOT, ITL or "
                                "output tokens/s is above this percentage (default 25)")
    calibrate.add_argument("--served-model-name", default=None, help="--endpoint: default: the first of /v1/models")
    calibrate.add_argument("--prefill-tokens", type=int, nargs="+", default=None,
                           help="--endpoint: prompts timed alone")
    calibrate.add_argument("--batches", type=int, nargs="+", default=None, help="--endpoint: decode batches timed")
    calibrate.add_argument("--repeats", type=int, default=None, help="--endpoint: timings per prefill or mixed point")
    calibrate.add_argument("--decode-output-tokens", type=int, default=None,
                           help="--endpoint: tokens each decode stream generates (default 32; a slow server: fewer)")
    calibrate.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    plan = commands.add_parser("plan", help="memory, capacity, throughput and cost of one deployment")
    _deployment_options(plan)
    plan.add_argument("--weights", default="native", help="bf16|fp8|int4|nvfp4 (Blackwell)|native")
    plan.add_argument("--kv", default="fp8", help="bf16|fp8|nvfp4 (Blackwell)")
    plan.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                      help="a system prompt every request opens with: its pages are held once (prefix caching)")
    _disaggregation_options(plan)

    compare = commands.add_parser("compare", help="several weight/KV dtype configurations side by side")
    _deployment_options(compare)
    compare.add_argument("--weights", nargs="+", default=["bf16", "fp8", "int4", "native"], help="weight dtypes")
    compare.add_argument("--kv", nargs="+", default=["bf16", "fp8"], help="KV dtypes")

    simulate = commands.add_parser("simulate", help="discrete-event simulation of a workload on the deployment")
    _deployment_options(simulate)
    simulate.add_argument("--weights", default="native", help="bf16|fp8|int4|nvfp4 (Blackwell)|native")
    simulate.add_argument("--kv", default="fp8", help="bf16|fp8|nvfp4 (Blackwell)")
    _workload_options(simulate, requests=1000, prompt="1024", output="256")
    simulate.add_argument("--users", type=int, default=None, help="closed loop: concurrent users")
    simulate.add_argument("--router", default="least-loaded", help="round-robin or least-loaded")
    simulate.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds, for goodput")
    simulate.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds, for goodput")
    _disaggregation_options(simulate)

    search = commands.add_parser("search", help="the cheapest deployments that meet latency SLOs, by simulation")
    search.add_argument("--model", required=True, help="a preset name or a path to a config.json")
    search.add_argument("--slo", required=True, help="e.g. ttft_p99_s=2,tpot_p99_s=0.05")
    search.add_argument("--workload", default="chat", help="chat, rag, summarize or code: prompt and output lengths")
    search.add_argument("--prompt-tokens", default=None, help="N, uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA (overrides)")
    search.add_argument("--output-tokens", default=None, help="as --prompt-tokens")
    search.add_argument("--requests", type=int, default=200, help="requests each simulation runs")
    _prefix_options(search)
    search.add_argument("--speculative", default=None, metavar="METHOD:K",
                        help="also try every candidate with speculative decoding (ngram:K or mtp:K)")
    search.add_argument("--acceptance", default=None, metavar="RATE[,RATE...]",
                        help="with --speculative: per-position acceptance (mtp default: 0.875)")
    search.add_argument("--seed", type=int, default=0)
    search.add_argument("--hardware", default="h100-sxm,h200,b200", help="comma-separated GPU kinds")
    search.add_argument("--max-gpus", type=int, default=8,
                        help="largest tensor-parallel group (powers of two), and the most GPUs a disaggregated pair "
                             "of pools may take")
    search.add_argument("--disaggregate", default=None, metavar="auto|xPyD[,xPyD...]",
                        help="also try every candidate as prefill and decode pools of its engine instance "
                             "(auto: 1P1D,1P2D,1P3D,2P1D)")
    search.add_argument("--weights", default=None, help="comma-separated (default bf16,fp8,int4,nvfp4 on Blackwell)")
    search.add_argument("--kv", default=None, help="comma-separated KV dtypes (default bf16,fp8)")
    search.add_argument("--max-num-seqs", default="64,256", help="comma-separated decode batch limits")
    search.add_argument("--chunks", default="2048,8192", help="comma-separated prefill chunk budgets (tokens)")
    search.add_argument("--target-rate", type=float, default=None, help="requests/s: the cheapest fleet for it")
    _engine_option(search)
    search.add_argument("--top", type=int, default=3, help="deploy commands for this many of the best")
    search.add_argument("--ray", default=None, metavar="auto|local|ADDRESS",
                        help="simulate on Ray (local: start one here) instead of a local process pool")
    search.add_argument("--workers", type=int, default=None, help="processes (or Ray CPUs with --ray local)")
    search.add_argument("--cache-dir", default=None, help="where results are cached (default ~/.cache/kvplan/search)")
    search.add_argument("--no-cache", action="store_true", help="simulate everything again")
    search.add_argument("--out", default=None, help="folder for ranked.csv, pareto.csv, pareto.html, search.json")
    search.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    verify = commands.add_parser("verify", help="a workload through the engine here (or a live server) and the "
                                                "simulator; the error per metric")
    verify.add_argument("--profile", default=None, help="a CPU profile written by `engine profile`")
    verify.add_argument("--endpoint", default=None, help="a live OpenAI-compatible server instead of the engine here")
    verify.add_argument("--calibration", default=None,
                        help="--endpoint: its calibration (planner calibrate --endpoint)")
    verify.add_argument("--served-model-name", default=None, help="--endpoint: default: the first of /v1/models")
    verify.add_argument("--speculative", default=None, metavar="ngram:K",
                        help="--profile: the engine drafts by prompt lookup over prompts that repeat themselves; the "
                             "simulator draws drafts and acceptance as the engine measured them")
    _workload_options(verify, requests=30)
    verify.add_argument("--kv-cache-gib", type=float, default=None,
                        help="the engine's KV pool in GiB (default 0.25; with --endpoint: the server's, if it was "
                             "given one)")
    verify.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (--endpoint: what /metrics says)")
    verify.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default 2048 (--endpoint: what /metrics says)")
    verify.add_argument("--max-model-len", type=int, default=None, help="--endpoint: if /metrics does not say")
    verify.add_argument("--page-size", type=int, default=None, help="--endpoint: if /metrics does not say")
    verify.add_argument("--capacity-tokens", type=int, default=None, help="--endpoint: if /metrics does not say")
    verify.add_argument("--disaggregate", action="store_true",
                        help="--profile: a prefill engine and a decode engine (1P1D) against the simulator's pools")
    verify.add_argument("--decode-kv-cache-gib", type=float, default=None,
                        help="--disaggregate: the decode engine's KV pool (default: --kv-cache-gib)")
    verify.add_argument("--out-dir", default=None, help="where to write report.md and figure.html")
    verify.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def _workload_options(parser: argparse.ArgumentParser, requests: int, prompt: str = "128",
                      output: str = "32") -> None:
    parser.add_argument("--workload", default="poisson", help="poisson, gamma, closed (simulate) or trace")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (poisson, gamma)")
    parser.add_argument("--burstiness", type=float, default=2.0, help="gamma: coefficient of variation of gaps")
    parser.add_argument("--trace", default=None, help="JSONL of {arrival_s, prompt_tokens, output_tokens}")
    parser.add_argument("--requests", type=int, default=requests, help="number of requests")
    parser.add_argument("--prompt-tokens", default=prompt, help="N, uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA")
    parser.add_argument("--output-tokens", default=output, help="N, uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA")
    parser.add_argument("--seed", type=int, default=0)
    _prefix_options(parser)


def _prefix_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                        help="a system prompt of this many tokens every conversation opens with")
    parser.add_argument("--turns", type=int, default=1,
                        help="requests per conversation: each turn's prompt is the conversation so far plus a new "
                             "message of --prompt-tokens (--rate stays requests per second)")
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="seconds between a request's end and its user's next one (closed loop, next turn)")


def cmd_verify(args: argparse.Namespace) -> None:
    from planner.simulation.workload import LengthDistribution, Workload
    from planner.verification.verify import markdown_report, verify

    workload = Workload(arrival=args.workload, num_requests=args.requests, rate=args.rate,
                        burstiness=args.burstiness, prompt=LengthDistribution.parse(args.prompt_tokens),
                        output=LengthDistribution.parse(args.output_tokens), trace=args.trace, seed=args.seed,
                        think_time_s=args.think_time, shared_prefix_tokens=args.shared_prefix, turns=args.turns)
    if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
        raise PlannerError(f"--kv-cache-gib must be positive, got {args.kv_cache_gib!r}")
    if (args.profile is None) == (args.endpoint is None):
        raise PlannerError("give --profile (the engine here) or --endpoint (a live server), one of them")
    if args.endpoint is not None:
        _verify_endpoint(args, workload)
        return
    if args.disaggregate:
        from planner.verification.comparison import gate_line
        from planner.verification.disaggregated import verify_disaggregated

        result = verify_disaggregated(args.profile, workload, args.kv_cache_gib or 0.25, args.decode_kv_cache_gib,
                                      args.max_num_seqs or 256, args.max_num_batched_tokens or 2048)
        print(json.dumps(result) if args.json else "\n".join(
            [f"{name:22s} predicted {m['predicted']:.4g}  measured {m['measured']:.4g}  error {m['error_pct']}%"
             for name, m in result["metrics"].items() if m["predicted"] is not None and m["measured"] is not None]
            + [f"hand-off bytes exact   {result['handoff_bytes_exact']}", gate_line(result["gate"])]))
        return
    result = verify(args.profile, workload, args.kv_cache_gib or 0.25, args.max_num_seqs or 256,
                    args.max_num_batched_tokens or 2048, speculative=args.speculative)
    report = markdown_report(result)
    if args.out_dir:
        _write_verification(Path(args.out_dir), report, result)
    if args.json:
        print(json.dumps({key: result[key] for key in ("metrics", "gate", "workload", "fingerprint", "replay", "machine")}))
    else:
        print(report)


def _write_verification(out: Path, report: str, result: dict[str, Any]) -> None:
    from planner.ui.plots import predicted_vs_measured

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report)
    (out / "verification.json").write_text(json.dumps(result, indent=1) + "\n")
    predicted_vs_measured(result).write_html(out / "figure.html", include_plotlyjs="cdn")


def _verify_endpoint(args: argparse.Namespace, workload: Workload) -> None:
    from planner.endpoint.verify import endpoint_report, verify_endpoint

    if args.calibration is None:
        raise PlannerError("--endpoint needs --calibration: make one with `planner calibrate --endpoint`")
    limits = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_model_len": args.max_model_len, "page_size": args.page_size, "capacity_tokens": args.capacity_tokens}
    result = verify_endpoint(args.endpoint, args.calibration, workload, args.kv_cache_gib, limits,
                             args.served_model_name)
    report = endpoint_report(result)
    if args.out_dir:
        _write_verification(Path(args.out_dir), report, result)
    print(json.dumps(result) if args.json else report)


def _deployment_options(parser: argparse.ArgumentParser) -> None:
    from planner.catalog.hardware import hardware_names
    from planner.catalog.models import model_names

    parser.add_argument("--model", required=True, help=f"{', '.join(model_names())}, or a path to a config.json")
    parser.add_argument("--hardware", required=True, help=", ".join(hardware_names()))
    parser.add_argument("--gpus", type=int, default=None, help="number of GPUs (or --nodes)")
    parser.add_argument("--nodes", type=int, default=None, help="number of nodes of --gpus-per-node GPUs")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs an NVLink domain joins (default: the hardware catalogue's, 8 on HGX boards)")
    parser.add_argument("--context", type=int, default=8192, help="tokens per request (default 8192)")
    parser.add_argument("--gpu-hour-usd", type=float, default=None, help="price per GPU-hour (default: catalogue)")
    parser.add_argument("--group-size", type=int, default=128, help="INT4 group size: 32, 64 or 128")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor parallelism (default: all GPUs of one node; beyond a node, a MoE model spreads "
                             "wide: data-parallel attention, experts over all GPUs; a dense one runs a TP group a node)")
    parser.add_argument("--expert-parallel", action="store_true", help="spread routed experts over all GPUs")
    parser.add_argument("--attention-dp", action="store_true",
                        help="data-parallel attention: no KV replication of the MLA latent")
    parser.add_argument("--dense-tp", type=int, default=None,
                        help="with --attention-dp: the dense layers' tensor parallelism (SGLang's --moe-dense-tp-size; "
                             "default the TP group, 1 when spread over nodes)")
    parser.add_argument("--redundant-experts", type=int, default=0,
                        help="EPLB: extra expert copies per MoE layer, dealt over the expert-parallel GPUs")
    parser.add_argument("--two-batch-overlap", action="store_true",
                        help="two micro-batches hide the experts' all-to-alls (SGLang, DeepSeek)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="new tokens one step of a replica takes (default 8192)")
    parser.add_argument("--utilization", type=float, default=0.9, help="fraction of GPU memory to use")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="largest decode batch per replica")
    parser.add_argument("--scheduler-recv-interval", type=int, default=1, metavar="STEPS",
                        help="SGLang's: the scheduler takes new requests in every STEPS decode steps (and after "
                             "each prefill); default 1, every step")
    parser.add_argument("--batch-wait", default=None, metavar="STEPS:RATIO",
                        help="TensorRT-LLM's batch waiting: while requests decode, new prompts wait up to STEPS steps "
                             "until they and the decodes fill RATIO of a step's tokens (batch_wait_timeout_iters, "
                             "batch_wait_max_tokens_ratio); default none")
    parser.add_argument("--calibration", default=None, help="a calibration from `planner calibrate`")
    parser.add_argument("--cuda-graphs", choices=("on", "off"), default=None,
                        help="decode steps in CUDA graphs (default: the catalogue's; off: every kernel launched)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="the engine recomputes every prompt (default: it reuses cached prefix pages)")
    parser.add_argument("--speculative", default=None, metavar="METHOD:K",
                        help="speculative decoding: ngram:K (prompt lookup) or mtp:K (the model's MTP layer)")
    parser.add_argument("--acceptance", default=None, metavar="RATE[,RATE...]",
                        help="the chance a draft stands once the one before it stood, or one per position "
                             "(default for mtp: 0.875, the DeepSeek-V3 report's; ngram needs a measured one)")
    _engine_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default=None, choices=ENGINES,
                        help="the serving engine: its own fit to the public measurements prices the plan and its "
                             "deploy command is printed (default: the fit over every engine, every engine's command)")


def _disaggregation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disaggregate", default=None, metavar="xPyD",
                        help="prefill and decode on separate pools of engine instances of --tp GPUs each "
                             "(e.g. 1P3D: one prefill instance, three decode instances)")
    parser.add_argument("--handoff-link", default="auto", choices=("auto", "nvlink", "network"),
                        help="how KV pages cross between the pools (auto: NVLink within one 8-GPU node, else NICs)")
    parser.add_argument("--decode-max-num-seqs", type=int, default=None,
                        help="the decode pool's largest batch (default: --max-num-seqs)")
    parser.add_argument("--prefill-nodes", type=int, default=None,
                        help="nodes of each prefill instance (default: the --gpus/--nodes instance)")
    parser.add_argument("--decode-nodes", type=int, default=None,
                        help="nodes of each decode instance (default: the --gpus/--nodes instance)")


def _disaggregated(args: argparse.Namespace, weights: str, kv: str):
    from dataclasses import replace

    from planner.deployment.disaggregated import parse_pools, split_pools

    prefill, decode = parse_pools(args.disaggregate)
    deployment = _deployment(args, weights, kv)
    node = deployment.parallel.node_size
    pools = split_pools(deployment, prefill, decode, args.decode_max_num_seqs,
                        None if args.prefill_nodes is None else args.prefill_nodes * node,
                        None if args.decode_nodes is None else args.decode_nodes * node)
    return replace(pools, link=args.handoff_link)


def _deployment(args: argparse.Namespace, weights: str, kv: str):
    from planner.deployment.capacity import Deployment
    from planner.simulation.simulator import BatchWait
    from planner.simulation.speculation import Speculation

    return Deployment(model=args.model, hardware=args.hardware, gpus=_gpus(args), weights=weights, kv_dtype=kv,
                      context=args.context, gpu_hour_usd=args.gpu_hour_usd, group_size=args.group_size,
                      tensor_parallel=args.tp, expert_parallel=args.expert_parallel,
                      attention_data_parallel=args.attention_dp, utilization=args.utilization,
                      max_num_seqs=args.max_num_seqs, calibration=args.calibration,
                      cuda_graphs=None if args.cuda_graphs is None else args.cuda_graphs == "on",
                      prefix_caching=args.prefix_caching,
                      speculation=None if args.speculative is None else Speculation.parse(args.speculative,
                                                                                          args.acceptance),
                      gpus_per_node=args.gpus_per_node, redundant_experts=args.redundant_experts,
                      dense_tensor_parallel=args.dense_tp, two_batch_overlap=args.two_batch_overlap,
                      max_num_batched_tokens=args.max_num_batched_tokens, engine=args.engine,
                      scheduler_recv_interval=args.scheduler_recv_interval,
                      batch_wait=None if args.batch_wait is None else BatchWait.parse(args.batch_wait))


def _gpus(args: argparse.Namespace) -> int:
    """--gpus, or --nodes of --gpus-per-node (the hardware's node by default)."""
    from planner.catalog.hardware import get_hardware

    if (args.gpus is None) == (args.nodes is None):
        raise PlannerError("give the GPUs as --gpus N or --nodes N, one of them")
    if args.gpus is not None:
        return args.gpus
    if not isinstance(args.nodes, int) or args.nodes <= 0:
        raise PlannerError(f"--nodes must be a positive integer, got {args.nodes!r}")
    return args.nodes * (args.gpus_per_node or get_hardware(args.hardware).gpus_per_node)


def _pm(bars: dict[str, float | None], figure: str) -> str:
    """' ±x%' where the figure has an error bar."""
    return "" if bars.get(figure) is None else f" ±{bars[figure]:g}%"


def _gib(value: int) -> str:
    return f"{value / (1 << 30):.2f} GiB"


def cmd_plan(args: argparse.Namespace) -> None:
    from planner.deployment.capacity import evaluate

    if args.disaggregate:
        _plan_disaggregated(args)
        return
    result = evaluate(_deployment(args, args.weights, args.kv))
    summary = result.summary()
    if args.shared_prefix:
        summary["shared_prefix_tokens"] = args.shared_prefix
        summary["max_concurrency_shared_prefix"] = result.plan.max_concurrency(
            min(args.context, result.plan.max_position_embeddings),
            args.shared_prefix if args.prefix_caching else 0)
    gain = None
    if result.deployment.speculation is not None and result.fits:
        from planner.deployment.speculative_plan import speculative_gain

        gain = speculative_gain(result, result.deployment.speculation)
        summary["speculative"] = gain.summary()
    if args.json:
        print(json.dumps(summary))
        return
    plan = result.plan
    bars = summary["uncertainty_pct"] or {}
    lines = [f"{args.model} on {result.deployment.gpus} x {args.hardware}, weights {args.weights}, KV {args.kv}, "
             f"context {args.context} ({result.parameters_source})", f"layout: {result.deployment.layout()}", "",
             "per GPU:"]
    lines += [f"  {name:22s} {_gib(value)}" for name, value in plan.breakdown().items()]
    lines += ["", f"  {'KV bytes per token':22s} {summary['kv_bytes_per_token_per_gpu']}",
              f"  {'KV capacity':22s} {summary['kv_capacity_tokens']} tokens",
              f"  {'max context':22s} {summary['max_context_tokens']} tokens (limited by {plan.max_context_reason})",
              f"  {'max concurrency':22s} {summary['max_concurrency']} requests of {args.context} tokens"
              + (f", {summary['max_concurrency_shared_prefix']} when they share a {args.shared_prefix}-token prefix"
                 if args.shared_prefix else ""),
              f"  {'decode':22s} {summary['decode_tokens_per_s']:.1f} tokens/s{_pm(bars, 'decode_tokens_per_s')} "
              f"(single stream {result.single_stream_tokens_per_s:.1f}"
              f"{_pm(bars, 'single_stream_decode_tokens_per_s')})",
              f"  {'prefill':22s} {summary['prefill_tokens_per_s']:.1f} tokens/s{_pm(bars, 'prefill_tokens_per_s')}",
              f"  {'cost':22s} {summary['cost_per_million_tokens']} USD per million output tokens"
              f"{_pm(bars, 'cost_per_million_tokens')} at {result.gpu_hour_usd} USD/GPU-hour"]
    if gain is not None:
        spec = summary["speculative"]
        lines.append(f"  {'speculative':22s} {spec['config']}: single stream {spec['single_stream_decode_tokens_per_s']:.1f}"
                     f" tokens/s (x{spec['single_stream_speedup']}), "
                     + (f"stops paying at a batch of {gain.stops_paying_at}" if gain.stops_paying_at else
                        "pays at every batch up to the deployment's"))
    if not bars:
        lines.append("  (uncalibrated defaults: these figures carry no error bar)")
    lines += [f"note: {note}" for note in result.all_notes]
    if not result.fits:
        lines.insert(1, "DOES NOT FIT: " + result.all_notes[-1])
    print("\n".join(lines))


def cmd_compare(args: argparse.Namespace) -> None:
    from planner.deployment.comparisons import compare, sparse_attention_crossover

    deployment = _deployment(args, args.weights[0], args.kv[0])
    rows = compare(deployment, args.weights, args.kv)
    table = [{"weights": row.deployment.weights, "kv": row.deployment.kv_dtype, **row.summary()} for row in rows]
    crossovers = {f"{row.deployment.weights}/{row.deployment.kv_dtype}": sparse_attention_crossover(row.deployment)
                  for row in rows if row.index_topk}
    if args.json:
        print(json.dumps({"rows": table} | ({"sparse_attention_crossover_context": crossovers} if crossovers else {})))
        return
    header = (f"{'weights':8s} {'kv':5s} {'weights/GPU':>12s} {'KV tokens':>11s} {'max ctx':>9s} {'conc':>6s} "
              f"{'decode tok/s':>13s} {'1-stream':>9s} {'prefill tok/s':>14s} {'$/Mtok':>8s}")
    lines = [header]
    for row in table:
        cost = "-" if row["cost_per_million_tokens"] is None else f"{row['cost_per_million_tokens']:.3f}"
        lines.append(f"{row['weights']:8s} {row['kv']:5s} {_gib(row['weights_bytes_per_gpu']):>12s} "
                     f"{row['kv_capacity_tokens']:11d} {row['max_context_tokens']:9d} {row['max_concurrency']:6d} "
                     f"{row['decode_tokens_per_s']:13.1f} {row['single_stream_decode_tokens_per_s']:9.1f} "
                     f"{row['prefill_tokens_per_s']:14.1f} {cost:>8s}")
    for dtypes, context in crossovers.items():
        topk = rows[0].index_topk
        lines.append(f"sparse attention (top {topk} tokens), {dtypes}: one stream decodes faster than with dense MLA "
                     f"from {context} tokens of context" if context else
                     f"sparse attention (top {topk} tokens), {dtypes}: never faster than dense MLA up to the position limit")
    print("\n".join(lines))


def cmd_calibrate(args: argparse.Namespace) -> None:
    from engine.core.step_shape import SAMPLE_KINDS
    from planner.calibration.profile_fit import MAX_MAPE_PCT, calibrate, load_profile

    max_mape = MAX_MAPE_PCT if args.max_mape is None else args.max_mape
    if not max_mape > 0:
        raise PlannerError(f"--max-mape must be positive, got {max_mape!r}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise PlannerError(f"the folder of --out {str(out)!r} does not exist")
    if sum(given is not None for given in (args.profile, args.endpoint, args.benchmark)) != 1:
        raise PlannerError("give a profile, --endpoint URL or --benchmark FILE..., one of them")
    if args.benchmark is not None:
        _calibrate_benchmarks(args, out)
        return
    if args.endpoint is not None:
        calibration = _calibrate_endpoint(args, max_mape)
    else:
        calibration = calibrate(load_profile(args.profile), max_mape,
                                [load_profile(path) for path in args.other_depths])
    out.write_text(json.dumps(calibration, indent=1) + "\n")
    keys = (*(f"mape_{kind}_pct" for kind in SAMPLE_KINDS), "holdout_mape_pct", "parameters")
    payload = {key: calibration[key] for key in keys if key in calibration}
    text = "\n".join(f"{key:18s} {value}" for key, value in payload.items())
    _emit(payload, args.json, text)


def _calibrate_endpoint(args: argparse.Namespace, max_mape: float) -> dict[str, Any]:
    from dataclasses import replace

    from planner.deployment.capacity import Deployment
    from planner.endpoint.calibrate import EndpointSweep, calibrate_endpoint

    if args.model is None or args.hardware is None:
        raise PlannerError("--endpoint needs --model and --hardware: what the server runs, as the planner knows it")
    sweep = EndpointSweep()
    for name, value in (("prefill_tokens", args.prefill_tokens), ("decode_batches", args.batches),
                        ("repeats", args.repeats), ("decode_output_tokens", args.decode_output_tokens)):
        if value is not None:
            sweep = replace(sweep, **{name: tuple(value) if isinstance(value, list) else value})
    deployment = Deployment(model=args.model, hardware=args.hardware, gpus=args.gpus or 1, weights=args.weights or "bf16",
                            kv_dtype=args.kv or "bf16", tensor_parallel=args.tp, expert_parallel=args.expert_parallel)
    return calibrate_endpoint(args.endpoint, deployment, sweep, max_mape, args.served_model_name)


def _calibrate_benchmarks(args: argparse.Namespace, out: Path) -> None:
    from planner.benchmarks.fit import MAX_CV_MEDIAN_PCT, calibrate_benchmarks, fit_report_lines
    from planner.benchmarks.formats import PointDefaults, read_benchmarks

    threshold = MAX_CV_MEDIAN_PCT if args.max_cv_error is None else args.max_cv_error
    if not threshold > 0:
        raise PlannerError(f"--max-cv-error must be positive, got {threshold!r}")
    defaults = PointDefaults(model=args.model, hardware=args.hardware, gpus=args.gpus, tensor_parallel=args.tp,
                             expert_parallel=args.expert_parallel, weights=args.weights, kv_dtype=args.kv)
    points = read_benchmarks(args.benchmark, defaults)
    document = calibrate_benchmarks(points, held_out=_csv(args.hold_out), max_cv_median_pct=threshold)
    out.write_text(json.dumps(document, indent=1) + "\n")
    _emit(document, args.json, "\n".join(fit_report_lines(document)))


DISAGGREGATED_KEYS = ("handoff_bytes_per_request", "handoff_p50_s", "handoff_max_s", "prefill_kv_utilization_peak")
SIMULATE_KEYS = ("completed", "throughput_tokens_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "max_concurrency_reached", "preemptions",
                 "kv_utilization_peak", "prefix_cache_hit_rate", "cached_tokens_per_request", "sim_wall_s")


def _plan_disaggregated(args: argparse.Namespace) -> None:
    from planner.deployment.commands import pool_commands
    from planner.deployment.disaggregated import plan_summary

    deployment = _disaggregated(args, args.weights, args.kv)
    summary = plan_summary(deployment) | {"deploy": pool_commands(deployment)}
    if args.json:
        print(json.dumps(summary))
        return
    commands = summary.pop("deploy")
    print(f"{args.model} on {summary['pools']} x {args.hardware}, weights {args.weights}, KV {args.kv}, "
          f"context {args.context}\n")
    print("\n".join(f"  {key:26s} {value}" for key, value in summary.items()))
    for engine_name, lines in commands.items():
        print(f"\n{engine_name}:\n" + "\n".join(f"  {line}" for line in lines))


def cmd_simulate(args: argparse.Namespace) -> None:
    from planner.deployment.capacity import deployment_uncertainty, figure_uncertainty
    from planner.deployment.simulate import simulate
    from planner.simulation.workload import LengthDistribution, Workload

    workload = Workload(arrival=args.workload, num_requests=args.requests, rate=args.rate,
                        burstiness=args.burstiness, users=args.users, think_time_s=args.think_time,
                        prompt=LengthDistribution.parse(args.prompt_tokens),
                        output=LengthDistribution.parse(args.output_tokens), trace=args.trace, seed=args.seed,
                        shared_prefix_tokens=args.shared_prefix, turns=args.turns)
    if args.disaggregate:
        from planner.deployment.disaggregated import simulate_disaggregated

        disaggregated = _disaggregated(args, args.weights, args.kv)
        report = simulate_disaggregated(disaggregated, workload, progress=not args.json).report(args.slo_ttft,
                                                                                               args.slo_tpot)
        payload = {"pools": disaggregated.name, "gpus": disaggregated.gpus,
                   **{key: report.get(key) for key in SIMULATE_KEYS + DISAGGREGATED_KEYS}}
        if args.slo_ttft is not None or args.slo_tpot is not None:
            payload["goodput_requests_per_s"] = report["goodput_requests_per_s"]
        bars = figure_uncertainty(deployment_uncertainty(disaggregated.decode), payload)
        payload["uncertainty_pct"] = bars or None
        _print_report(payload, args.json, bars)
        return
    deployment = _deployment(args, args.weights, args.kv)
    result = simulate(deployment, workload, args.router, progress=not args.json)
    report = result.report(args.slo_ttft, args.slo_tpot)
    payload = {key: report.get(key) for key in SIMULATE_KEYS}
    if deployment.speculation is not None:
        payload["speculative"] = deployment.speculation.describe()
    if args.slo_ttft is not None or args.slo_tpot is not None:
        payload["goodput_requests_per_s"] = report["goodput_requests_per_s"]
    bars = figure_uncertainty(deployment_uncertainty(deployment), payload)
    payload["uncertainty_pct"] = bars or None
    _print_report(payload, args.json, bars)


def _print_report(payload: dict, as_json: bool, bars: dict | None) -> None:
    if as_json:
        print(json.dumps(payload))
        return
    print("\n".join([f"{key:26s} {value:.4g}{_pm(bars or {}, key)}" if isinstance(value, float)
                     else f"{key:26s} {value}" for key, value in payload.items() if key != "uncertainty_pct"]
                    + ([] if bars else ["(uncalibrated defaults: these figures carry no error bar)"])))


def _csv(text: str, convert=str) -> tuple:
    try:
        return tuple(convert(item.strip()) for item in text.split(",") if item.strip())
    except ValueError:
        raise PlannerError(f"bad list {text!r}: comma-separated values") from None


def cmd_search(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from planner.search.deployments import (
        DEFAULT_KV,
        DEFAULT_WEIGHTS,
        SearchSpace,
        Slo,
        cheapest_fleet,
        check_target_rate,
        preset_workload,
        run_search,
    )
    from planner.search.executors import DEFAULT_CACHE, ResultCache
    from planner.search.pools import parse_ratios
    from planner.simulation.speculation import Speculation
    from planner.simulation.workload import LengthDistribution

    slo = Slo.parse(args.slo)
    if args.target_rate is not None:
        check_target_rate(args.target_rate)
    if args.top < 0:
        raise PlannerError(f"--top must be >= 0, got {args.top!r}")
    space = SearchSpace(args.model, _csv(args.hardware), args.max_gpus,
                        _csv(args.weights) if args.weights else DEFAULT_WEIGHTS,
                        _csv(args.kv) if args.kv else DEFAULT_KV, _csv(args.max_num_seqs, int), _csv(args.chunks, int),
                        explicit_formats=bool(args.weights or args.kv),
                        speculation=Speculation.parse(args.speculative, args.acceptance) if args.speculative else None,
                        pool_ratios=parse_ratios(args.disaggregate) if args.disaggregate else (),
                        engine=check_engine(args.engine))
    cache = None if args.no_cache else ResultCache(Path(args.cache_dir) if args.cache_dir else DEFAULT_CACHE)
    workload = replace(preset_workload(args.workload, args.requests, args.seed,
                                       LengthDistribution.parse(args.prompt_tokens) if args.prompt_tokens else None,
                                       LengthDistribution.parse(args.output_tokens) if args.output_tokens else None),
                       shared_prefix_tokens=args.shared_prefix, turns=args.turns, think_time_s=args.think_time)
    result = run_search(space, workload, slo, f"ray:{args.ray}" if args.ray else "local", args.workers, cache,
                        progress=not args.json)
    fleet = cheapest_fleet(result.ranked, args.target_rate) if args.target_rate is not None else None
    payload = {"model": args.model, "slo": slo.text(), **result.summary(args.top), "fleet": fleet}
    rows, note, deploy = payload["ranked"], payload["note"], payload["deploy"]
    if args.out:
        _write_search(Path(args.out), payload, result)
    if args.json:
        print(json.dumps(payload))
        return
    lines = [f"{args.model}, SLO {slo.text()}: {result.enumerated} configurations, {len(result.pruned)} pruned, "
             f"{result.simulated} simulated ({result.cached} from the cache), "
             f"{len(rows)} meet the SLOs"]
    if note:
        lines.append(note)
    header = (f"{'configuration':58s} {'rate/s':>8s} {'±':>5s} {'tok/s/GPU':>10s} {'tok/s/user':>10s} {'TTFT p99':>9s} "
              f"{'TPOT p99':>9s} {'USD/h':>8s} {'USD/Mtok':>9s}")
    lines += ["", header] if rows else []
    for row in rows[:20]:
        user = "-" if row["tokens_per_s_per_user"] is None else f"{row['tokens_per_s_per_user']:.1f}"
        tpot = "-" if row["tpot_p99_s"] is None else f"{row['tpot_p99_s']:.4f}"
        bar = (row["uncertainty_pct"] or {}).get("max_rate_rps")
        bar = "-" if bar is None else f"{bar:g}%"
        lines.append(f"{row['configuration']:58s} {row['max_rate_rps']:8.3f} {bar:>5s} {row['tokens_per_s_per_gpu']:10.1f} "
                     f"{user:>10s} {row['ttft_p99_s']:9.3f} {tpot:>9s} {row['usd_per_hour']:8.2f} "
                     f"{row['usd_per_million_tokens']:9.4f}")
    for item in deploy:
        lines += ["", f"deploy {item['configuration']}:"]
        lines += [f"  {line}" for engine_name in ("vllm", "sglang", "trtllm") if engine_name in item
                  for line in item[engine_name].splitlines()]
    if args.target_rate is not None:
        lines += ["", f"{args.target_rate:g} requests/s: " + (
            f"{fleet['replicas']} x [{fleet['configuration']}], {fleet['gpus']} GPUs, {fleet['usd_per_hour']} USD/h"
            if fleet else "no configuration meets the SLOs")]
    verdict = payload.get("speculative")
    if verdict:
        lines += ["", f"speculative decoding ({args.speculative}): the cheapest configuration "
                      f"{'drafts' if verdict['best_drafts'] else 'does not draft'}"
                  + (f"; for {verdict['configuration']} drafting "
                     + (f"stops paying at a batch of {verdict['stops_paying_at_batch']}"
                        if verdict["stops_paying_at_batch"] else "pays at every batch up to its max_num_seqs")
                     + f" (single stream x{verdict['single_stream_speedup']})" if "configuration" in verdict else "")]
    pools = payload.get("disaggregation")
    if pools:
        lines += ["", "disaggregated prefill/decode: " + (
            f"{pools['winner']} wins" if pools["winner"] else "nothing meets the SLOs")]
        lines += [f"  best {kind}: " + (f"{best['configuration']}, {best['usd_per_million_tokens']} USD/Mtok, "
                                        f"{best['tokens_per_s_per_gpu']} tok/s/GPU" if best else "none meets the SLOs")
                  for kind, best in ((k, pools[k]) for k in ("aggregated", "disaggregated"))]
    print("\n".join(lines))


def _write_search(out: Path, payload: dict[str, Any], result) -> None:
    import csv

    from planner.ui.plots import pareto_front

    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("ranked.csv", payload["ranked"]), ("pareto.csv", payload["pareto"])):
        with (out / name).open("w", newline="") as handle:
            if rows:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    (out / "search.json").write_text(json.dumps(payload, indent=1) + "\n")
    chosen = payload["ranked"][0] if payload["ranked"] else None
    pareto_front(payload["ranked"], payload["pareto"], chosen).write_html(out / "pareto.html", include_plotlyjs="cdn")


COMMANDS = {"calibrate": cmd_calibrate, "plan": cmd_plan, "compare": cmd_compare, "simulate": cmd_simulate,
            "verify": cmd_verify, "search": cmd_search}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except PlannerError as error:
        print(f"planner: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
