"""The chaos soak: a live `engine serve` under a hostile mix of traffic, and what must hold afterwards.

    references: every prompt alone, greedy ─► chaos: `clients` workers of the official `openai` async client
    (streams and whole answers, chat and completions, clients that hang up mid-stream, malformed and over-limit
    requests, wrong and missing keys) while integrity faults strike requests in flight ─► idle: /metrics
    ─► a last wave of streams, SIGTERM in its middle, 503s for newcomers, the process's exit

Checked: every well-formed request not cut off got exactly the greedy token ids its prompt gets alone (through
`return_token_ids`: batching, chunked prefill, preemption and prefix caching change nothing), or ids that are greedy
all along but for near-ties (`greedy_up_to_ties`: the whole returned sequence scored teacher-forced, each token the
best choice after the ones before it or within 0.01 in logit of it, which another batch may round either way;
counted apart and bounded); a stream cut off or a fault's victim got an exact prefix of them (no forgiveness there:
a subtle corruption would show first as just such a flip), every bad request its status, every fault's victims an
integrity error and nobody else one, no KV page held once idle, the resident memory's growth over the second half
under a bound, the drain completing the last wave, exit code 0. Needs the `openai` client (the test extra).
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import openai
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.core.errors import ConfigError
from engine.core.reference_text import reference_text
from engine.harness.launch import ServerProcess
from engine.harness.soak_verdict import BAD_CASES, judge

if TYPE_CHECKING:
    from engine.llm import LLM

MODEL = "smollm2-135m"
API_KEY = "soak-key"
TIE_LOGIT_GAP = 1e-2    # two tokens this close in logit are a greedy near-tie: batching may flip it, no fault does
FAULT_KINDS = ("use_after_free", "foreign_page", "double_allocation", "page_out_of_range", "shared_write",
               "freed_held")   # those the server's default integrity mode (ownership) detects, hash_collision aside
FAULT_ATTEMPTS = 200            # a fault waits for a moment some request in flight can take it


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _http(url: str, body: bytes | None, headers: dict[str, str]) -> Reply:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, response.read())
    except urllib.error.HTTPError as error:
        return Reply(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read())


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    clients: int = 64
    disconnect_share: float = 0.10
    bad_share: float = 0.05
    faults: int = 8
    prompts: int = 24               # distinct prompts, each with a greedy reference
    max_tokens: tuple[int, ...] = (4, 8, 16, 32)
    last_wave_tokens: int = 32      # the streams in flight when SIGTERM comes
    stream_share: float = 0.6
    chat_share: float = 0.25
    memory_gib: float = 0.1         # a KV pool small enough that the clients preempt one another
    max_model_len: int = 1024
    max_body_bytes: int = 65536
    drain_timeout_s: float = 120.0
    rss_growth_bound_mib: float = 64.0
    near_tie_share_bound: float = 0.02      # of the complete answers: more near-ties than this is no rounding
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clients < 2 or self.requests < 2 * self.clients:
            raise ConfigError(f"a soak needs at least 2 clients and twice as many requests, got {self.clients} "
                              f"clients and {self.requests} requests")
        if not 0 <= self.near_tie_share_bound < 1:
            raise ConfigError(f"near_tie_share_bound must be in [0, 1), got {self.near_tie_share_bound}")
        if not 0 <= self.disconnect_share + self.bad_share < 1:
            raise ConfigError(f"disconnect_share + bad_share must be in [0, 1), got "
                              f"{self.disconnect_share + self.bad_share}")

    def server_flags(self) -> list[str]:
        return ["--model", MODEL, "--api-key", API_KEY, "--fault-injection", "--memory-gib", str(self.memory_gib),
                "--max-model-len", str(self.max_model_len), "--max-body-bytes", str(self.max_body_bytes),
                "--max-num-seqs", str(self.clients), "--drain-timeout", str(self.drain_timeout_s)]


@dataclass(frozen=True)
class Planned:
    index: int
    kind: str                   # good, disconnect or one of BAD_CASES
    chat: bool
    prompt: int
    max_tokens: int
    stream: bool
    hang_up_after: int = 0      # disconnect: token chunks read before closing

    @property
    def request_id(self) -> str:
        return f"soak-{self.index}"


@dataclass
class Outcome:
    status: str = "pending"     # ok, error, hung_up
    http_status: int | None = None
    error: str = ""
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)


def plan(config: SoakConfig, count: int, rng: random.Random, first_index: int = 0) -> list[Planned]:
    bad_kinds = sorted(BAD_CASES)
    planned = []
    for index in range(first_index, first_index + count):
        draw = rng.random()
        kind = ("disconnect" if draw < config.disconnect_share else
                rng.choice(bad_kinds) if draw < config.disconnect_share + config.bad_share else "good")
        max_tokens = rng.choice(config.max_tokens)
        stream = kind == "disconnect" or rng.random() < config.stream_share
        planned.append(Planned(index, kind, rng.random() < config.chat_share, rng.randrange(config.prompts),
                               max_tokens, stream, rng.randrange(1, max(2, max_tokens - 1))))
    return planned


def greedy_up_to_ties(scorer: LLM, prompt_ids: list[int], tokens: list[int], gap: float = TIE_LOGIT_GAP) -> int | None:
    """How many of `tokens` are greedy near-ties, when all are greedy but for those: the sequence scored teacher-forced
    after `prompt_ids` (one pass), each token the best choice given every token before it, or within `gap` in logit
    of the best (another batch composition rounds those logits otherwise and may take it). None when any token is
    neither: a near-tie forgives the token where it happens, not what follows it."""
    if not tokens:
        return 0
    logits = scorer.score(prompt_ids + tokens[:-1])[len(prompt_ids) - 1:]
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    behind = logits.max(dim=-1).values - chosen
    return None if bool((behind > gap).any()) else int((behind > 0).sum())


def soak_prompts(count: int) -> list[str]:
    """Prompts of 8-80 words cut from English text shipped with Python."""
    words = reference_text(slice(30)).split()
    rng = random.Random(1)
    prompts = []
    for _ in range(count):
        length = rng.randrange(8, 80)
        start = rng.randrange(len(words) - length)
        prompts.append(" ".join(words[start:start + length]))
    return prompts


class Soak:
    def __init__(self, config: SoakConfig, server: ServerProcess) -> None:
        self.config = config
        self.server = server
        self.prompts = soak_prompts(config.prompts)
        self.references: dict[tuple[bool, int], list[int]] = {}
        self.outcomes: dict[int, Outcome] = {}
        self.planned: dict[int, Planned] = {}
        self.victims: set[str] = set()
        self.faults: list[dict[str, Any]] = []
        self.rss: list[tuple[int, float]] = []      # (requests ended, resident bytes)
        self._scorer: LLM | None = None     # an engine here, made only to judge tokens that differ (`ties`)
        self.client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
        self.stranger = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="not-the-key", max_retries=0)

    async def close(self) -> None:
        await self.client.close()
        await self.stranger.close()

    def ties(self, item: Planned, tokens: list[int]) -> int | None:
        """`greedy_up_to_ties` of a request's tokens after its prompt as the server renders it (completion or chat
        template: the message as the server's protocol dumps it), scored by an engine of the served model made here on
        first use."""
        if self._scorer is None:
            from engine.llm import LLM

            self._scorer = LLM(model=MODEL, weights="fp32", device="cpu", integrity="off", kv_cache_gib=0.05)
        prompt = self.prompts[item.prompt]
        if item.chat:
            prompt = self._scorer.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return greedy_up_to_ties(self._scorer, self._scorer.encode_prompt(prompt), tokens)

    async def raw(self, path: str, body: dict[str, Any] | bytes | None = None, key: str | None = API_KEY) -> Reply:
        """Plain HTTP beside the client (malformed bodies, probes, /metrics), on a thread of the default pool."""
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        return await asyncio.get_running_loop().run_in_executor(None, _http, self.server.url + path, data, headers)

    def _body(self, item: Planned, max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens or item.max_tokens, "temperature": 0}
        if item.chat:
            body["messages"] = [{"role": "user", "content": self.prompts[item.prompt]}]
        else:
            body["prompt"] = self.prompts[item.prompt]
        return body

    async def reference(self, chat: bool, prompt: int) -> None:
        """The greedy tokens of one prompt, sent alone."""
        item = Planned(-1, "good", chat, prompt, 0, False)
        body = self._body(item, max(*self.config.max_tokens, self.config.last_wave_tokens))
        reply = await self.raw("/v1/chat/completions" if chat else "/v1/completions",
                               {**body, "ignore_eos": True, "return_token_ids": True})
        if reply.status != 200:
            raise ConfigError(f"the reference request failed with {reply.status}: {reply.body[:200]!r}")
        self.references[chat, prompt] = reply.json()["choices"][0]["token_ids"]

    async def send(self, item: Planned) -> None:
        self.planned[item.index] = item
        outcome = self.outcomes[item.index] = Outcome()
        try:
            if item.kind in BAD_CASES:
                await self._bad(item, outcome)
            else:
                await self._good(item, outcome)
        except openai.APIStatusError as error:
            outcome.status, outcome.http_status, outcome.error = "error", error.status_code, str(error)[:300]
        except openai.APIError as error:            # an error event at the end of a stream
            outcome.status, outcome.error = "error", str(error)[:300]

    async def _good(self, item: Planned, outcome: Outcome) -> None:
        create = self.client.chat.completions.create if item.chat else self.client.completions.create
        body = self._body(item)
        extra = {"extra_body": {"ignore_eos": True, "return_token_ids": True},
                 "extra_headers": {"X-Request-Id": item.request_id}}
        started = time.perf_counter()
        if not item.stream:
            result = await create(**body, **extra)
            outcome.token_ids = list(result.choices[0].token_ids)
            outcome.status, outcome.http_status = "ok", 200
            return
        stream = await create(**body, **extra, stream=True)
        last = started
        async for chunk in stream:
            ids = [token for choice in chunk.choices for token in (getattr(choice, "token_ids", None) or [])]
            if not ids:
                continue
            now = time.perf_counter()
            if outcome.ttft_s is None:
                outcome.ttft_s = now - started
            else:
                outcome.gaps_s.extend([(now - last) / len(ids)] * len(ids))
            last = now
            outcome.token_ids.extend(ids)
            if item.kind == "disconnect" and len(outcome.token_ids) >= item.hang_up_after:
                await stream.close()
                outcome.status = "hung_up"
                return
        outcome.status, outcome.http_status = "ok", 200

    async def _bad(self, item: Planned, outcome: Outcome) -> None:
        if item.kind == "wrong_key":            # through the official client, which raises AuthenticationError
            await self.stranger.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            return
        body = {**self._body(item), "extra_field_nobody_knows": 1} if item.kind == "unknown_field" else self._body(item)
        content, key = json.dumps(body), API_KEY
        if item.kind == "malformed_json":
            content = content[:-3]
        elif item.kind == "over_context":
            content = json.dumps({**body, "max_tokens": self.config.max_model_len})
        elif item.kind == "too_many_stops":
            content = json.dumps({**body, "stop": ["a", "b", "c", "d", "e"]})
        elif item.kind == "token_out_of_vocab":
            content = json.dumps({"model": MODEL, "prompt": [1, 2, 10**7], "max_tokens": 4})
        elif item.kind == "n_above_one":
            content = json.dumps({**body, "n": 2})
        elif item.kind == "body_too_large":
            content = json.dumps({**body, "user": "x" * self.config.max_body_bytes})
        elif item.kind == "wrong_model":
            content = json.dumps({**body, "model": "gpt-4"})
        elif item.kind == "missing_key":
            key = None
        path = "/v1/chat/completions" if item.chat and item.kind != "token_out_of_vocab" else "/v1/completions"
        reply = await self.raw(path, content.encode(), key)
        outcome.http_status = reply.status
        outcome.status = "ok" if reply.status == 200 else "error"
        if reply.headers.get("content-type") == "application/json":
            outcome.error = str(reply.json().get("error", {}).get("message", ""))[:300]

    async def worker(self, queue: asyncio.Queue[Planned]) -> None:
        while not queue.empty():
            await self.send(queue.get_nowait())

    async def metrics(self) -> dict[str, float]:
        reply = await self.raw("/metrics")
        return {sample.name: sample.value for family in text_string_to_metric_families(reply.body.decode())
                for sample in family.samples if not sample.labels}

    async def watch_memory(self, done: asyncio.Event) -> None:
        while not done.is_set():
            values = await self.metrics()
            self.rss.append((sum(o.status != "pending" for o in self.outcomes.values()),
                             values["process_resident_memory_bytes"]))
            await asyncio.sleep(0.5)

    async def strike(self, total: int) -> None:
        """Faults at evenly spread moments of the run, each into whichever requests are in flight then."""
        for number in range(self.config.faults):
            while sum(o.status != "pending" for o in self.outcomes.values()) < (number + 1) * total // (
                    self.config.faults + 1):
                await asyncio.sleep(0.05)
            kind = FAULT_KINDS[number % len(FAULT_KINDS)]
            for attempt in range(FAULT_ATTEMPTS):
                reply = await self.raw("/debug/faults", {"kind": kind, "seed": number * 1000 + attempt})
                if reply.status == 200:
                    answer = reply.json()
                    self.faults.append(answer)
                    self.victims.update(answer["victims"])
                    break
                await asyncio.sleep(0.02)

    async def wait_idle(self, timeout_s: float = 120.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            values = await self.metrics()
            if values["kvplan_requests_running"] == 0 and values["kvplan_requests_waiting"] == 0:
                return values
            if time.monotonic() > deadline:
                raise ConfigError(f"the server never went idle: {values}")
            await asyncio.sleep(0.1)

    async def last_wave(self, first_index: int) -> dict[str, Any]:
        """Streams in flight, SIGTERM among them: they complete, newcomers get 503, the process exits 0."""
        wave = [Planned(first_index + i, "good", False, i % self.config.prompts, self.config.last_wave_tokens, True)
                for i in range(self.config.clients)]
        tasks = [asyncio.ensure_future(self.send(item)) for item in wave]
        deadline = time.monotonic() + 300
        while any(not self.outcomes.get(item.index, Outcome()).token_ids for item in wave):
            if time.monotonic() > deadline:
                raise ConfigError("the last wave never started streaming")
            await asyncio.sleep(0.02)
        self.server.process.send_signal(signal.SIGTERM)
        probes = []
        deadline = time.monotonic() + 60
        while (await self.raw("/health")).status != 503:       # draining once the signal was handled
            if time.monotonic() > deadline:
                raise ConfigError("the server never said it was draining after SIGTERM")
            await asyncio.sleep(0.01)
        for _ in range(3):
            probe = await self.raw("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            probes.append((probe.status, probe.headers.get("retry-after")))
        await asyncio.gather(*tasks)
        exit_code = await asyncio.get_running_loop().run_in_executor(None, self.server.process.wait, 120)
        drained = [line for line in self.server.stderr.splitlines() if "drained:" in line]
        return {"streams": len(wave), "probe_statuses": [status for status, _ in probes],
                "probes_with_retry_after": sum(1 for _, after in probes if after), "exit_code": exit_code,
                "drain_line": drained[-1] if drained else ""}


async def _run(config: SoakConfig, server: ServerProcess) -> dict[str, Any]:
    soak = Soak(config, server)
    rng = random.Random(config.seed)
    try:
        started = time.perf_counter()
        for chat in (False, True):
            for prompt in range(config.prompts):
                await soak.reference(chat, prompt)
        references_s, started = time.perf_counter() - started, time.perf_counter()
        total = config.requests - config.clients
        queue: asyncio.Queue[Planned] = asyncio.Queue()
        for item in plan(config, total, rng):
            queue.put_nowait(item)
        done = asyncio.Event()
        watcher = asyncio.ensure_future(soak.watch_memory(done))
        striker = asyncio.ensure_future(soak.strike(total))
        await asyncio.gather(*(soak.worker(queue) for _ in range(config.clients)))
        await striker
        idle = await soak.wait_idle()
        done.set()
        await watcher
        chaos_s, started = time.perf_counter() - started, time.perf_counter()
        shutdown = await soak.last_wave(total)
        report = judge(soak, idle, shutdown)
        report["seconds"] = {"references": round(references_s, 1), "chaos": round(chaos_s, 1),
                             "last_wave": round(time.perf_counter() - started, 1)}
        return report
    finally:
        await soak.close()


def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Starts `engine serve`, soaks it, stops it; the report (its "failures" empty when everything held)."""
    server = ServerProcess(config.server_flags())
    try:
        return asyncio.run(_run(config, server))
    finally:
        server.close()
