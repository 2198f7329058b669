"""Step-time model: how long one engine step takes, from the bytes it moves and the FLOPs it does.

One step runs a batch of decodes (one new token each, reading its whole cached context) and prefill
chunks (many new tokens, reading the chunk's context so far). Its cost has four physical parts:

    bytes  = weights read once per step (for MoE: only the experts the batch's tokens route to; where a
             quantized weight is widened for a big step, the widened copy written and read too)
           + every sequence's cached KV read by attention + the new tokens' KV written
             (this engine's CPU decode attention pads each decode to the batch's longest context)
    flops  = 2 × active linear parameters per new token + attention (query × cached-key pairs; MLA's decode
             pairs in the latent space, its prefill pairs expanded per head, and its prefill re-expands the
             latents of a chunk's whole context) + the output head for each row a sequence samples (one; all
             K + 1 rows of a verification of K drafts)

A MoE step runs each routed expert its tokens touch (expected distinct experts for B tokens and top-k):
it reads those experts' weights, and each costs a fixed `expert_overhead` (gather, launch, scatter).

    t_memory  = weight bytes / (bandwidth_efficiency × peak bandwidth)    [one-row steps: gemv_efficiency]
              + widened weight bytes / (dequant_efficiency × peak bandwidth)
              + KV bytes / (kv_bandwidth_efficiency × peak bandwidth)
    t_compute = dense linear flops / (compute_efficiency × peak FLOP/s)
              + routed experts' flops / (compute_efficiency × expert_gemm_scale × peak FLOP/s)
              + attention flops / (attention_efficiency × peak FLOP/s)
    t_step    = step_overhead + seq_overhead × sequences + chunk_overhead × prefill chunks
                + verify_step_overhead × [step verifies drafts] + verify_overhead × verifications
                + expert_overhead × experts run + kernel_launch × kernels
                + eager_kernel × kernels [step runs prompt tokens]
                + max(t_memory, t_compute) + (1 - overlap) × min(t_memory, t_compute)

Under tensor parallelism every term above is one GPU's share, and the step adds its collectives, which
wait for the slowest GPU and do not overlap the compute that needs their result:

    t_communication = collective_latency × collectives + wire bytes / (link_efficiency × link bandwidth)
                    + all_to_all_latency × all-to-alls + max(NVLink bytes / (a2a_link_efficiency × link bandwidth),
                                                             NIC bytes / (network_efficiency × NIC bandwidth))

The all-to-alls are wide expert parallelism's (`planner.cost.expert_parallel`): each token to its experts' GPUs and
back, the most-loaded GPU's share (`expert_load_factor`, which also scales the routed experts' FLOPs). Under
two-batch overlap the step's two micro-batches each stream the weights, and `two_batch_overlap_share` of the
shorter of communication and the rest of the step's work hides under the other.

A step of one new token multiplies by vectors, not matrices: BLAS and GPU libraries run other kernels
for it (GEMV), which stream the weights at their own rate. Widening quantized weights (unpacking, scaling, converting) is its own rate too, and so is KV traffic: attention gathers pages scattered over the pool and, for FP8 pages,
converts every element (on a CPU that conversion, not DRAM, sets the pace). Attention FLOPs too: its kernels reach a different share of the peak than the GEMMs do
(on a CPU the masked softmax of a long prefill is far below it). `overlap` is the share of the shorter of the two that hides under the longer (1 on a GPU that streams
weights while its tensor cores work; lower on a CPU where the same cores do both). The efficiencies and
overheads are fitted to a profile of the real engine (`planner.calibration.profile_fit`); without one the
documented defaults below stand in. Torch-free: the simulator calls it for every step it simulates.

For the very model a profile timed, the profile's measured linear layers (`MeasuredLinears`: seconds of
the decoder's linears and of the head by row count) replace the weight and linear-FLOP terms: BLAS and GPU
libraries change kernels with the row count, so a matmul's time is not smooth in it, and a step of 12
decodes can cost more than one of 16. Then

    t_step = step_overhead + seq_overhead × sequences + chunk_overhead × prefill chunks
             + linear_scale × (decoder(new tokens) + head(rows sampled))
             + max(t_kv, t_attention) + (1 - overlap) × min(t_kv, t_attention)

DeepSeek Sparse Attention (GLM 5.2) splits attention in two: an indexer scans every cached token (its keys,
a few heads of FLOPs per pair) and the attention reads only the top `index_topk` of them. A decode then reads

    kv bytes = latent bytes × min(context, index_topk) + indexer bytes × context     (no scan below index_topk)

so above index_topk its cost grows with the context only at the indexer's rate; a prefill row at position p
attends min(p + 1, index_topk) tokens with sparse kernels (this engine's prefill masks a dense attention).

Each prefill chunk runs its own attention in every layer (its pages gathered, its mask, one kernel call):
about 0.5 ms per chunk and layer on one CPU thread for SmolLM2, 15 ms a prompt, so a step that prefills
twelve prompts that queued up costs more than one of a single prompt of the same tokens.
"""
from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from engine.core.memory import ceil_div
from engine.core.step_shape import expected_experts_touched, shape_fields
from planner.cost.communication import wire_bytes
from planner.cost.expert_parallel import (
    A2A_LATENCY_S,
    A2A_LINK_EFFICIENCY,
    A2A_NETWORK_EFFICIENCY,
    TWO_BATCH_OVERLAP_SHARE,
)


