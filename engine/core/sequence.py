"""A request as the scheduler sees it: token ids, progress and sampling settings. Torch-free."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from engine.core.errors import RequestError
from engine.core.prefix_cache import chain_hash, page_key, root_hash, validate_cache_salt


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"              # an end-of-sequence or stop token
    LENGTH = "length"          # max_tokens or the model's context reached
    ABORT = "abort"            # aborted through the step API
    INTEGRITY_ERROR = "integrity_error"   # a KV-cache integrity check failed: aborted before answering


_ids = itertools.count()


class Sequence:
    """One request. `num_computed_tokens` counts tokens whose KV is in the cache; `num_cached_tokens` those of
    them that a prefix-cache hit supplied when the request was first admitted (OpenAI's `cached_tokens`)."""

    # With prefix caching its full pages are published as they fill. A request known to share no token with any
    # other (the simulator's) publishes them only when it is preempted, the one time anyone could hit them.
    publishes_eagerly = True

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float = 0.0,
                 seq_id: int | None = None, cache_salt: str | None = None) -> None:
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_tokens = len(self.prompt_token_ids)        # prompt + output, kept as tokens are appended
        self._max_tokens = params.max_tokens
        self._stop_ids = frozenset(self.eos_token_ids) | frozenset(params.stop_token_ids)
        try:
            self.cache_salt = validate_cache_salt(cache_salt)
        except ValueError as error:
            raise RequestError(str(error)) from None
        self.num_cached_tokens: int | None = None       # set at the first admission
        self.page_hashes: list[bytes] = []              # names of its full pages so far (`page_names`)
        self.page_keys: list[bytes] = []
        self.draft_token_ids: list[int] = []            # speculative tokens proposed for the next step
        self.keeps_pages = False        # a disaggregated prefill's: its pages outlive its end until copied out

    def page_names(self, count: int, page_size: int) -> tuple[list[bytes], list[bytes]]:
        """The chained hashes and token keys of its first `count` full pages (`engine.core.prefix_cache`),
        computed once each."""
        hashes, keys = self.page_hashes, self.page_keys
        parent = hashes[-1] if hashes else root_hash(self.cache_salt)
        for index in range(len(hashes), count):
            key = page_key(self.token_ids_between(index * page_size, (index + 1) * page_size))
            parent = chain_hash(parent, key)
            keys.append(key)
            hashes.append(parent)
        return hashes, keys

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - prompt)]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int) -> bool:
        """Records a sampled token and finishes the sequence when a stop condition holds; True if it did."""
        outputs = self.output_token_ids
        outputs.append(token_id)
        self.num_tokens += 1
        if token_id in self._stop_ids:
            self.finish(FinishReason.STOP)
            return True
        if len(outputs) >= self._max_tokens or self.num_tokens >= max_model_len:
            self.finish(FinishReason.LENGTH)
            return True
        return False

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
