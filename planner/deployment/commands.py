"""How to run a planned deployment with vLLM and SGLang: their command lines for the same configuration."""
from __future__ import annotations

import shlex
from dataclasses import replace

from planner.catalog.models import get_model, repository
from planner.deployment.capacity import Deployment
from planner.deployment.disaggregated import DisaggregatedDeployment

VLLM_QUANTIZATION = {"fp8": "--quantization fp8", "int4": "--quantization awq",
                     "nvfp4": "--quantization modelopt_fp4"}
SGLANG_QUANTIZATION = {"fp8": "--quantization fp8", "int4": "--quantization awq",
                       "nvfp4": "--quantization modelopt_fp4"}
SGLANG_KV = {"fp8": "fp8_e4m3", "nvfp4": "fp4_e2m1"}


def deploy_commands(deployment: Deployment | DisaggregatedDeployment, role: str | None = None,
                    leader: str = "HOST0") -> dict[str, str]:
    """The same configuration as vLLM and SGLang command lines. INT4 and NVFP4 name a checkpoint quantized so
    (AWQ, NVIDIA ModelOpt); vLLM has no FP4 KV cache, so its line keeps FP8 there and says so. Disaggregated
    pools: one line per instance and the router or proxy in front. Wide expert parallelism: data-parallel
    attention over every GPU, experts over all of them through DeepEP, one command per node (`role` picks the
    all-to-all kernels of a prefill or decode pool; without one, each engine's choice per batch; `leader` is the
    host its other nodes join)."""
    if isinstance(deployment, DisaggregatedDeployment):
        return {name: "\n".join(lines) for name, lines in pool_commands(deployment).items()}
    commands = _engine_commands(deployment, role, leader)
    return commands if deployment.engine is None else {deployment.engine: commands[deployment.engine]}


def _engine_commands(d: Deployment, role: str | None, leader: str) -> dict[str, str]:
    """Every engine's line for the deployment (`deploy_commands` keeps the chosen engine's)."""
    commands = {"trtllm": trtllm_command(d, leader)}
    parallel = d.parallel
    if parallel.all_to_all:
        return wide_expert_parallel_commands(d, role, leader) | commands
    model = repository(d.model)
    vllm = [f"vllm serve {model}", f"--tensor-parallel-size {parallel.tp}"]
    sglang = [f"python -m sglang.launch_server --model-path {model}", f"--tp {parallel.tp}"]
    if parallel.dp > 1:
        vllm.append(f"--data-parallel-size {parallel.dp}")
        sglang.append(f"--dp {parallel.dp}")
    if d.expert_parallel:
        vllm.append("--enable-expert-parallel")
        sglang.append(f"--ep-size {d.gpus}")
    vllm, sglang = _common_options(d, vllm, sglang)
    commands |= {"vllm": " ".join(vllm), "sglang": " ".join(sglang)}
    if d.kv_dtype == "nvfp4":
        commands["vllm"] += "  # vLLM has no FP4 KV cache; in FP8 it holds 0.56x the tokens"
    return commands


def trtllm_command(d: Deployment, leader: str = "HOST0") -> str:
    """TensorRT-LLM's OpenAI server (PyTorch backend): its options file (attention DP, FP8 KV, batch waiting, the wide-EP MoE backend
    with EPLB's slots across nodes) and `trtllm-serve`, under `mpirun` over the nodes' hosts beyond one node."""
    parallel = d.parallel
    model = repository(d.model)
    options = []
    if parallel.attention_data_parallel:
        options.append("enable_attention_dp: true")
    if d.kv_dtype in ("fp8", "nvfp4"):
        options += ["kv_cache_config:", f"  dtype: {'fp8' if d.kv_dtype == 'fp8' else 'nvfp4'}"]
    if d.batch_wait is not None:
        options += [f"batch_wait_timeout_iters: {d.batch_wait.steps}",
                    f"batch_wait_max_tokens_ratio: {d.batch_wait.token_ratio}"]
    if parallel.all_to_all and parallel.nodes > 1:
        options += ["moe_config:", "  backend: WIDEEP"]
        if parallel.redundant_experts:
            slots = get_model(d.model).ffn.num_experts + parallel.redundant_experts
            options += ["  load_balancer:", f"    num_slots: {slots}"]
    serve = (f"trtllm-serve {model} --backend pytorch --tp_size {parallel.tp} "
             f"--ep_size {parallel.expert_ranks if d.expert_parallel else 1} --max_batch_size {d.max_num_seqs} "
             f"--max_num_tokens {d.max_num_batched_tokens} --max_seq_len {d.context} "
             f"--kv_cache_free_gpu_memory_fraction {d.utilization}")
    if options:
        serve += " --extra_llm_api_options extra.yaml"
    if parallel.nodes > 1:
        hosts = ",".join([leader] + [f"{leader}_{node}" for node in range(1, parallel.nodes)])
        serve = f"mpirun -H {hosts} -n {d.gpus} trtllm-llmapi-launch {serve}"
    if not options:
        return serve
    return "cat > extra.yaml <<'EOF'\n" + "\n".join(options) + "\nEOF\n" + serve