@dataclass(frozen=True)
class ModelCosts:
    """What a model's step costs, per GPU: the planner divides the weights and KV by parallelism first."""

    dense_weight_bytes: float           # read every step whatever the batch: attention, dense FFN, shared experts, head
    linear_flops_per_token: float       # 2 × active linear parameters of the decoder layers
    attention_flops_per_pair: float     # per (decode token, cached token) pair: QK and PV over all layers and heads
    kv_bytes_per_token: float
    head_flops_per_sequence: float = 0.0   # 2 × vocab × hidden: logits only for the row each sequence samples
    expert_flops_per_token: float = 0.0     # the routed experts' part of linear_flops_per_token (grouped GEMMs)
    expert_weight_bytes: float = 0.0    # what this GPU holds of one routed expert in one layer
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    local_experts: int | None = None    # experts this GPU holds (part of each, or whole ones under EP); None: all
    fused_max_tokens: int | None = None     # steps of more new tokens widen quantized weights first (None: never)
    dequantized_weight_bytes: float = 0.0   # what widening writes and the matmul then reads again
    # The engine's pure-torch decode attention (CPU) pads every decode's pages to the batch's longest and
    # reads them all; paged kernels (Triton on CUDA, vLLM's) read only each sequence's own tokens (None).
    decode_padding_page: int | None = None
    # MLA prefills in the expanded form (per-head K and V): its pairs cost other FLOPs than a decode's (None:
    # the same), and every cached latent of a chunk's context is up-projected again (per context token)
    prefill_attention_flops_per_pair: float | None = None
    prefill_context_flops_per_token: float = 0.0
    # Tensor parallelism over `tensor_parallel` GPUs: each step's all-reduces (the embedding's and two a layer)
    # carry every new token's hidden state, and the logits' all-gather each sampled row's vocabulary share.
    tensor_parallel: int = 1
    collective_calls_per_step: int = 0
    allreduce_bytes_per_token: float = 0.0
    gather_bytes_per_sequence: float = 0.0
    kernels_per_step: float = 0.0       # kernels a step launches, every layer's (`kernel_launch_s` each)
    # Expert parallelism over this many GPUs: each layer waits for the GPU whose experts its tokens touch most,
    # and for the one whose experts receive the most pairs (`expert_load_cv`: the spread of the GPUs' loads)
    expert_parallel_ranks: int = 1
    expert_load_cv: float = 0.0
    # the groups of distinct tokens that meet at the experts: data-parallel attention ranks sharing the experts
    expert_token_sources: int = 1
    # wide expert parallelism (`planner.cost.expert_parallel`): dispatch and combine per step, and the bytes each
    # token a GPU serves sends over NVLink and over the NICs; two-batch overlap hides them under the other
    # micro-batch's work (each micro-batch streams the weights again)
    all_to_all_calls_per_step: int = 0
    all_to_all_link_bytes_per_token: float = 0.0
    all_to_all_decode_network_bytes_per_token: float = 0.0      # low-latency kernels: every pair off the node
    all_to_all_prefill_network_bytes_per_token: float = 0.0     # normal kernels: once per other node reached
    two_batch_overlap: bool = False
    # DeepSeek Sparse Attention: a query attends at most `index_topk` cached tokens, chosen by an indexer that
    # scores every cached token (its keys are `indexer_bytes_per_token` of kv_bytes_per_token; its FLOPs per
    # (query, cached token) pair). No scan while no context exceeds index_topk: every token is selected then.
    # `sparse_prefill`: prefills attend only their selected pairs (sparse kernels); False: this engine's prefill,
    # a dense attention under a selection mask.
    index_topk: int = 0
    indexer_bytes_per_token: float = 0.0
    indexer_flops_per_pair: float = 0.0
    sparse_prefill: bool = True

    def __post_init__(self) -> None:
        for item in fields(self):
            if (getattr(self, item.name) or 0) < 0:
                raise ValueError(f"{item.name} must be >= 0, got {getattr(self, item.name)!r}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token must be in 1..{self.num_experts}, got {self.experts_per_token}")

    def experts_touched(self, num_tokens: int) -> float:
        """Routed experts (of those this GPU holds) that `num_tokens` tokens touch in expectation over all MoE
        layers, under uniform routing: each expert is missed by a token with probability 1 - k / E.

        Under expert parallelism the slowest GPU sets each layer's pace: the number of its experts touched is
        binomial (each of `local` experts touched with probability p), and the most-loaded of N GPUs is about
        its mean plus `expected_max_normal(N)` standard deviations (at most all of them)."""
        if not self.num_experts:
            return 0.0
        local = self.num_experts if self.local_experts is None else self.local_experts
        meeting = num_tokens * self.expert_token_sources
        share = expected_experts_touched(self.num_experts, self.experts_per_token, meeting) / self.num_experts
        touched = local * share
        if self.expert_parallel_ranks > 1:
            spread = math.sqrt(local * share * (1.0 - share))
            touched = min(float(local), touched + expected_max_normal(self.expert_parallel_ranks) * spread)
        return self.num_moe_layers * touched

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Dense weights, plus the routed experts that `num_tokens` tokens touch in expectation."""
        return self.dense_weight_bytes + self.experts_touched(num_tokens) * self.expert_weight_bytes

    def expert_load_factor(self, num_tokens: int) -> float:
        """The most-loaded expert GPU's pairs over the mean (1 without expert parallelism): the spread of the GPUs'
        loads and the noise of the count itself, at the expected maximum over the GPUs."""
        ranks = self.expert_parallel_ranks
        if ranks <= 1 or not self.num_experts or num_tokens <= 0:
            return 1.0
        mean_pairs = num_tokens * self.expert_token_sources * self.experts_per_token / ranks
        spread = math.sqrt(self.expert_load_cv ** 2 + 1.0 / max(mean_pairs, 1.0))
        return 1.0 + expected_max_normal(ranks) * spread


@dataclass(frozen=True)
class BatchShape:
    """A step's batch as the step model needs it: counts and sums, so that 256 sequences cost O(1)."""

    num_decodes: int = 0
    decode_context_tokens: int = 0      # sum over decodes of the context each one reads (its new token included)
    decode_max_context: int = 0         # the longest of those contexts
    num_prefills: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0              # sum over prefill chunks of (new token, visible token) pairs
    prefill_context_tokens: int = 0     # sum over prefill chunks of the context each one reads (itself included)
    # sparse attention (`engine.core.step_shape.batch_shape` with index_topk); None: attention reads everything
    decode_selected_tokens: int | None = None   # sum over decodes of min(context, index_topk)
    prefill_selected_pairs: int | None = None   # (row, token) pairs attended under the top-k cap
    prefill_indexed_pairs: int = 0              # pairs the indexer scores: chunks whose context exceeds index_topk
    prefill_indexed_context_tokens: int = 0     # the indexer keys those chunks read
    # speculative decoding: of the prefill chunks, those verifying drafts (the last token and K drafts each)
    num_verifications: int = 0
    verification_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def new_tokens(self) -> int:
        return self.num_decodes + self.prefill_tokens

    @property
    def logit_rows(self) -> int:
        """Rows the output head computes: one per sequence, every row of a verification."""
        return self.num_seqs + self.verification_tokens - self.num_verifications

    @classmethod
    def of(cls, decode_contexts: list[int], prefill_chunks: list[tuple[int, int]], index_topk: int = 0,
           verifications: list[tuple[int, int]] = ()) -> BatchShape:
        """From decode context lengths, (new tokens, context end) of each prefill chunk and of each verification
        of drafts; with sparse attention's `index_topk`, what its indexer scans and its attention reads too."""
        return cls(**shape_fields(decode_contexts, prefill_chunks, index_topk, verifications))


