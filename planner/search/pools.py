"""Disaggregated candidates for the search: xPyD pools of the aggregated candidates' engine instances.

Each aggregated candidate of `g` GPUs (one engine instance, tensor parallel over all of them) is also tried as
P prefill and D decode instances of itself, for every ratio asked for whose (P + D) x g GPUs the search allows. A
pool pair is pruned before simulation as a deployment is: it must fit, one stream must decode within the TPOT
limit, the longest prompt must prefill and cross the link within the TTFT limit; its search starts from the rate
the slower pool sustains by the step model.
"""
from __future__ import annotations

import statistics

from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.disaggregated import DisaggregatedDeployment, parse_pools, split_pools
from planner.errors import PlannerError
from planner.search.slo import Slo
from planner.simulation.workload import Workload

AUTO_RATIOS = ((1, 1), (1, 2), (1, 3), (2, 1))


def parse_ratios(text: str) -> tuple[tuple[int, int], ...]:
    """'auto' or a comma-separated list of xPyD ('1P1D,1P3D')."""
    if text.strip() == "auto":
        return AUTO_RATIOS
    ratios = tuple(parse_pools(part) for part in text.split(",") if part.strip())
    if not ratios:
        raise PlannerError(f"bad --disaggregate {text!r}: 'auto' or pools such as 1P1D,1P3D")
    return ratios


def pool_candidates(aggregated: list[Deployment], ratios: tuple[tuple[int, int], ...],
                    max_gpus: int) -> list[DisaggregatedDeployment]:
    found = []
    for deployment in aggregated:
        if deployment.speculation is not None:
            continue
        for prefill, decode in ratios:
            if (prefill + decode) * deployment.gpus <= max_gpus:
                found.append(split_pools(deployment, prefill, decode))
    return found


def analyse_pools(deployment: DisaggregatedDeployment, workload: Workload, slo: Slo) -> tuple[str | None, float]:
    """`planner.search.deployments.analyse` for a pool pair."""
    try:
        prefill, decode = evaluate(deployment.prefill), evaluate(deployment.decode)
    except PlannerError as error:
        return f"invalid: {error}", 0.0
    for name, capacity in (("prefill", prefill), ("decode", decode)):
        if not capacity.fits:
            return f"does not fit: the {name} pool: {capacity.note}", 0.0
    requests = workload.requests()
    longest = max(request.prompt_tokens for request in requests)
    tpot = slo.tightest("tpot")
    one_stream = 1.0 / decode.single_stream_tokens_per_s
    if tpot is not None and one_stream > tpot:
        return f"cannot meet tpot: one stream decodes a token in {one_stream * 1e3:.1f} ms", 0.0
    first = prefill.prompt_seconds(longest) + deployment.handoff_link().seconds(deployment.handoff_bytes(longest))
    ttft = slo.tightest("ttft")
    if ttft is not None and first > ttft:
        return f"cannot meet ttft: the longest prompt alone prefills and hands off in {first:.3f} s", 0.0
    prompt = statistics.fmean(request.prompt_tokens for request in requests)
    output = statistics.fmean(request.output_tokens for request in requests)
    return None, min(prefill.prefill_tokens_per_s / prompt, decode.decode_tokens_per_s / output)


def pools_label(deployment: DisaggregatedDeployment) -> str:
    """How a ranked pool pair is named: its pools, each instance's GPUs, the formats and limits."""
    instance = deployment.prefill.parallel.tp
    return (f"{deployment.name} {deployment.gpus}x{deployment.hardware} ({instance}-GPU instances"
            f"{' ep' if deployment.expert_parallel else ''}) {deployment.weights}/kv {deployment.kv_dtype} "
            f"seqs {deployment.max_num_seqs} chunk {deployment.max_num_batched_tokens}"
            f"{'' if deployment.prefix_caching else ' no-cache'}")