def _common_options(d: Deployment, vllm: list[str], sglang: list[str],
                    replicas: int = 1) -> tuple[list[str], list[str]]:
    """Weights, KV cache, prefix caching, speculation and the batch limits (SGLang's running requests and chunk are
    over all its data-parallel ranks, vLLM's per rank)."""
    if d.weights in VLLM_QUANTIZATION:
        vllm.append(VLLM_QUANTIZATION[d.weights])
        sglang.append(SGLANG_QUANTIZATION[d.weights])
    if d.kv_dtype in ("fp8", "nvfp4"):
        vllm.append("--kv-cache-dtype fp8")
        sglang.append(f"--kv-cache-dtype {SGLANG_KV[d.kv_dtype]}")
    if not d.prefix_caching:
        vllm.append("--no-enable-prefix-caching")
        sglang.append("--disable-radix-cache")
    if d.speculation is not None:
        k = d.speculation.num_draft_tokens
        method = "deepseek_mtp" if d.speculation.method == "mtp" else "ngram"
        vllm.append(f"--speculative-config '{{\"method\": \"{method}\", \"num_speculative_tokens\": {k}}}'")
        sglang.append(f"--speculative-algorithm EAGLE --speculative-num-steps {k} --speculative-eagle-topk 1 "
                      f"--speculative-num-draft-tokens {k + 1}" if d.speculation.method == "mtp" else
                      f"--speculative-algorithm NGRAM --speculative-num-draft-tokens {k + 1}")
    vllm += [f"--max-num-seqs {d.max_num_seqs}", f"--max-num-batched-tokens {d.max_num_batched_tokens}",
             f"--max-model-len {d.context}", f"--gpu-memory-utilization {d.utilization}"]
    sglang += [f"--max-running-requests {d.max_num_seqs * replicas}",
               f"--chunked-prefill-size {d.max_num_batched_tokens * replicas}",
               f"--context-length {d.context}", f"--mem-fraction-static {d.utilization}"]
    if d.scheduler_recv_interval > 1:
        sglang.append(f"--scheduler-recv-interval {d.scheduler_recv_interval}")
    return vllm, sglang


DEEPEP_MODES = {None: ("auto", "deepep_low_latency"), "decode": ("low_latency", "deepep_low_latency"),
                "prefill": ("normal", "deepep_high_throughput")}