@dataclass(frozen=True)
class StepParameters:
    """The fitted coefficients; the defaults are used for hardware without a calibration."""

    step_overhead_s: float = 2e-3
    seq_overhead_s: float = 2e-5
    bandwidth_efficiency: float = 0.8
    gemv_efficiency: float = 0.8
    kv_bandwidth_efficiency: float = 0.6
    dequant_efficiency: float = 0.5
    compute_efficiency: float = 0.5
    attention_efficiency: float = 0.3
    overlap: float = 1.0
    linear_scale: float = 1.0       # measured linears inside the step against timed alone (cache, threads)
    chunk_overhead_s: float = 0.0   # per prefill chunk: its own attention call in every layer, its mask, its pages
    expert_overhead_s: float = 0.0  # per routed expert run in a MoE layer: its gather, launch and scatter
    collective_latency_s: float = 0.0   # per collective: the alpha of alpha-beta, with the ranks' skew
    link_efficiency: float = 1.0        # share of the link's bandwidth the collectives reach
    # per kernel launched: the host's launch cost, which a GPU step without CUDA graphs pays for each of its kernels
    # (a CUDA graph replays them all in one launch); for one model it cannot be told from step_overhead_s, so it
    # is fitted only over profiles at several depths, else it comes from the hardware catalogue
    kernel_launch_s: float = 0.0
    # per kernel of a step that runs prompt tokens, on top of kernel_launch_s: serving engines replay CUDA graphs for
    # decode-only batches and run a prefill or mixed step eagerly, its kernels dispatched from Python with the host
    # waiting on the device between layers' parts. Added to the step, not hidden under its GEMMs: the catalogue's
    # long-prompt TTFTs say so (`docs/results.md`). Fitted to serving benchmarks' TTFTs across models of different
    # depths; zero for an engine profile (kernel_launch_s)
    eager_kernel_s: float = 0.0
    # per request, not per step: from its arrival at the server to its admission by the scheduler and its first
    # token's way back (HTTP, tokenization, detokenization): time in the API server, not on the GPU. Fitted to
    # serving benchmarks' TTFTs; zero for an engine profile, which times steps alone
    request_overhead_s: float = 0.0
    # the routed experts' grouped GEMMs against the dense ones: many narrow matrices (an expert's slice under tensor
    # parallelism is a few hundred columns), each with a few tokens, reach a smaller share of the peak. 1: the same
    expert_gemm_scale: float = 1.0
    # speculative decoding: a step that verifies drafts, once, and each verification in it. This engine runs a
    # verification as a small prefill chunk, not at a prompt chunk's cost (chunk_overhead_s) but not free either:
    # fitted to a profile's verification points, else zero (a GPU engine verifies in its decode kernels)
    verify_step_overhead_s: float = 0.0
    verify_overhead_s: float = 0.0
    # wide expert parallelism's all-to-alls (`planner.cost.expert_parallel`, from DeepEP's published kernels)
    all_to_all_latency_s: float = A2A_LATENCY_S
    all_to_all_link_efficiency: float = A2A_LINK_EFFICIENCY
    network_efficiency: float = A2A_NETWORK_EFFICIENCY
    two_batch_overlap_share: float = TWO_BATCH_OVERLAP_SHARE     # of the shorter of communication and work, hidden

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{item.name} must be a finite number >= 0, got {value!r}")
        for name in ("bandwidth_efficiency", "gemv_efficiency", "kv_bandwidth_efficiency", "dequant_efficiency",
                     "compute_efficiency", "attention_efficiency", "link_efficiency", "all_to_all_link_efficiency",
                     "network_efficiency"):
            if not 0 < getattr(self, name) <= 1.5:
                raise ValueError(f"{name} must be in (0, 1.5], got {getattr(self, name)!r}")
        for name in ("overlap", "two_batch_overlap_share"):
            if getattr(self, name) > 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not 0 < self.expert_gemm_scale <= 1.5:
            raise ValueError(f"expert_gemm_scale must be in (0, 1.5], got {self.expert_gemm_scale!r}")
        if not 0 < self.linear_scale <= 3:
            raise ValueError(f"linear_scale must be in (0, 3], got {self.linear_scale!r}")


