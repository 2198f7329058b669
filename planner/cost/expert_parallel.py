"""Wide expert parallelism: what a step pays when tokens travel to their experts' GPUs and back, and how unevenly
the experts' work falls on those GPUs.

With data-parallel attention in front of experts spread over G GPUs (DeepSeek's inference system, SGLang and vLLM
with DeepEP), each MoE layer dispatches every token to the GPUs of its top-k experts and combines their outputs
back: two all-to-alls a layer. DeepEP sends each (token, expert) pair's hidden state, FP8 on the way out and BF16
on the way back ("FP8 dispatching and BF16 combining", https://github.com/deepseek-ai/DeepEP), over NVLink to GPUs
of the same node and over the GPU's own NIC to other nodes. Its low-latency kernels, which decode uses, move at
39-43 GB/s per H800 at EP 64-256 on 400 Gb/s (50 GB/s) NICs ("EP 128 | 192 us | 39 GB/s" dispatch, "369 us |
39 GB/s" combine, 128 tokens, hidden 7168, top-8: docs/legacy.md of that repository, read 2026-12-05): about 0.8 of the NIC, a few
microseconds of latency beyond the bytes (`A2A_NETWORK_EFFICIENCY`, `A2A_LATENCY_S`). Within a node its kernels reach
153-158 GB/s of an H800's 200 GB/s NVLink direction (`A2A_LINK_EFFICIENCY`).

The hottest GPU sets each layer's pace. Its load is the mean times `1 + z(G) sqrt(cv^2 + 1/m)`: z(G) the expected
maximum of G standard normals, m the mean pairs a GPU receives (their count's own noise), cv the spread of the
GPUs' loads. Real routing is skewed: experts differ in popularity with a coefficient of variation
`EXPERT_LOAD_CV` (an assumption, set before any comparison: with it the model gives EPLB 1.50x in prefill and
1.83x in decode on SGLang's DeepSeek pools, where the post measured "1.49x (prefill) and 2.54x (decode)",
https://lmsys.org/blog/2025-05-05-large-scale-ep/; bench/wide_ep_published.py); a GPU holding L experts spreads it
to cv / sqrt(L). EPLB's redundant copies of the hot experts, placed to balance the GPUs,
leave `EPLB_RESIDUAL_CV` (its balancedness, mean over max load, about 0.9 at EP 72).

Two-batch overlap splits a step into two micro-batches, one computing while the other's tokens travel. It does not
hide all of the shorter: DeepEP's kernels take SMs from the GEMMs and the halves do not pipeline perfectly.
`TWO_BATCH_OVERLAP_SHARE` is the share it hides, set so that the step model gave SGLang's published decode gain
("25.5% throughput gain" at 256 tokens per GPU, DeepSeek-V3 on 9 nodes of 8 H100, the post above) under the public
calibration of 2026-12-04 (1.23x); under the refit of 2026-12-05 it gives 1.31x in decode and 1.28x in prefill, where
the post measured "27% to 35%" for 16k-token batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DISPATCH_BYTES_PER_VALUE = 1.0 + 4.0 / 128      # FP8 with an fp32 scale per 128 values
COMBINE_BYTES_PER_VALUE = 2.0                   # BF16
A2A_LATENCY_S = 1e-5              # DeepEP low-latency dispatch at EP 128: 192 us for 7.3 MB at 40 GB/s = 181 us of bytes
A2A_NETWORK_EFFICIENCY = 0.8      # 39-43 GB/s of a 50 GB/s NIC (low-latency kernels, EP 64-256)
A2A_LINK_EFFICIENCY = 0.78        # 153-158 GB/s of an H800's 200 GB/s NVLink direction (normal kernels, EP 8)
EXPERT_LOAD_CV = 1.0
EPLB_RESIDUAL_CV = 0.05
TWO_BATCH_OVERLAP_SHARE = 0.55


@dataclass(frozen=True)
class AllToAll:
    """One step's dispatch and combine per token a GPU serves: calls, and bytes over NVLink and over the NICs, for
    decode steps (low-latency kernels) and for steps with prefills (normal kernels)."""

    calls_per_step: int
    link_bytes_per_token: float
    decode_network_bytes_per_token: float
    prefill_network_bytes_per_token: float


def all_to_all_traffic(hidden_size: int, experts_per_token: int, moe_layers: int, ranks: int,
                       gpus_per_node: int) -> AllToAll:
    """Each of a token's top-k pairs goes to a uniformly drawn GPU of the `ranks`, and comes back combined.

    DeepEP's low-latency kernels (decode: SGLang's `--deepep-mode auto` picks them for decode batches) send every
    pair to another node over the NIC; its normal kernels (prefill) send a token once to each other node its experts
    are on (of N nodes, k picks reach (N - 1)(1 - (1 - 1/N)^k) others in expectation) and forward it over NVLink there.
    Over NVLink: the pairs bound for the other GPUs of the node they reach."""
    if ranks <= 1 or not moe_layers:
        return AllToAll(0, 0.0, 0.0, 0.0)
    node = min(gpus_per_node, ranks)
    nodes = -(-ranks // node)
    per_copy = moe_layers * hidden_size * (DISPATCH_BYTES_PER_VALUE + COMBINE_BYTES_PER_VALUE)
    pairs_off_node = experts_per_token * (ranks - node) / ranks
    other_nodes_reached = (nodes - 1) * (1 - (1 - 1 / nodes) ** experts_per_token)
    return AllToAll(2 * moe_layers, per_copy * experts_per_token * (node - 1) / node,
                    per_copy * pairs_off_node, per_copy * other_nodes_reached)


def rank_load_cv(local_experts: int, redundant_experts: int) -> float:
    """The spread of the GPUs' expert loads from the routing's skew: lower with more experts a GPU, and what EPLB
    leaves when it has redundant copies to place."""
    if redundant_experts:
        return EPLB_RESIDUAL_CV
    return EXPERT_LOAD_CV / math.sqrt(max(1, local_experts))