def wide_expert_parallel_commands(d: Deployment, role: str | None = None, leader: str = "HOST0") -> dict[str, str]:
    """SGLang (`--enable-dp-attention --moe-a2a-backend deepep`, as its large-scale EP runs) and vLLM
    (`--data-parallel-size` with `--enable-expert-parallel` and a DeepEP all-to-all backend) over every GPU, one
    line per node: node 0 at `leader` leads, the others join it (SGLang `--node-rank`, vLLM `--headless` from their
    first data-parallel rank). vLLM's default backend elsewhere, `allgather_reducescatter`, is kept on one node."""
    parallel = d.parallel
    model = repository(d.model)
    sglang_mode, vllm_backend = DEEPEP_MODES[role]
    sglang = [f"python -m sglang.launch_server --model-path {model}", f"--tp {d.gpus} --dp {parallel.replicas}",
              "--enable-dp-attention --moe-a2a-backend deepep", f"--deepep-mode {sglang_mode}",
              f"--moe-dense-tp-size {parallel.dense_tp}"]
    if parallel.dense_tp == 1:
        sglang.append("--enable-dp-lm-head")
    vllm = [f"vllm serve {model}", f"--data-parallel-size {parallel.replicas}", "--enable-expert-parallel",
            f"--all2all-backend {vllm_backend if parallel.nodes > 1 else 'allgather_reducescatter'}"]
    if parallel.redundant_experts:
        sglang.append(f"--enable-eplb --ep-num-redundant-experts {parallel.redundant_experts}")
        vllm.append(f"--enable-eplb --eplb-config '{{\"num_redundant_experts\": {parallel.redundant_experts}}}'")
    if d.two_batch_overlap:
        sglang.append("--enable-two-batch-overlap")
        vllm.append("--enable-dbo")
    vllm, sglang = _common_options(d, vllm, sglang, parallel.replicas)
    if parallel.nodes == 1:
        return {"vllm": " ".join(vllm), "sglang": " ".join(sglang)}
    local = parallel.node_size
    sglang_lines, vllm_lines = [], []
    for node in range(parallel.nodes):
        sglang_lines.append(" ".join(sglang + [f"--nnodes {parallel.nodes} --node-rank {node} "
                                               f"--dist-init-addr {leader}:5000"]))
        joining = f" --data-parallel-start-rank {node * local} --headless" if node else ""
        vllm_lines.append(" ".join(vllm + [f"--data-parallel-size-local {local} --data-parallel-address {leader} "
                                           f"--data-parallel-rpc-port 13345{joining}"]))
    return {"vllm": "\n".join(f"# node {node}\n{line}" for node, line in enumerate(vllm_lines)),
            "sglang": "\n".join(f"# node {node}\n{line}" for node, line in enumerate(sglang_lines))}


def pool_commands(deployment: DisaggregatedDeployment) -> dict[str, list[str]]:
    """SGLang's and vLLM's disaggregated modes: one command per engine instance (an aggregated instance's line,
    its role and port added) and the router or proxy in front; hosts are placeholders, one instance per node where
    an instance takes a node. Between nodes the pages cross over Mooncake (SGLang's default) or NIXL."""
    backend = "mooncake" if deployment.resolved_link == "network" else "nixl"
    prefill, decode = deployment.prefill, deployment.decode
    instances = [("prefill", prefill, index) for index in range(prefill.parallel.dp)]
    instances += [("decode", decode, prefill.parallel.dp + index) for index in range(decode.parallel.dp)]
    sglang, vllm = [], []
    for role, pool, index in instances:
        one = deploy_commands(replace(pool, gpus=pool.parallel.tp, tensor_parallel=pool.parallel.tp), role,
                              f"HOST{index}")
        transfer = '{"kv_connector":"NixlConnector","kv_role":"%s"}' % ("kv_producer" if role == "prefill"
                                                                        else "kv_consumer")
        sglang += _each_command(one["sglang"], role, f" --disaggregation-mode {role} --disaggregation-transfer-backend "
                                                     f"{backend} --port {30000 + index}")
        vllm += _each_command(one["vllm"], role, f" --port {8100 + index} --kv-transfer-config {shlex.quote(transfer)}")
    router = ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for role, _, index in instances:
        router += [f"--{role}", f"http://HOST{index}:{30000 + index}"]
    return {"sglang": sglang + [shlex.join(router)],
            "vllm": vllm + ["# a proxy in front: vLLM's examples/online_serving/disaggregated_serving "
                            "(toy_proxy_server.py) sends each request to a producer with max_tokens 1, then to a "
                            "consumer"]}


def _each_command(text: str, role: str, options: str) -> list[str]:
    """The lines of an instance's commands (one a node, with their comments naming the pool), `options` added to each
    command."""
    return [f"# {role} {line[2:]}" if line.startswith("# ") else line + options for line in text.splitlines()]