def _interpolate(rows: Sequence[int], seconds: Sequence[float], count: int) -> float:
    """Piecewise linear between measured row counts; proportional beyond the last (compute-bound there)."""
    if count <= 0:
        return 0.0
    if count >= rows[-1]:
        return seconds[-1] * count / rows[-1]
    right = bisect.bisect_left(rows, count)
    if rows[right] == count or right == 0:
        return seconds[right]
    share = (count - rows[right - 1]) / (rows[right] - rows[right - 1])
    return seconds[right - 1] + share * (seconds[right] - seconds[right - 1])


@dataclass(frozen=True)
class MeasuredLinears:
    """A profile's timings of one model's linear layers alone: the decoder's (all layers) and the head's,
    by row count. Valid for that model on that device and dtype only."""

    rows: tuple[int, ...]
    decoder_s: tuple[float, ...]
    head_rows: tuple[int, ...]
    head_s: tuple[float, ...]

    def __post_init__(self) -> None:
        for rows, seconds, what in ((self.rows, self.decoder_s, "decoder"), (self.head_rows, self.head_s, "head")):
            if not rows or len(rows) != len(seconds) or list(rows) != sorted(set(rows)) or rows[0] < 1:
                raise ValueError(f"measured {what} linears need increasing row counts from 1 with one time each, "
                                 f"got {rows!r} and {len(seconds)} times")
            if any(not (math.isfinite(t) and t > 0) for t in seconds):
                raise ValueError(f"measured {what} linear times must be positive, got {seconds!r}")

    @classmethod
    def of(cls, document: dict) -> MeasuredLinears:
        return cls(tuple(document["rows"]), tuple(document["decoder_s"]), tuple(document["head_rows"]),
                   tuple(document["head_s"]))

    def seconds(self, new_tokens: int, sequences: int) -> float:
        return (_interpolate(self.rows, self.decoder_s, new_tokens)
                + _interpolate(self.head_rows, self.head_s, sequences))


