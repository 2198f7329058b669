"""The HTTP side of an OpenAI-compatible endpoint: its served model and KV pool shape (from `/models` and
`/metrics`), and an asyncio client that streams completions of token-id prompts and records when every token
arrived."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from engine.core.metrics import RequestTiming
from planner.errors import PlannerError
from planner.simulation.workload import RequestSpec

PROMPT_ID_RANGE = (1000, 20000)     # token ids of the synthetic prompts: clear of special tokens in real vocabularies


REQUEST_TIMEOUT_S = 600.0


T = TypeVar("T")


@dataclass
class StreamTiming:
    """One streamed request as the client saw it (perf_counter seconds)."""

    prompt_tokens: int
    sent_s: float = 0.0
    token_s: list[float] = field(default_factory=list)      # arrival of each chunk that carried tokens
    completion_tokens: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True)
class ServerShape:
    """The scheduler limits and the KV pool of the server, as published or given."""

    kind: str                     # kvplan, vllm, sglang or unknown
    capacity_tokens: int | None
    page_size: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    max_model_len: int | None


def _get(url: str, timeout_s: float = 10.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as error:
        raise PlannerError(f"cannot reach {url}: {getattr(error, 'reason', error)}") from None


def base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise PlannerError(f"the endpoint must be an http(s) URL, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


def served_model(url: str) -> str:
    """The first model the endpoint lists at /v1/models."""
    listing = _get(f"{base_url(url)}/v1/models")
    try:
        return json.loads(listing)["data"][0]["id"]
    except (KeyError, IndexError, TypeError, ValueError):
        raise PlannerError(f"{url} does not list a model at /v1/models") from None


def server_shape(url: str) -> ServerShape:
    """What `/metrics` says of the pool and the limits (kvplan, vLLM, SGLang); None where it says nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = _get(f"{base_url(url)}/metrics").decode()
    except PlannerError:
        return ServerShape("unknown", None, None, None, None, None)
    samples = {sample.name: sample for family in text_string_to_metric_families(text) for sample in family.samples}

    def label_int(sample_name: str, label: str) -> int | None:
        sample = samples.get(sample_name)
        value = sample.labels.get(label) if sample is not None else None
        return int(float(value)) if value not in (None, "", "None") else None

    ours, vllm = "kvplan_cache_config_info", "vllm:cache_config_info"
    if ours in samples:
        pages, page = label_int(ours, "num_pages"), label_int(ours, "page_size")
        return ServerShape("kvplan", pages * page, page, label_int(ours, "max_num_seqs"),
                           label_int(ours, "max_num_batched_tokens"), label_int(ours, "max_model_len"))
    if vllm in samples:
        blocks, block = label_int(vllm, "num_gpu_blocks"), label_int(vllm, "block_size")
        return ServerShape("vllm", blocks * block if blocks and block else None, block, None, None, None)
    if "sglang:max_total_num_tokens" in samples:
        return ServerShape("sglang", int(samples["sglang:max_total_num_tokens"].value), None, None, None, None)
    return ServerShape("unknown", None, None, None, None, None)


def synthetic_prompt(length: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    low, high = PROMPT_ID_RANGE
    return rng.integers(low, min(high, vocab_size), length).tolist()


class Client:
    """Streams completions from the endpoint with the official `openai` client, timing every chunk."""

    def __init__(self, url: str, model: str) -> None:
        from openai import AsyncOpenAI

        self.url, self.model = base_url(url), model
        self._client = AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                   timeout=REQUEST_TIMEOUT_S)

    async def stream(self, prompt: list[int], max_tokens: int, timing: StreamTiming) -> StreamTiming:
        from openai import OpenAIError

        timing.sent_s = time.perf_counter()
        try:
            chunks = await self._client.completions.create(
                model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in chunks:
                now = time.perf_counter()
                if chunk.usage is not None:
                    timing.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.text or choice.finish_reason is None:
                        timing.token_s.append(now)
                    timing.finish_reason = choice.finish_reason or timing.finish_reason
        except OpenAIError as error:
            raise PlannerError(f"the endpoint {self.url} failed a request: {str(error).splitlines()[0]}") from None
        if not timing.completion_tokens:
            timing.completion_tokens = len(timing.token_s)
        return timing

    async def close(self) -> None:
        await self._client.close()


def with_client(work: Callable[[Client], Awaitable[T]], url: str, model: str) -> T:
    """Runs `work(client)` on a fresh event loop, closing the client after."""
    async def main() -> T:
        client = Client(url, model)
        try:
            return await work(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def serve_workload(client: Client, specs: list[RequestSpec], vocab_size: int) -> list[RequestTiming]:
    """The workload's requests sent at their arrival times (open loop), each timed as it streams; prompts no earlier
    run sent (a prefix cache must not answer them)."""
    rng = np.random.default_rng()
    prompts = [synthetic_prompt(spec.prompt_tokens, vocab_size, rng) for spec in specs]
    origin = time.perf_counter()

    async def one(spec: RequestSpec, prompt: list[int]) -> RequestTiming:
        await asyncio.sleep(max(0.0, origin + spec.arrival_s - time.perf_counter()))
        timing = await client.stream(prompt, spec.output_tokens, StreamTiming(spec.prompt_tokens))
        return RequestTiming(spec.request_id, timing.sent_s - origin, spec.prompt_tokens, timing.completion_tokens,
                             timing.token_s[0] - origin if timing.token_s else None,
                             (timing.token_s[-1] if timing.token_s else time.perf_counter()) - origin)

    return list(await asyncio.gather(*(one(spec, prompt) for spec, prompt in zip(specs, prompts))))
