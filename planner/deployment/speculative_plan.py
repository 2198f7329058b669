"""Whether speculative decoding pays for a deployment, batch by batch: the step model prices a decode step of B
sequences against a verification of B chunks of K + 1 tokens (and the drafts' own passes), and the expected
tokens a step (`Speculation.expected_tokens_per_step`) turn both into tokens/s.

Memory-bound steps (small batches) cost about the same with K + 1 rows as with one, so speculation multiplies
speed by nearly the expected tokens a step; once the rows' compute dominates, every rejected draft is paid for and
speculation loses. `stops_paying_at` is the first batch (powers of two up to the deployment's) where it does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.core.spec import ModelSpec
from planner.catalog.models import get_model
from planner.cost.step_model import BatchShape
from planner.deployment.capacity import Capacity
from planner.errors import PlannerError
from planner.simulation.speculation import Speculation


def mtp_draft_share(model: ModelSpec) -> float:
    """One MTP draft as a share of a decode step: the module's layer and the output head it shares (about a layer's
    bytes on the big MoE models), over the model's layers."""
    if not model.mtp_layers:
        raise PlannerError(f"{model.name} has no multi-token-prediction layer (num_nextn_predict_layers): use "
                           f"--speculative ngram:K")
    return 2.0 / model.num_layers


def with_draft_cost(speculation: Speculation, model_name: str) -> Speculation:
    """The speculation with its drafts' cost for the model (MTP: `mtp_draft_share`; prompt lookup: none)."""
    if speculation.method == "mtp" and not speculation.draft_step_share:
        return replace(speculation, draft_step_share=mtp_draft_share(get_model(model_name)))
    return speculation


@dataclass(frozen=True)
class SpeculativeGain:
    speculation: Speculation
    by_batch: list[tuple[int, float, float]]     # (batch, decode tokens/s without, with) per replica
    stops_paying_at: int | None                  # the first batch at which it is slower; None: pays at every one

    def summary(self) -> dict:
        single = self.by_batch[0]
        return {"config": self.speculation.describe(),
                "expected_tokens_per_step": round(self.speculation.expected_tokens_per_step, 3),
                "single_stream_decode_tokens_per_s": round(single[2], 3),
                "single_stream_speedup": round(single[2] / single[1], 3),
                "decode_tokens_per_s_by_batch": [{"batch": batch, "plain": round(plain, 2), "speculative": round(
                    drafted, 2)} for batch, plain, drafted in self.by_batch],
                "stops_paying_at_batch": self.stops_paying_at}


def speculative_gain(capacity: Capacity, speculation: Speculation) -> SpeculativeGain:
    deployment, step, topk = capacity.deployment, capacity.step_seconds, capacity.index_topk
    speculation = with_draft_cost(speculation, deployment.model)
    context, drafts = deployment.context, speculation.num_draft_tokens
    batches = [1]
    while batches[-1] * 2 <= max(capacity.decode_batch, 1):
        batches.append(batches[-1] * 2)
    rows, stops = [], None
    for batch in batches:
        decode = step(BatchShape.of([context] * batch, [], topk))
        verify = step(BatchShape.of([], [], topk, [(drafts + 1, context + drafts)] * batch))
        drafting = speculation.draft_step_share * drafts * decode
        plain, drafted = batch / decode, batch * speculation.expected_tokens_per_step / (verify + drafting)
        rows.append((batch, plain, drafted))
        if stops is None and drafted < plain:
            stops = batch
    return SpeculativeGain(speculation, rows, stops)
