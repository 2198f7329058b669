"""Black-box calibration of any OpenAI-compatible endpoint (ours, vLLM, SGLang); its verification is `planner.endpoint.verify`.

From the outside a server shows only when each streamed token arrives. A short, bounded sweep turns those
arrival times into step samples of the profile format, which `planner.calibration.profile_fit` fits like an engine profile:

    prefill   one request alone, a prompt of P tokens, one output token: its TTFT is a prefill step of P (after
              one untimed such prompt: a server's first prompt of a length pays once for allocations, page
              faults, kernel choice or graph capture; a freshly started kvplan on CPU took twice as long)
    decode    c requests at once, prompt L, D output tokens: once all c stream, the gaps between their tokens
              are decode steps of batch c (contexts L + the tokens so far)
    mixed     c decode streams, then one prompt of P: the gap that ends with its first token is a step of
              c decodes and a prefill chunk of P

Prompts are token ids (the completions API takes them; no tokenizer needed here) and `ignore_eos` holds every
output to its length, as vLLM and SGLang accept. The KV pool's shape comes from `/metrics`: kvplan's and
vLLM's `cache_config_info`, SGLang's `max_total_num_tokens`; what a server does not publish is given.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engine.core.step_shape import shape_fields
from planner.calibration.parameters import CALIBRATION_VERSION, ENDPOINT_VERSION_PREFIX
from planner.calibration.profile_fit import MAX_MAPE_PCT, Points, fit_report
from planner.catalog.models import get_model
from planner.cost.step_model import BatchShape, ModelCosts, Peaks, StepParameters, step_time
from planner.deployment.capacity import Deployment, catalogue_costs
from planner.endpoint.client import (
    Client,
    StreamTiming,
    base_url,
    served_model,
    server_shape,
    synthetic_prompt,
    with_client,
)
from planner.errors import PlannerError

STREAMING_FROM = 3                  # a mixed point's decodes must have this many tokens before its prefill arrives


@dataclass(frozen=True)
class EndpointSweep:
    """The bounded sweep: what is timed, how often."""

    prefill_tokens: tuple[int, ...] = (32, 64, 128, 256, 512)
    decode_batches: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    decode_prompt_tokens: int = 64
    decode_output_tokens: int = 32
    mixed: tuple[tuple[int, int], ...] = ((1, 64), (1, 192), (2, 128), (4, 256), (8, 128))  # (decodes, prefill)
    repeats: int = 3

    def __post_init__(self) -> None:
        values = [*self.prefill_tokens, *self.decode_batches, self.decode_prompt_tokens, self.repeats,
                  *(n for point in self.mixed for n in point)]
        bad = [value for value in values if not isinstance(value, int) or value <= 0]
        if bad:
            raise PlannerError(f"sweep sizes must be positive integers, got {bad[0]!r}")
        if self.decode_output_tokens < 2 * STREAMING_FROM + 2:
            raise PlannerError(f"decode output tokens must be at least {2 * STREAMING_FROM + 2} to time gaps, "
                               f"got {self.decode_output_tokens}")


@dataclass(frozen=True)
class RowResiduals:
    """What the fitted step model misses at each decode batch the sweep timed (measured less fitted seconds), by
    row count: a server's matmuls change kernels with the number of rows, so a step of 3 decodes can cost more
    than one of 4 (on this CPU, 99 ms against 85), which no smooth model draws. Like a profile's measured linears,
    it is this server's only: the endpoint's verification adds it to steps of a row count inside the timed range
    (interpolated between timed batches), and nothing outside it."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def of(cls, document: dict[str, Any]) -> RowResiduals:
        residuals = document.get("row_residuals") or {"rows": [], "seconds": []}
        return cls(tuple(residuals["rows"]), tuple(residuals["seconds"]))

    def at(self, rows: int) -> float:
        if not self.rows or not self.rows[0] <= rows <= self.rows[-1]:
            return 0.0
        return float(np.interp(rows, self.rows, self.seconds))


def row_residuals(samples: list[dict[str, Any]], costs: ModelCosts, peaks: Peaks,
                  params: StepParameters) -> dict[str, list]:
    """Per decode batch timed: its median step less the fitted model's (`RowResiduals`)."""
    decodes = sorted((s for s in samples if s["kind"] == "decode"), key=lambda s: s["batch"]["num_decodes"])
    return {"rows": [s["batch"]["num_decodes"] for s in decodes],
            "seconds": [round(s["median_s"] - step_time(costs, peaks, params, BatchShape(**s["batch"])), 7)
                        for s in decodes]}


def _steady_gaps(timings: list[StreamTiming]) -> list[tuple[int, float]]:
    """(output tokens so far, gap) of every stream while all of them stream: from the last first token to the
    first last token."""
    start = max(t.token_s[0] for t in timings)
    end = min(t.token_s[-1] for t in timings)
    return [(index, later - earlier) for t in timings
            for index, (earlier, later) in enumerate(zip(t.token_s, t.token_s[1:]), start=1)
            if earlier >= start and later <= end]


async def prefill_ttfts(client: Client, tokens: int, repeats: int, vocab_size: int,
                         rng: np.random.Generator) -> list[float]:
    """TTFTs of prompts of `tokens` sent alone, one after another: each a prefill step."""
    ttfts = []
    for _ in range(repeats):
        timing = await client.stream(synthetic_prompt(tokens, vocab_size, rng), 1, StreamTiming(tokens))
        ttfts.append(timing.token_s[0] - timing.sent_s)
    return ttfts


