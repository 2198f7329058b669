"""How to run a planned deployment with vLLM and SGLang: their command lines for the same configuration."""
from __future__ import annotations

import shlex
from dataclasses import replace

from planner.catalog.models import repository
from planner.deployment.capacity import Deployment
from planner.deployment.disaggregated import DisaggregatedDeployment

VLLM_QUANTIZATION = {"fp8": "--quantization fp8", "int4": "--quantization awq",
                     "nvfp4": "--quantization modelopt_fp4"}
SGLANG_QUANTIZATION = {"fp8": "--quantization fp8", "int4": "--quantization awq",
                       "nvfp4": "--quantization modelopt_fp4"}
SGLANG_KV = {"fp8": "fp8_e4m3", "nvfp4": "fp4_e2m1"}


def deploy_commands(deployment: Deployment | DisaggregatedDeployment) -> dict[str, str]:
    """The same configuration as vLLM and SGLang command lines. INT4 and NVFP4 name a checkpoint quantized so
    (AWQ, NVIDIA ModelOpt); vLLM has no FP4 KV cache, so its line keeps FP8 there and says so. Disaggregated
    pools: one line per instance and the router or proxy in front."""
    if isinstance(deployment, DisaggregatedDeployment):
        return {name: "\n".join(lines) for name, lines in pool_commands(deployment).items()}
    d = deployment
    model = repository(d.model)
    vllm = [f"vllm serve {model}", f"--tensor-parallel-size {d.gpus}"]
    sglang = [f"python -m sglang.launch_server --model-path {model}", f"--tp {d.gpus}"]
    if d.expert_parallel:
        vllm.append("--enable-expert-parallel")
        sglang.append(f"--ep-size {d.gpus}")
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
    sglang += [f"--max-running-requests {d.max_num_seqs}", f"--chunked-prefill-size {d.max_num_batched_tokens}",
               f"--context-length {d.context}", f"--mem-fraction-static {d.utilization}"]
    commands = {"vllm": " ".join(vllm), "sglang": " ".join(sglang)}
    if d.kv_dtype == "nvfp4":
        commands["vllm"] += "  # vLLM has no FP4 KV cache; in FP8 it holds 0.56x the tokens"
    return commands


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
        one = deploy_commands(replace(pool, gpus=pool.parallel.tp, tensor_parallel=pool.parallel.tp))
        sglang.append(f"{one['sglang']} --disaggregation-mode {role} --disaggregation-transfer-backend {backend} "
                      f"--port {30000 + index}")
        transfer = '{"kv_connector":"NixlConnector","kv_role":"%s"}' % ("kv_producer" if role == "prefill"
                                                                        else "kv_consumer")
        vllm.append(f"{one['vllm']} --port {8100 + index} --kv-transfer-config {shlex.quote(transfer)}")
    router = ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for role, _, index in instances:
        router += [f"--{role}", f"http://HOST{index}:{30000 + index}"]
    return {"sglang": sglang + [shlex.join(router)],
            "vllm": vllm + ["# a proxy in front: vLLM's examples/online_serving/disaggregated_serving "
                            "(toy_proxy_server.py) sends each request to a producer with max_tokens 1, then to a "
                            "consumer"]}