@dataclass(frozen=True)
class Peaks:
    """The hardware's peak rates for this model's dtypes."""

    bandwidth_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float | None = None   # what one GPU sends per second to the others (None: one device)
    network_bytes_per_s: float | None = None    # what one GPU sends per second to other nodes (None: one node)

    def __post_init__(self) -> None:
        if not (self.bandwidth_bytes_per_s > 0 and self.flops_per_s > 0
                and all(link is None or link > 0 for link in (self.link_bytes_per_s, self.network_bytes_per_s))):
            raise ValueError(f"peak bandwidth, FLOP/s and link bandwidths must be positive, got {self}")


@dataclass(frozen=True)
class StepTerms:
    weight_bytes: float
    gemv_weight_bytes: float            # the weights of a one-row step
    dequant_bytes: float
    kv_bytes: float
    linear_flops: float
    attention_flops: float
    num_seqs: int
    num_prefills: int = 0
    measured_linear_s: float = 0.0      # with MeasuredLinears: the linears' time, in place of their bytes and FLOPs
    expert_calls: float = 0.0           # routed experts run, over all MoE layers (expected)
    collective_calls: float = 0.0       # tensor parallelism: collectives per step
    collective_wire_bytes: float = 0.0  # what each GPU sends in them (ring algorithms)
    kernel_launches: float = 0.0        # kernels the step launches
    eager_kernels: float = 0.0          # the same, where the step runs prompt tokens (no CUDA graph)
    expert_flops: float = 0.0           # the routed experts' part of linear_flops
    verifying: float = 0.0              # 1 for a step that verifies drafts
    num_verifications: float = 0.0      # the verifications in it (not among num_prefills, the prompts' chunks)
    all_to_all_calls: float = 0.0       # wide expert parallelism: dispatches and combines
    all_to_all_link_bytes: float = 0.0      # what the most-loaded GPU moves over NVLink in them
    all_to_all_network_bytes: float = 0.0   # ... and over its NIC
    overlapped: float = 0.0             # 1 under two-batch overlap: communication hides under the step's work


def decode_tokens_read(costs: ModelCosts, batch: BatchShape) -> int:
    """Cached tokens the decodes' attention reads: their contexts, or, padded, the longest one each."""
    page = costs.decode_padding_page
    if not page:
        return batch.decode_context_tokens
    padded = batch.num_decodes * ceil_div(batch.decode_max_context, page) * page
    return max(batch.decode_context_tokens, padded)     # profiles without the longest context: no padding known