async def decode_gaps(client: Client, batch: int, prompt: int, output: int, vocab_size: int,
                       rng: np.random.Generator) -> list[tuple[int, float]]:
    """`_steady_gaps` of `batch` streams sent at once."""
    timings = await asyncio.gather(*(client.stream(synthetic_prompt(prompt, vocab_size, rng), output,
                                                   StreamTiming(prompt)) for _ in range(batch)))
    return _steady_gaps(list(timings))


async def _sweep(client: Client, sweep: EndpointSweep, vocab_size: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng()      # prompts no earlier run sent: a prefix cache must not answer them
    samples = []
    for tokens in sweep.prefill_tokens:
        await prefill_ttfts(client, tokens, 1, vocab_size, rng)
        ttfts = await prefill_ttfts(client, tokens, sweep.repeats, vocab_size, rng)
        samples.append(_sample("prefill", shape_fields([], [(tokens, tokens)]), ttfts))
    prompt, output = sweep.decode_prompt_tokens, sweep.decode_output_tokens
    for batch in sweep.decode_batches:
        gaps = await decode_gaps(client, batch, prompt, output, vocab_size, rng)
        if gaps:
            done = int(statistics.median(index for index, _ in gaps))
            samples.append(_sample("decode", shape_fields([prompt + done] * batch, []), [g for _, g in gaps]))
    for decodes, tokens in sweep.mixed:
        steps, contexts = [], []
        for _ in range(sweep.repeats):
            found = await _mixed_point(client, decodes, tokens, prompt, output, vocab_size, rng)
            if found is not None:
                steps.append(found[0])
                contexts.append(found[1])
        if steps:
            context = int(statistics.median(contexts))
            samples.append(_sample("mixed", shape_fields([context] * decodes, [(tokens, tokens)]), steps))
    return samples


async def _mixed_point(client: Client, decodes: int, tokens: int, prompt: int, output: int, vocab_size: int,
                       rng: np.random.Generator) -> tuple[float, int] | None:
    """(the step that ran the prefill beside the decodes, the decodes' context then); None if the decodes ended
    before the prefill ran."""
    streams = [StreamTiming(prompt) for _ in range(decodes)]
    running = [asyncio.create_task(client.stream(synthetic_prompt(prompt, vocab_size, rng), output, timing))
               for timing in streams]
    while min(len(t.token_s) for t in streams) < STREAMING_FROM and not all(task.done() for task in running):
        await asyncio.sleep(0.002)
    prefill = await client.stream(synthetic_prompt(tokens, vocab_size, rng), 1, StreamTiming(tokens))
    await asyncio.gather(*running)
    arrived = prefill.token_s[0]
    steps, contexts = [], []
    for timing in streams:
        times = timing.token_s
        index = min(range(len(times)), key=lambda i: abs(times[i] - arrived))
        if 0 < index < len(times) - 1 and index >= STREAMING_FROM:
            steps.append(times[index] - times[index - 1])
            contexts.append(prompt + index)        # token `index` is computed from the prompt and `index` outputs
    if not steps:
        return None
    return statistics.median(steps), int(statistics.median(contexts))


def _sample(kind: str, batch: dict[str, int], seconds: list[float]) -> dict[str, Any]:
    return {"kind": kind, "batch": batch, "median_s": round(statistics.median(seconds), 7), "timings": len(seconds)}


def calibrate_endpoint(url: str, deployment: Deployment, sweep: EndpointSweep | None = None,
                       max_mape: float = MAX_MAPE_PCT, served_name: str | None = None) -> dict[str, Any]:
    """Times the sweep on the live endpoint and fits the step model of `deployment` (the model, GPUs and dtypes
    the server runs, as the planner knows them) to it. PlannerError above `max_mape` percent in any regime."""
    sweep = sweep or EndpointSweep()
    name = served_name or served_model(url)
    shape = server_shape(url)
    model = get_model(deployment.model)
    samples = with_client(lambda client: _sweep(client, sweep, model.vocab_size), url, name)
    costs, peaks, _plan = catalogue_costs(deployment)
    fitted = fit_report(Points.of(samples, costs), peaks, max_mape)
    document = {
        "version": CALIBRATION_VERSION,
        "fingerprint": {"engine_version": f"{ENDPOINT_VERSION_PREFIX}{shape.kind}", "endpoint": base_url(url), "served_model": name,
                        "hardware": deployment.hardware, "model": deployment.model, "gpus": deployment.gpus,
                        "tensor_parallel": deployment.parallel.tp, "expert_parallel": deployment.expert_parallel,
                        "weights": deployment.weights, "kv_dtype": deployment.kv_dtype, "device": "endpoint"},
        "samples_sha256": hashlib.sha256(json.dumps(samples, sort_keys=True).encode()).hexdigest(),
        "peaks": asdict(peaks),
        **fitted,
        "row_residuals": row_residuals(samples, costs, peaks, StepParameters(**fitted["parameters"])),
        "max_mape_pct": max_mape,
        "num_samples": len(samples),
        "samples": samples,
        "server": asdict(shape),
        "sweep": asdict(sweep),
    }
    return document
