"""The published throughput of wide expert-parallel pools (`planner/data/benchmarks/wide_ep.json`) and the planner's
prediction of each: a prefill pool's input tokens/s per node (prompts of the published length packed into the
published tokens a GPU takes per step), a decode pool's output tokens/s per node (the published batch a GPU at the
published context), priced by the engine's own fit where one covers the GPU."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from planner.deployment.capacity import Deployment, evaluate
from planner.errors import PlannerError
from planner.files import BENCHMARKS

WIDE_EP_POINTS = BENCHMARKS / "wide_ep.json"


@dataclass(frozen=True)
class PoolPoint:
    name: str
    model: str
    hardware: str
    pool: str                   # prefill | decode
    nodes: int
    weights: str
    kv_dtype: str
    published_per_node: float
    redundant_experts: int = 0
    two_batch_overlap: bool = False
    input_tokens: int = 0       # prefill: the prompts' length
    tokens_per_gpu: int = 0     # prefill: new tokens a GPU takes per step
    context_tokens: int = 0     # decode: the cached context each request reads
    batch_per_gpu: int = 0      # decode: requests a GPU decodes at once
    engine: str | None = None   # the engine that ran it: its own fit prices it where one covers the GPU

    def __post_init__(self) -> None:
        if self.pool not in ("prefill", "decode"):
            raise PlannerError(f"{self.name}: pool must be prefill or decode, got {self.pool!r}")

    def deployment(self, gpus_per_node: int = 8) -> Deployment:
        """The pool as the planner lays it out across nodes: data-parallel attention, experts over every GPU."""
        common = {"model": self.model, "hardware": self.hardware, "gpus": self.nodes * gpus_per_node,
                  "weights": self.weights, "kv_dtype": self.kv_dtype, "redundant_experts": self.redundant_experts,
                  "two_batch_overlap": self.two_batch_overlap, "gpus_per_node": gpus_per_node, "engine": self.engine}
        if self.pool == "prefill":
            return Deployment(**common, context=self.input_tokens, max_num_batched_tokens=self.tokens_per_gpu,
                              max_num_seqs=max(1, self.tokens_per_gpu // self.input_tokens))
        return Deployment(**common, context=self.context_tokens, max_num_seqs=self.batch_per_gpu)

    def predicted_per_node(self) -> float:
        capacity = evaluate(self.deployment())
        if self.pool == "decode" and capacity.decode_batch < self.batch_per_gpu:
            raise PlannerError(f"{self.name}: the KV pool holds {capacity.decode_batch} requests a GPU, not the "
                               f"published {self.batch_per_gpu}")
        rate = capacity.prefill_tokens_per_s if self.pool == "prefill" else capacity.decode_tokens_per_s
        return rate / self.nodes


def load_points() -> list[PoolPoint]:
    document: dict[str, Any] = json.loads(WIDE_EP_POINTS.read_text())
    keep = {name for name in PoolPoint.__dataclass_fields__}
    return [PoolPoint(**{key: value for key, value in point.items() if key in keep}) for point in document["points"]]


def compare_points(points: list[PoolPoint]) -> list[dict[str, Any]]:
    """Each point's published and predicted rate per node and the relative error of the prediction."""
    rows = []
    for point in points:
        predicted = point.predicted_per_node()
        rows.append({"name": point.name, "pool": point.pool, "nodes": point.nodes,
                     "published_per_node": point.published_per_node, "predicted_per_node": round(predicted, 1),
                     "error_pct": round(100 * (predicted / point.published_per_node - 1), 1),
                     "layout": point.deployment().layout()})
    return rows
