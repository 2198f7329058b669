"""Workloads for the simulator and the verification: who arrives when, with how many tokens.

Open loops arrive at a rate: Poisson (exponential gaps) or gamma (gaps with a coefficient of variation
above 1: bursts). A closed loop keeps N users each with one request in flight (plus a think time). A
trace replays a JSONL file of {"arrival_s", "prompt_tokens", "output_tokens"} lines. Every random source
(gaps, prompt lengths, output lengths, token identities) draws from its own `numpy.random.SeedSequence` child,
so changing one distribution never changes the others' draws, and one seed gives one workload.

Prompts can share prefixes, which a prefix cache turns into hits:

    shared system prompt     every conversation opens with the same `shared_prefix_tokens` tokens
    multi-turn sessions      `turns` requests per session: turn k's prompt is the conversation so far (every
                             earlier prompt and answer) plus a new message of `prompt` tokens, sent
                             `think_time_s` after turn k-1 ended
    agent traces             JSONL lines with a "session_id": a session's later lines extend its transcript by
                             their "new_tokens" (or grow it to their "prompt_tokens"), "think_s" after the last
                             line's answer

Such requests carry token identities (`RequestSpec.prompt_ids`): ids that say which tokens are the same, all
that hashing a page needs; the simulator builds each turn's prompt from its predecessor's prompt and answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planner.errors import PlannerError

ARRIVALS = ("poisson", "gamma", "closed", "trace")
LENGTH_KINDS = ("fixed", "uniform", "lognormal", "trace")
TOKEN_IDS = (3, 256)        # the range token identities are drawn from: in every vocabulary, and small ints


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts: fixed(value), uniform(low..high inclusive), lognormal(median value, sigma), or drawn
    from a list of observed lengths (`values`, kind "trace")."""

    kind: str = "fixed"
    value: int = 128
    low: int = 1
    high: int = 1
    sigma: float = 0.5
    values: tuple[int, ...] = ()
    maximum: int | None = None          # clip (lognormal tails)

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise PlannerError(f"unknown length distribution {self.kind!r} (choose from {', '.join(LENGTH_KINDS)})")
        if self.kind in ("fixed", "lognormal") and self.value <= 0:
            raise PlannerError(f"token count must be positive, got {self.value!r}")
        if self.kind == "uniform" and not 0 < self.low <= self.high:
            raise PlannerError(f"uniform lengths need 0 < low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and not self.sigma > 0:
            raise PlannerError(f"lognormal sigma must be positive, got {self.sigma!r}")
        if self.kind == "trace" and (not self.values or min(self.values) <= 0):
            raise PlannerError("a trace length distribution needs positive observed lengths")

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        """CLI form: `512`, `uniform:64:1024`, `lognormal:300:0.8`, or `trace:FILE.jsonl:prompt_tokens`."""
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            if parts[0] == "uniform" and len(parts) == 3:
                return cls("uniform", low=int(parts[1]), high=int(parts[2]))
            if parts[0] == "lognormal" and len(parts) == 3:
                return cls("lognormal", int(parts[1]), sigma=float(parts[2]))
            if parts[0] == "trace" and len(parts) == 3:
                return cls("trace", values=tuple(getattr(r, parts[2]) for r in read_trace(parts[1])))
        except (ValueError, AttributeError):
            pass
        raise PlannerError(f"bad length {text!r} (use N, uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA, "
                           f"or trace:FILE:prompt_tokens|output_tokens)")

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if self.kind == "fixed":
            lengths = np.full(count, self.value)
        elif self.kind == "uniform":
            lengths = rng.integers(self.low, self.high + 1, count)
        elif self.kind == "lognormal":
            lengths = np.maximum(1, np.rint(self.value * np.exp(self.sigma * rng.standard_normal(count))))
        else:
            lengths = rng.choice(np.array(self.values), count)
        if self.maximum is not None:
            lengths = np.minimum(lengths, self.maximum)
        return lengths.astype(int)


@dataclass(frozen=True)
class RequestSpec:
    """One request. `prompt_ids`: its own tokens' identities (the whole prompt, or with `follows` the new message
    after the transcript); None: tokens no other request shares. `follows`: the request of the same session whose
    prompt and answer open this one's prompt; it is sent `think_s` after that one ends."""

    request_id: int
    arrival_s: float | None         # None: sent when its predecessor ends (closed-loop user, or previous turn)
    prompt_tokens: int
    output_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    follows: int | None = None
    think_s: float = 0.0
    session: int | None = None


@dataclass(frozen=True)
class Workload:
    arrival: str = "poisson"
    num_requests: int = 100
    rate: float | None = None               # requests per second (poisson, gamma)
    burstiness: float = 2.0                 # gamma: coefficient of variation of the gaps (1 = Poisson)
    users: int | None = None                # closed loop
    think_time_s: float = 0.0
    prompt: LengthDistribution = field(default_factory=LengthDistribution)
    output: LengthDistribution = field(default_factory=lambda: LengthDistribution("fixed", 128))
    trace: str | None = None
    seed: int = 0
    shared_prefix_tokens: int = 0           # a system prompt every conversation opens with
    turns: int = 1                          # requests per session (multi-turn conversations)

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise PlannerError(f"unknown workload {self.arrival!r} (choose from {', '.join(ARRIVALS)})")
        if self.arrival != "trace" and (not isinstance(self.num_requests, int) or self.num_requests <= 0):
            raise PlannerError(f"the number of requests must be a positive integer, got {self.num_requests!r}")
        if self.arrival in ("poisson", "gamma") and not (self.rate is not None and self.rate > 0):
            raise PlannerError(f"a {self.arrival} workload needs a positive --rate, got {self.rate!r}")
        if self.arrival == "gamma" and not self.burstiness > 0:
            raise PlannerError(f"burstiness must be positive, got {self.burstiness!r}")
        if self.arrival == "closed" and not (isinstance(self.users, int) and self.users > 0):
            raise PlannerError(f"a closed loop needs a positive number of --users, got {self.users!r}")
        if self.arrival == "trace" and not self.trace:
            raise PlannerError("a trace workload needs --trace FILE")
        if self.think_time_s < 0:
            raise PlannerError(f"think time must be >= 0, got {self.think_time_s!r}")
        if not (isinstance(self.shared_prefix_tokens, int) and self.shared_prefix_tokens >= 0):
            raise PlannerError(f"the shared prefix must be a non-negative number of tokens, got "
                               f"{self.shared_prefix_tokens!r}")
        if not (isinstance(self.turns, int) and self.turns >= 1):
            raise PlannerError(f"turns per session must be a positive integer, got {self.turns!r}")
        if self.arrival == "trace" and self.turns > 1:
            raise PlannerError("a trace says its sessions itself (\"session_id\"); --turns is for generated workloads")

    @property
    def shares_prefixes(self) -> bool:
        """Whether requests share tokens (so that a prefix cache matters beyond a preempted request's own)."""
        return self.shared_prefix_tokens > 0 or self.turns > 1 or (
            self.arrival == "trace" and any(r.prompt_ids is not None for r in self.requests()))

    def requests(self) -> list[RequestSpec]:
        """The requests in arrival order (closed loops: in the order users send them; a session's later turns
        after its first, sent when their predecessors end)."""
        gaps_seed, prompt_seed, output_seed, token_seed = np.random.SeedSequence(self.seed).spawn(4)
        if self.arrival == "trace":
            return read_trace(self.trace, self.shared_prefix_tokens, self.think_time_s, token_seed)
        n = self.num_requests
        prompts = self.prompt.sample(np.random.default_rng(prompt_seed), n)
        outputs = self.output.sample(np.random.default_rng(output_seed), n)
        gaps_rng = np.random.default_rng(gaps_seed)
        sessions = -(-n // self.turns)
        if self.arrival == "closed":
            arrivals = [None] * sessions
        else:
            rate = self.rate / self.turns       # conversations start at this rate: requests arrive at `rate`
            if self.arrival == "poisson":
                gaps = gaps_rng.exponential(1.0 / rate, sessions)
            else:
                shape = 1.0 / self.burstiness ** 2              # CV of a gamma = 1 / sqrt(shape)
                gaps = gaps_rng.gamma(shape, 1.0 / (rate * shape), sessions)
            arrivals = np.cumsum(gaps).tolist()
        if not (self.shared_prefix_tokens or self.turns > 1):
            return [RequestSpec(i, arrivals[i], int(prompts[i]), int(outputs[i])) for i in range(n)]
        tokens = TokenIdentities(token_seed, self.shared_prefix_tokens)
        requests: list[RequestSpec] = []
        for session in range(sessions):
            previous = None
            for request_id in range(session * self.turns, min(n, (session + 1) * self.turns)):
                own = tokens.draw(int(prompts[request_id]))
                if previous is None:
                    request = RequestSpec(request_id, arrivals[session], len(tokens.system) + len(own),
                                          int(outputs[request_id]), tokens.system + own, session=session)
                else:
                    request = RequestSpec(request_id, None, previous.prompt_tokens + previous.output_tokens + len(own),
                                          int(outputs[request_id]), own, previous.request_id, self.think_time_s,
                                          session)
                requests.append(request)
                previous = request
        return requests


class TokenIdentities:
    """Token ids for requests that share prefixes: the system prompt, then fresh ids for each new message."""

    def __init__(self, seed: np.random.SeedSequence, system_tokens: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.system = self.draw(system_tokens)

    def draw(self, count: int) -> tuple[int, ...]:
        return tuple(self._rng.integers(*TOKEN_IDS, count).tolist())


def read_trace(path: str | Path, shared_prefix_tokens: int = 0, think_time_s: float = 0.0,
               token_seed: np.random.SeedSequence | None = None) -> list[RequestSpec]:
    """The requests of a JSONL trace. Lines without a "session_id" are independent requests ({"arrival_s",
    "prompt_tokens", "output_tokens"}); with one, a session's first line opens a conversation (with the shared
    system prompt, if any), and its later lines continue it: "new_tokens" more (or up to "prompt_tokens" in all),
    sent "think_s" (default `think_time_s`) after the previous line's answer; their "arrival_s" is not used."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise PlannerError(f"trace {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlannerError(f"trace {str(path)!r} is not readable: {error}") from None
    requests: list[RequestSpec] = []
    last_of: dict[str, RequestSpec] = {}
    tokens = TokenIdentities(token_seed or np.random.SeedSequence(0), shared_prefix_tokens)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"trace {str(path)!r} line {number}"
        try:
            row = json.loads(line)
            session = row.get("session_id")
            previous = last_of.get(str(session)) if session is not None else None
            output = int(row["output_tokens"])
            if previous is None:
                arrival = float(row.get("arrival_s", row.get("arrival_time")))
                own = int(row["prompt_tokens"]) if "prompt_tokens" in row else int(row["new_tokens"])
                think = 0.0
            else:
                arrival = 0.0
                transcript = previous.prompt_tokens + previous.output_tokens
                own = int(row["new_tokens"]) if "new_tokens" in row else int(row["prompt_tokens"]) - transcript
                think = float(row.get("think_s", think_time_s))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise PlannerError(f"{where}: expected {{\"arrival_s\", \"prompt_tokens\", \"output_tokens\"}} (and "
                               f"for sessions \"session_id\", \"new_tokens\"), got {line[:80]!r}") from None
        if arrival < 0 or own <= 0 or output <= 0 or think < 0:
            raise PlannerError(f"{where}: times must be >= 0 and token counts positive (a session's prompt_tokens "
                               f"must exceed its transcript so far)")
        request_id = len(requests)
        if session is None and not shared_prefix_tokens:
            request = RequestSpec(request_id, arrival, own, output)
        elif session is None:
            request = RequestSpec(request_id, arrival, shared_prefix_tokens + own, output,
                                  tokens.system + tokens.draw(own))
        elif previous is None:
            request = RequestSpec(request_id, arrival, shared_prefix_tokens + own, output,
                                  tokens.system + tokens.draw(own), session=request_id)
        else:
            request = RequestSpec(request_id, None, previous.prompt_tokens + previous.output_tokens + own, output,
                                  tokens.draw(own), previous.request_id, think, previous.session)
        if session is not None:
            last_of[str(session)] = request
        requests.append(request)
    if not requests:
        raise PlannerError(f"trace {str(path)!r} has no requests")
    return sorted(requests, key=lambda r: (r.arrival_s is None, r.arrival_s or 0.0, r.request_id))
