"""Workloads for the simulator and the verification: who arrives when, with how many tokens.

Open loops arrive at a rate: Poisson (exponential gaps) or gamma (gaps with a coefficient of variation
above 1: bursts). A closed loop keeps N users each with one request in flight (plus a think time). A
trace replays a JSONL file of {"arrival_s", "prompt_tokens", "output_tokens"} lines. Every random source
(gaps, prompt lengths, output lengths) draws from its own `numpy.random.SeedSequence` child, so changing
one distribution never changes the others' draws, and one seed gives one workload.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planner.errors import PlannerError

ARRIVALS = ("poisson", "gamma", "closed", "trace")
LENGTH_KINDS = ("fixed", "uniform", "lognormal", "trace")


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
    request_id: int
    arrival_s: float | None         # None: a closed-loop user sends it when its previous one ends
    prompt_tokens: int
    output_tokens: int


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

    def requests(self) -> list[RequestSpec]:
        """The requests in arrival order (closed loops: in the order users send them)."""
        if self.arrival == "trace":
            return read_trace(self.trace)
        gaps_seed, prompt_seed, output_seed = np.random.SeedSequence(self.seed).spawn(3)
        n = self.num_requests
        prompts = self.prompt.sample(np.random.default_rng(prompt_seed), n)
        outputs = self.output.sample(np.random.default_rng(output_seed), n)
        gaps_rng = np.random.default_rng(gaps_seed)
        if self.arrival == "closed":
            arrivals = [None] * n
        else:
            if self.arrival == "poisson":
                gaps = gaps_rng.exponential(1.0 / self.rate, n)
            else:
                shape = 1.0 / self.burstiness ** 2              # CV of a gamma = 1 / sqrt(shape)
                gaps = gaps_rng.gamma(shape, 1.0 / (self.rate * shape), n)
            arrivals = np.cumsum(gaps).tolist()
        return [RequestSpec(i, arrivals[i], int(prompts[i]), int(outputs[i])) for i in range(n)]


def read_trace(path: str | Path) -> list[RequestSpec]:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise PlannerError(f"trace {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlannerError(f"trace {str(path)!r} is not readable: {error}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival = float(row.get("arrival_s", row.get("arrival_time")))
            prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise PlannerError(f"trace {str(path)!r} line {number}: expected {{\"arrival_s\", \"prompt_tokens\", "
                               f"\"output_tokens\"}}, got {line[:80]!r}") from None
        if arrival < 0 or prompt <= 0 or output <= 0:
            raise PlannerError(f"trace {str(path)!r} line {number}: times must be >= 0 and token counts positive")
        requests.append(RequestSpec(len(requests), arrival, prompt, output))
    if not requests:
        raise PlannerError(f"trace {str(path)!r} has no requests")
    return sorted(requests, key=lambda r: r.arrival_s)