def sparse_attention_reads(costs: ModelCosts, batch: BatchShape, decode_read: int) -> tuple[int, int, int]:
    """Under sparse attention: the cached tokens the decodes attend, those the decodes' indexer scans, and the
    prefills' attended pairs. Dense attention attends everything and scans nothing."""
    topk = costs.index_topk
    if not topk or batch.decode_selected_tokens is None:
        return decode_read, 0, batch.prefill_pairs
    scanning = batch.decode_max_context > topk
    attended = batch.decode_selected_tokens
    if scanning and costs.decode_padding_page:      # the padded gather: every decode selects index_topk rows
        attended = batch.num_decodes * topk
    elif costs.decode_padding_page:
        attended = decode_read
    pairs = batch.prefill_selected_pairs if costs.sparse_prefill else batch.prefill_pairs
    return attended, decode_read if scanning else 0, pairs


def step_terms(costs: ModelCosts, batch: BatchShape, linears: MeasuredLinears | None = None) -> StepTerms:
    decode_read = decode_tokens_read(costs, batch)
    attended, indexed, prefill_pairs = sparse_attention_reads(costs, batch, decode_read)
    latent_bytes = costs.kv_bytes_per_token - costs.indexer_bytes_per_token
    kv_read = (latent_bytes * (attended + batch.prefill_context_tokens)
               + costs.indexer_bytes_per_token * (indexed + batch.prefill_indexed_context_tokens))
    kv_written = costs.kv_bytes_per_token * batch.new_tokens
    prefill_pair = (costs.attention_flops_per_pair if costs.prefill_attention_flops_per_pair is None
                    else costs.prefill_attention_flops_per_pair)
    attention = (costs.attention_flops_per_pair * attended + prefill_pair * prefill_pairs
                 + costs.indexer_flops_per_pair * (indexed + batch.prefill_indexed_pairs))
    expansion = costs.prefill_context_flops_per_token * (batch.prefill_context_tokens - batch.prefill_tokens)
    experts = costs.experts_touched(batch.new_tokens)
    calls, wire = collective_terms(costs, batch)
    prompt_chunks = batch.num_prefills - batch.num_verifications
    verifying = float(batch.num_verifications > 0)
    load = costs.expert_load_factor(batch.new_tokens)
    eager = float(costs.kernels_per_step) if prompt_chunks else 0.0
    a2a = {"all_to_all_calls": float(costs.all_to_all_calls_per_step),
           "all_to_all_link_bytes": costs.all_to_all_link_bytes_per_token * batch.new_tokens * load,
           "all_to_all_network_bytes": batch.new_tokens * load * (
               costs.all_to_all_prefill_network_bytes_per_token if batch.num_prefills
               else costs.all_to_all_decode_network_bytes_per_token),
           "overlapped": float(costs.two_batch_overlap)}
    if linears is not None:
        return StepTerms(0.0, 0.0, 0.0, kv_read + kv_written, expansion, attention, batch.num_seqs,
                         prompt_chunks, linears.seconds(batch.new_tokens, batch.logit_rows), experts, calls, wire,
                         costs.kernels_per_step, eager, 0.0, verifying, batch.num_verifications, **a2a)
    expert_flops = costs.expert_flops_per_token * batch.new_tokens * load
    linear = ((costs.linear_flops_per_token - costs.expert_flops_per_token) * batch.new_tokens + expert_flops
              + costs.head_flops_per_sequence * batch.logit_rows + expansion)
    widens = costs.fused_max_tokens is not None and batch.new_tokens > costs.fused_max_tokens
    weights = costs.weight_bytes_read(batch.new_tokens) * (2.0 if costs.two_batch_overlap else 1.0)
    one_row = batch.new_tokens == 1
    return StepTerms(0.0 if one_row else weights, weights if one_row else 0.0,
                     costs.dequantized_weight_bytes if widens else 0.0, kv_read + kv_written, linear, attention,
                     batch.num_seqs, prompt_chunks, 0.0, experts, calls, wire, costs.kernels_per_step, eager,
                     expert_flops, verifying, batch.num_verifications, **a2a)


