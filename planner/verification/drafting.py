"""Each request's drafting as the engine served it, for the simulator to draw from.

The engine's acceptance is not one rate that every request shares: over prompts that repeat themselves, prompt
lookup drafts four tokens a step that all stand for one request and finds nothing for another, whose answer then
takes a token a step and outlasts the rest. Drawn from the average, every simulated request drafts alike and the
workload ends early (output tokens/s +17-22% in three runs of the speculative verification). The served steps say
it per request: a step that starts a decoding sequence at token s with n new tokens checks n - 1 drafts, and the
sequence's next step starts past the ones that stood.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.simulation.speculation import Speculation
from planner.simulation.workload import RequestSpec

if TYPE_CHECKING:
    from engine.harness.served_run import ServedStep


def served_outcomes(steps: Sequence[ServedStep], specs: Sequence[RequestSpec]) -> dict[int, list[tuple[int, int]]]:
    """Per request id, in order, each decode step's (drafts checked, drafts that stood). `specs` in the order the
    served steps index them; every request generates exactly its output tokens (the verification's requests
    ignore EOS)."""
    items: dict[int, list[tuple[int, int]]] = {}
    for step in steps:
        for index, start, new_tokens in step.batch:
            items.setdefault(index, []).append((start, new_tokens))
    outcomes = {}
    for index, spec in enumerate(specs):
        decodes = [(start, new) for start, new in items.get(index, []) if start >= spec.prompt_tokens]
        ends = [start for start, _ in decodes[1:]] + [spec.prompt_tokens + spec.output_tokens]
        done = [(new - 1, min(new - 1, max(0, end - start - 1))) for (start, new), end in zip(decodes, ends)
                if end > start]
        if done:
            outcomes[spec.request_id] = done
    return outcomes


def drafting_by_request(outcomes: dict[int, list[tuple[int, int]]], overall: Speculation) -> dict[int, Speculation]:
    """Per request id: the draft lengths its decode steps proposed and the acceptance of each draft position (a
    position it never tried keeps the overall rate), to draw from."""
    return {request_id: _speculation(done, overall) for request_id, done in outcomes.items()}


class ReplayedDrafts:
    """One request's served outcomes, in order: a replay of the engine's own steps drafts and accepts exactly as
    the engine did (then none once they run out)."""

    def __init__(self, outcomes: list[tuple[int, int]]) -> None:
        self._outcomes = iter(outcomes)
        self._accepted = 0

    def draw_drafts(self, rng: object, room: int) -> int:
        drafts, self._accepted = next(self._outcomes, (0, 0))
        return max(0, min(drafts, room))

    def draw_accepted(self, rng: object, drafts: int) -> int:
        return min(self._accepted, drafts)


def _speculation(outcomes: list[tuple[int, int]], overall: Speculation) -> Speculation:
    """From (drafts checked, drafts that stood) per decode step."""
    count = overall.num_draft_tokens
    lengths = [0] * (count + 1)
    tried, stood = [0] * count, [0] * count
    for drafts, accepted in outcomes:
        lengths[min(drafts, count)] += 1
        for position in range(min(drafts, count)):
            if position > accepted:
                break
            tried[position] += 1
            stood[position] += position < accepted
    rates = tuple(stood[p] / tried[p] if tried[p] else overall.rate(p) for p in range(count))
    shares = tuple(n / len(outcomes) for n in lengths)
    return Speculation(overall.method, count, rates, shares, overall.draft_step_share)
