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
