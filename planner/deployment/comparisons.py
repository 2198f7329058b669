"""A deployment against its variants: BF16 against FP8 KV, FP8 against INT4 weights, any grid of dtypes, and where
sparse attention starts to beat dense MLA."""
from __future__ import annotations

from dataclasses import replace

from planner.catalog.models import get_model
from planner.deployment.capacity import Capacity, Deployment, costing, evaluate


def compare(deployment: Deployment, weights: list[str], kv_dtypes: list[str]) -> list[Capacity]:
    """Several dtype configurations of one deployment, side by side; one that does not fit still gets a row."""
    return [evaluate(replace(deployment, weights=w, kv_dtype=kv)) for w in weights for kv in kv_dtypes]


def sparse_attention_crossover(deployment: Deployment) -> int | None:
    """The shortest context from which one stream decodes faster with the model's sparse attention (DSA) than
    with dense MLA over every cached token (the same model without its indexer and its keys' cache); None for
    a model without sparse attention, or where dense attention stays as fast up to the position limit."""
    model = get_model(deployment.model)
    attention = model.attention
    if not attention.index_topk:
        return None
    dense = replace(model, attention=replace(attention, indexer_layers=0, indexer_heads=0, indexer_head_dim=0,
                                             indexer_types=(), index_topk=0))
    sparse_step = costing(deployment, model).single_stream_step
    dense_step = costing(deployment, dense).single_stream_step
    low, high = 1, model.max_position_embeddings
    if dense_step(high) <= sparse_step(high):
        return None
    while low < high:           # dense minus sparse grows with the context: the first context where it is > 0
        middle = (low + high) // 2
        if dense_step(middle) > sparse_step(middle):
            high = middle
        else:
            low = middle + 1
    return low


def kv_dtype_comparison(deployment: Deployment) -> dict:
    """BF16 against FP8 KV: context, concurrency, throughput at each one's largest concurrency."""
    rows = {kv: evaluate(_with(deployment, kv_dtype=kv)) for kv in ("bf16", "fp8")}
    bf16, fp8 = rows["bf16"], rows["fp8"]
    return {kv: row.summary() for kv, row in rows.items()} | {
        "capacity_ratio": _ratio(fp8.plan.kv_capacity_tokens, bf16.plan.kv_capacity_tokens),
        "concurrency_ratio": _ratio(fp8.concurrency, bf16.concurrency),
        "decode_throughput_ratio": _ratio(fp8.decode_tokens_per_s, bf16.decode_tokens_per_s),
    }


def weight_dtype_comparison(deployment: Deployment, baseline: str = "fp8", candidate: str = "int4") -> dict:
    """FP8 against INT4 weights: size, single-stream decode speed, prefill speed."""
    rows = {w: evaluate(_with(deployment, weights=w)) for w in (baseline, candidate)}
    base, cand = rows[baseline], rows[candidate]
    return {w: row.summary() for w, row in rows.items()} | {
        "weight_bytes_ratio": _ratio(cand.plan.weights_bytes_per_gpu, base.plan.weights_bytes_per_gpu),
        "single_stream_speedup": _ratio(cand.single_stream_tokens_per_s, base.single_stream_tokens_per_s),
        "prefill_speedup": _ratio(cand.prefill_tokens_per_s, base.prefill_tokens_per_s),
    }


def _with(deployment: Deployment, **changes) -> Deployment:
    return replace(deployment, calibration=None, **changes) if deployment.calibration else replace(deployment, **changes)


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 4) if denominator else None
