"""The profile's format, torch-free: the planner reads what the profiler writes through these names."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.core.scheduler import SchedulerOutput

PROFILE_VERSION = 1
REGIMES = ("prefill", "decode", "mixed")
# a profile's sample kinds: the regimes, steps whose every sequence verifies K drafts (`engine profile
# --speculative ngram:K`), which a calibration fits its verification costs to, and prompts' chunks computed over a
# cached prefix (a prefix-cache hit, a long prompt's later chunk: attention reads KV no step of theirs wrote)
SAMPLE_KINDS = (*REGIMES, "verify", "prefix")


def batch_shape(output: SchedulerOutput, index_topk: int = 0) -> dict[str, int]:
    """A step's batch as counts and sums: the fields of `planner.cost.step_model.BatchShape`. With sparse attention
    (`index_topk` > 0) also what its indexer scans and its attention reads (`selected_pairs`)."""
    items = output.chunks               # the simulator calls this every step: comprehensions, not a loop body
    decode_ends = [start + 1 for start in output.decode_starts]
    decode_ends += [item.end for item in items if item.num_new_tokens == 1 and item.start > 0 and not item.drafts]
    chunks = [(item.num_new_tokens, item.end) for item in items
              if not item.drafts and (item.num_new_tokens != 1 or item.start == 0)]
    # a verification of drafts is a chunk of the last token and every draft, whatever stood of them afterwards
    verifications = [(item.scheduled_tokens, item.start + item.scheduled_tokens) for item in items if item.drafts]
    return shape_fields(decode_ends, chunks, index_topk, verifications)


def regime_of(batch: dict[str, int]) -> str:
    """The profile's kinds of step: only decodes, only prefill chunks, or both; or verifications of drafts (beside
    plain decodes, with no prompt's chunk)."""
    verifications = batch.get("num_verifications", 0)
    if verifications and verifications == batch["num_prefills"]:
        return "verify"
    if not batch["num_prefills"]:
        return "decode"
    return "prefill" if not batch["num_decodes"] else "mixed"


def shape_fields(decode_contexts: list[int], chunks: list[tuple[int, int]], index_topk: int = 0,
                 verifications: list[tuple[int, int]] = ()) -> dict[str, int]:
    """The `BatchShape` fields of decodes reading these contexts (their new token included), prefill chunks of
    (new tokens, context end) and verifications of drafts, chunks of the same form (counted among the prefill
    chunks, and apart where there are any: a step that verifies pays its own fixed costs)."""
    chunks = [*chunks, *verifications]
    shape = {"num_decodes": len(decode_contexts), "decode_context_tokens": sum(decode_contexts),
             "decode_max_context": max(decode_contexts, default=0), "num_prefills": len(chunks),
             "prefill_tokens": sum(n for n, _ in chunks),
             "prefill_pairs": sum(chunk_pairs(n, end) for n, end in chunks),
             "prefill_context_tokens": sum(end for _, end in chunks)}
    if verifications:
        shape.update(num_verifications=len(verifications), verification_tokens=sum(n for n, _ in verifications))
    if index_topk:
        scanned = [(n, end) for n, end in chunks if end > index_topk]
        shape.update(decode_selected_tokens=sum(min(end, index_topk) for end in decode_contexts),
                     prefill_selected_pairs=sum(selected_pairs(n, end, index_topk) for n, end in chunks),
                     prefill_indexed_pairs=sum(chunk_pairs(n, end) for n, end in scanned),
                     prefill_indexed_context_tokens=sum(end for _, end in scanned))
    return shape


def chunk_pairs(num_tokens: int, context_end: int) -> int:
    """Causal (new token, visible token) pairs of a chunk of `num_tokens` new tokens ending at `context_end`."""
    return num_tokens * context_end - num_tokens * (num_tokens - 1) // 2


def selected_pairs(num_tokens: int, context_end: int, index_topk: int) -> int:
    """(row, attended token) pairs of a prefill chunk under sparse attention: the row at position p sees
    min(p + 1, index_topk) tokens; rows are positions context_end - num_tokens .. context_end - 1."""
    first, last = context_end - num_tokens + 1, context_end        # tokens each row sees, before the cap
    if last <= index_topk:
        return (first + last) * num_tokens // 2
    if first > index_topk:
        return index_topk * num_tokens
    return (first + index_topk) * (index_topk - first + 1) // 2 + index_topk * (last - index_topk)


def new_tokens(batch: dict[str, int]) -> int:
    """Rows a step runs through the linear layers: one per decode, every prefill chunk's tokens."""
    return batch["num_decodes"] + batch["prefill_tokens"]


def expected_experts_touched(num_experts: int, experts_per_token: int, num_tokens: int) -> float:
    """Distinct experts that `num_tokens` tokens route to in one MoE layer, in expectation under uniform
    routing: each expert is missed by a token with probability 1 - k / E."""
    if not num_experts or num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** num_tokens)


def bytes_moved(model: dict[str, Any], batch: dict[str, int]) -> int:
    """Weights once (of a MoE model's routed experts, those the step's tokens touch in expectation), cached
    KV read, new KV written: the least a step must move."""
    kv_tokens = batch["decode_context_tokens"] + batch["prefill_context_tokens"] + new_tokens(batch)
    layers, experts = model.get("num_moe_layers", 0), model.get("num_experts", 0)
    untouched = layers * (experts - expected_experts_touched(experts, model.get("experts_per_token", 0),
                                                             new_tokens(batch)))
    weights = model["linear_weight_bytes"] - untouched * model.get("expert_weight_bytes", 0)
    return round(weights + model["head_weight_bytes"] + model["kv_bytes_per_token"] * kv_tokens)


def engine_version() -> str:
    """The installed kvplan version, or the checkout's pyproject.toml where it runs uninstalled (a lent GPU)."""
    try:
        return metadata.version("kvplan")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.MULTILINE) if pyproject.exists() else None
        return found.group(1) if found else "unknown"