def collective_terms(costs: ModelCosts, batch: BatchShape) -> tuple[float, float]:
    """Collectives per step and the bytes each GPU sends in them: ring all-reduces of the new tokens' hidden
    states, and the all-gather of each sequence's logits share (`planner.cost.communication.wire_bytes`)."""
    ranks = costs.tensor_parallel
    if ranks == 1 or not costs.collective_calls_per_step:
        return 0.0, 0.0
    return float(costs.collective_calls_per_step), (
        wire_bytes("all_reduce", costs.allreduce_bytes_per_token * batch.new_tokens, ranks)
        + wire_bytes("all_gather", costs.gather_bytes_per_sequence * batch.num_seqs, ranks))


STEP_PARTS = ("fixed", "launches", "prompt_dispatch", "experts", "measured_linears", "memory", "compute",
              "communication")


def step_parts(terms: StepTerms, peaks: Peaks, params: StepParameters) -> dict[str, float]:
    """The step formula, written once, as the seconds of each of its parts (`STEP_PARTS`): for one step's
    terms, or elementwise for terms whose fields are numpy arrays (the calibration fits it over a profile's
    points). Memory and compute overlap: the longer counts whole, the shorter its unhidden `1 - overlap`
    share; the shorter of a and b is (a + b - |a - b|) / 2, so floats and arrays take the same path."""
    memory = (terms.weight_bytes / params.bandwidth_efficiency + terms.gemv_weight_bytes / params.gemv_efficiency
              + terms.dequant_bytes / params.dequant_efficiency
              + terms.kv_bytes / params.kv_bandwidth_efficiency) / peaks.bandwidth_bytes_per_s
    compute = ((terms.linear_flops - terms.expert_flops) / params.compute_efficiency
               + terms.expert_flops / (params.compute_efficiency * params.expert_gemm_scale)
               + terms.attention_flops / params.attention_efficiency) / peaks.flops_per_s
    shorter = (memory + compute - abs(memory - compute)) / 2
    memory_is_shorter = memory <= compute
    memory_part = memory - params.overlap * shorter * memory_is_shorter
    compute_part = compute - params.overlap * shorter * (1 - memory_is_shorter)
    link_s = terms.all_to_all_link_bytes / (params.all_to_all_link_efficiency * (peaks.link_bytes_per_s or math.inf))
    network_s = terms.all_to_all_network_bytes / (params.network_efficiency
                                                  * (peaks.network_bytes_per_s or math.inf))
    communication = (params.collective_latency_s * terms.collective_calls + terms.collective_wire_bytes
                     / (params.link_efficiency * (peaks.link_bytes_per_s or math.inf))
                     + params.all_to_all_latency_s * terms.all_to_all_calls
                     + (link_s + network_s + abs(link_s - network_s)) / 2)     # NVLink and NICs move at once
    work = memory_part + compute_part
    hidden = params.two_batch_overlap_share * (communication + work - abs(communication - work)) / 2
    return {
        "fixed": (params.step_overhead_s + params.seq_overhead_s * terms.num_seqs
                  + params.chunk_overhead_s * terms.num_prefills + params.verify_step_overhead_s * terms.verifying
                  + params.verify_overhead_s * terms.num_verifications),
        "launches": params.kernel_launch_s * terms.kernel_launches,
        "prompt_dispatch": params.eager_kernel_s * terms.eager_kernels,
        "experts": params.expert_overhead_s * terms.expert_calls,
        "measured_linears": params.linear_scale * terms.measured_linear_s,
        "memory": memory_part,
        "compute": compute_part,
        "communication": communication - terms.overlapped * hidden,
    }


def combine(terms: StepTerms, peaks: Peaks, params: StepParameters) -> float:
    """The step's seconds: the sum of its parts."""
    return sum(step_parts(terms, peaks, params).values())


def expected_max_normal(count: int) -> float:
    """E[max of `count` independent standard normals]: 0 for one, 0.56 for two, 1.42 for eight."""
    return _expected_max_normal(int(count))


@functools.lru_cache(maxsize=64)
def _expected_max_normal(count: int) -> float:
    if count <= 1:
        return 0.0
    step = 0.01
    total = 0.0
    for index in range(-1000, 1001):          # x from -10 to 10: E[max] = integral of x n phi(x) Phi(x)^(n-1)
        x = index * step
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * count * density * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (count - 1) * step
    return total


def step_time(costs: ModelCosts, peaks: Peaks, params: StepParameters, batch: BatchShape,
              linears: MeasuredLinears | None = None) -> float:
    """Seconds for one step of `batch`; zero for an empty batch."""
    if batch.num_seqs == 0:
        return 0.0
    return combine(step_terms(costs, batch, linears), peaks, params)
