"""Speculative decoding as the simulator draws it: how many drafts a decoding sequence proposes each step, and
how many of them stand.

The engine's scheduler and block manager do the rest: a sequence with drafts computes its last token and the
drafts as one chunk, which the step model prices as such (K + 1 query tokens over its context), and gives back
the slots of the drafts that fell. Acceptance is per position: `acceptance[i]` is the chance that draft i + 1
stands once draft i stood (the last value holds for later positions), so a constant rate a gives the familiar
1 + a + ... + a^K expected tokens a step.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from planner.errors import PlannerError

# DeepSeek-V3 technical report (https://arxiv.org/abs/2412.19437, December 2024, section 5.4.3): "the acceptance
# rate of the second token prediction ranges between 85% and 90% across various generation topics" (one MTP module,
# K = 1). Quoted from the report as remembered: the search library here did not hold it to re-read (2026-12-04).
MTP_ACCEPTANCE = 0.875
METHODS = ("ngram", "mtp")


class Drafting(Protocol):
    """How one request drafts: a `Speculation`'s draws, or a served run's outcomes replayed."""

    def draw_drafts(self, rng: random.Random, room: int) -> int: ...

    def draw_accepted(self, rng: random.Random, drafts: int) -> int: ...


@dataclass(frozen=True)
class Speculation:
    method: str
    num_draft_tokens: int
    acceptance: tuple[float, ...]
    draft_lengths: tuple[float, ...] | None = None     # P(k drafts proposed), k = 0..K; None: always K
    # what proposing one draft costs, as a share of a decode step of the same batch (prompt lookup: nothing; an
    # MTP module: its layer and the output head, `planner.deployment.simulate.mtp_draft_share`)
    draft_step_share: float = 0.0
    # requests' own drafting by request id, where measured (a verification hands over the engine's: prompt lookup
    # drafts all of one request and none of another, and the one that never drafts sets the makespan); the others
    # draw from the figures above
    by_request: dict[int, Drafting] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise PlannerError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 16:
            raise PlannerError(f"speculative draft tokens must be in 1..16, got {self.num_draft_tokens!r}")
        if not self.acceptance or not all(0 <= rate <= 1 for rate in self.acceptance):
            raise PlannerError(f"acceptance rates must be in [0, 1], got {self.acceptance!r}")
        if not self.draft_step_share >= 0:
            raise PlannerError(f"the draft's step share must be >= 0, got {self.draft_step_share!r}")
        if self.draft_lengths is not None and (len(self.draft_lengths) != self.num_draft_tokens + 1
                                               or abs(sum(self.draft_lengths) - 1) > 1e-6
                                               or min(self.draft_lengths) < 0):
            raise PlannerError(f"draft lengths must be {self.num_draft_tokens + 1} probabilities summing to 1, got "
                               f"{self.draft_lengths!r}")

    @classmethod
    def parse(cls, text: str, acceptance: str | None = None) -> Speculation:
        """`ngram:K` or `mtp:K` with an acceptance rate (`0.7`) or per-position rates (`0.9,0.8,0.6`); MTP's
        default is the DeepSeek-V3 report's."""
        method, _, count = text.partition(":")
        if not count.isdigit():
            raise PlannerError(f"--speculative takes METHOD:K (ngram:4, mtp:1), got {text!r}")
        if acceptance is None:
            if method != "mtp":
                raise PlannerError(f"--speculative {text} needs --acceptance (measured: `engine generate "
                                   f"--speculative {text}` or a served run reports it)")
            rates = (MTP_ACCEPTANCE,)
        else:
            try:
                rates = tuple(float(part) for part in acceptance.split(","))
            except ValueError:
                raise PlannerError(f"--acceptance takes a rate or comma-separated rates, got {acceptance!r}") from None
        return cls(method, int(count), rates)

    def of_request(self, request_id: int) -> Drafting:
        """How the request drafts: its own measured figures, else the deployment's."""
        return self.by_request.get(request_id, self) if self.by_request else self

    def rate(self, position: int) -> float:
        return self.acceptance[min(position, len(self.acceptance) - 1)]

    def expected_tokens(self, drafts: int | None = None) -> float:
        """Tokens a step appends to a sequence with `drafts` drafts (default K): 1 + the expected drafts that
        stand."""
        count = self.num_draft_tokens if drafts is None else drafts
        total, standing = 1.0, 1.0
        for position in range(count):
            standing *= self.rate(position)
            total += standing
        return total

    @property
    def expected_tokens_per_step(self) -> float:
        if self.draft_lengths is None:
            return self.expected_tokens()
        return sum(share * self.expected_tokens(length) for length, share in enumerate(self.draft_lengths))

    def draw_drafts(self, rng: random.Random, room: int) -> int:
        """How many drafts a decoding sequence proposes this step, at most `room`."""
        count = self.num_draft_tokens
        if self.draft_lengths is not None:
            count = rng.choices(range(len(self.draft_lengths)), self.draft_lengths)[0]
        return max(0, min(count, room))

    def draw_accepted(self, rng: random.Random, drafts: int) -> int:
        accepted = 0
        while accepted < drafts and rng.random() < self.rate(accepted):
            accepted += 1
        return accepted

    def describe(self) -> str:
        rates = ",".join(f"{rate:g}" for rate in self.acceptance)
        return f"{self.method}:{self.num_draft_tokens} (acceptance {rates}, {self.expected_tokens_per_step:.2f} " \
               f"tokens a step)"
