"""Speculative decoding's torch-free half: the configuration, and prompt-lookup (n-gram) drafts.

A decode step with drafts computes K + 1 tokens of a sequence at once: its last token and K proposed ones, over
the paged cache like a prefill chunk. The target's own next-token choices at those positions decide how many
drafts stand (`engine.executor.sampler.verify_drafts`); the slots of the rejected ones are given back. Greedy
output is the same token for token; sampled output keeps the target distribution (rejection sampling).

Prompt lookup proposes, for the last n tokens of a sequence (n from `ngram_max` down to `ngram_min`), the K
tokens that followed their latest earlier occurrence in the prompt or the output so far: edits, summaries and
code rewrites repeat long runs of given text.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.errors import ConfigError

METHODS = ("ngram", "mtp")
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_draft_tokens: int
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"speculative draft tokens must be in 1..{MAX_DRAFT_TOKENS}, got "
                              f"{self.num_draft_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"n-gram sizes need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                              f"{self.ngram_max}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """`ngram:K` or `mtp:K`, as `--speculative` takes it."""
        method, _, count = text.partition(":")
        if not count.isdigit():
            raise ConfigError(f"--speculative takes METHOD:K (ngram:4, mtp:1), got {text!r}")
        return cls(method, int(count))


class NgramIndex:
    """Where each n-gram of one sequence last occurred with a token after it, kept as tokens arrive (a scan of
    the whole sequence every step would cost its length)."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.latest: dict[tuple[int, ...], int] = {}    # n-gram -> its latest start followed by a token
        self.indexed = 0                                # n-grams ending before this position are in `latest`

    def update(self, tokens: list[int]) -> None:
        """Indexes the n-grams that now have a token after them (those ending before the last token)."""
        for end in range(self.indexed + 1, len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.latest[tuple(tokens[end - n:end])] = end - n
        self.indexed = max(self.indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], count: int) -> list[int]:
        self.update(tokens)
        for n in reversed(self.sizes):
            if len(tokens) <= n:
                continue
            start = self.latest.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + count]
        return []


class NgramProposer:
    """Prompt-lookup drafts for the running sequences (one index each, dropped when the sequence ends)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, tokens: list[int], room: int) -> list[int]:
        """Up to K drafts for the sequence whose tokens so far are `tokens`, at most `room` (what its max_tokens
        and context leave after the token the step samples anyway)."""
        count = min(self.config.num_draft_tokens, room)
        if count <= 0:
            return []
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(range(self.config.ngram_min, self.config.ngram_max + 1))
        return index.propose(tokens, count)

    def release(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)


class DraftStats:
    """What speculation did, in the terms the planner draws it (`planner.simulation.speculation`): how many drafts
    each decode verified (0 for a plain decode), and for each draft position how often it was tried (every draft
    before it stood) and how often it stood."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.lengths = [0] * (num_draft_tokens + 1)
        self.tried = [0] * num_draft_tokens
        self.stood = [0] * num_draft_tokens

    def record(self, plain_decodes: int, verified: list[tuple[int, int]]) -> None:
        """One step: its decodes without drafts, and (drafts, of them accepted) of each verification."""
        self.lengths[0] += plain_decodes
        for drafts, accepted in verified:
            self.lengths[drafts] += 1
            for position in range(min(accepted + 1, drafts)):
                self.tried[position] += 1
            for position in range(accepted):
                self.stood[position] += 1

    @property
    def draft_tokens(self) -> int:
        return sum(length * count for length, count in enumerate(self.lengths))

    @property
    def accepted_tokens(self) -> int:
        return sum(self.stood)

    def acceptance_by_position(self) -> list[float]:
        """P(draft i stands | every draft before it stood), for the positions tried at least once."""
        return [stood / tried for stood, tried in zip(self.stood, self.tried) if tried]

    def draft_length_shares(self) -> list[float]:
        total = sum(self.lengths)
        return [count / total for count in self.lengths] if total else []

    def summary(self) -> dict[str, object]:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_by_position": [round(rate, 4) for rate in self.acceptance_by_position()],
                "draft_length_shares": [round(share, 4) for share in self.draft_length_shares()]}
