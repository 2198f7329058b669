"""Black-box calibration and verification against any OpenAI-compatible endpoint (ours, vLLM, SGLang).

From the outside a server shows only when each streamed token arrives. A short, bounded sweep turns those
arrival times into step samples of the profile format, which `planner.calibration.profile_fit` fits like an engine profile:

    prefill   one request alone, a prompt of P tokens, one output token: its TTFT is a prefill step of P
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
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from engine.core.config import SchedulerConfig
from engine.core.memory import GIB, kv_layout, kv_pages_for_budget
from engine.core.metrics import RequestTiming, summarize
from engine.core.profile_format import shape_fields
from planner.calibration.profile_fit import (
    CALIBRATION_VERSION,
    ENDPOINT_VERSION_PREFIX,
    MAX_MAPE_PCT,
    Calibration,
    Points,
    fit_report,
    load_calibration,
)
from planner.catalog.models import get_model
from planner.cost.step_model import BatchShape, ModelCosts, Peaks, StepParameters, step_time
from planner.deployment.capacity import Deployment, catalogue_costs
from planner.errors import PlannerError
from planner.simulation.simulator import Simulation, SimulationResult, model_step_time
from planner.simulation.workload import RequestSpec, Workload
from planner.verification.comparison import TIMING_METRICS, compared, metrics_table, workload_dict

PROMPT_ID_RANGE = (1000, 20000)     # token ids of the synthetic prompts: clear of special tokens in real vocabularies
PROBE_REPEATS = 3                   # timings of the prefill probe of `slowdown`
STREAMING_FROM = 3                  # a mixed point's decodes must have this many tokens before its prefill arrives
REQUEST_TIMEOUT_S = 600.0
T = TypeVar("T")


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


def _get(url: str, timeout_s: float = 10.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as error:
        raise PlannerError(f"cannot reach {url}: {getattr(error, 'reason', error)}") from None


def _base(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise PlannerError(f"the endpoint must be an http(s) URL, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


def served_model(url: str) -> str:
    """The first model the endpoint lists at /v1/models."""
    listing = _get(f"{_base(url)}/v1/models")
    try:
        return json.loads(listing)["data"][0]["id"]
    except (KeyError, IndexError, TypeError, ValueError):
        raise PlannerError(f"{url} does not list a model at /v1/models") from None


def server_shape(url: str) -> ServerShape:
    """What `/metrics` says of the pool and the limits (kvplan, vLLM, SGLang); None where it says nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = _get(f"{_base(url)}/metrics").decode()
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

        self.url, self.model = _base(url), model
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


def _steady_gaps(timings: list[StreamTiming]) -> list[tuple[int, float]]:
    """(output tokens so far, gap) of every stream while all of them stream: from the last first token to the
    first last token."""
    start = max(t.token_s[0] for t in timings)
    end = min(t.token_s[-1] for t in timings)
    return [(index, later - earlier) for t in timings
            for index, (earlier, later) in enumerate(zip(t.token_s, t.token_s[1:]), start=1)
            if earlier >= start and later <= end]


async def _prefill_ttfts(client: Client, tokens: int, repeats: int, vocab_size: int,
                         rng: np.random.Generator) -> list[float]:
    """TTFTs of prompts of `tokens` sent alone, one after another: each a prefill step."""
    ttfts = []
    for _ in range(repeats):
        timing = await client.stream(synthetic_prompt(tokens, vocab_size, rng), 1, StreamTiming(tokens))
        ttfts.append(timing.token_s[0] - timing.sent_s)
    return ttfts


async def _decode_gaps(client: Client, batch: int, prompt: int, output: int, vocab_size: int,
                       rng: np.random.Generator) -> list[tuple[int, float]]:
    """`_steady_gaps` of `batch` streams sent at once."""
    timings = await asyncio.gather(*(client.stream(synthetic_prompt(prompt, vocab_size, rng), output,
                                                   StreamTiming(prompt)) for _ in range(batch)))
    return _steady_gaps(list(timings))


async def _sweep(client: Client, sweep: EndpointSweep, vocab_size: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    samples = []
    for tokens in sweep.prefill_tokens:
        ttfts = await _prefill_ttfts(client, tokens, sweep.repeats, vocab_size, rng)
        samples.append(_sample("prefill", shape_fields([], [(tokens, tokens)]), ttfts))
    prompt, output = sweep.decode_prompt_tokens, sweep.decode_output_tokens
    for batch in sweep.decode_batches:
        gaps = await _decode_gaps(client, batch, prompt, output, vocab_size, rng)
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


def with_client(work: Callable[[Client], Awaitable[T]], url: str, model: str) -> T:
    """Runs `work(client)` on a fresh event loop, closing the client after."""
    async def main() -> T:
        client = Client(url, model)
        try:
            return await work(client)
        finally:
            await client.close()
    return asyncio.run(main())


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
        "fingerprint": {"engine_version": f"{ENDPOINT_VERSION_PREFIX}{shape.kind}", "endpoint": _base(url), "served_model": name,
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


def deployment_of(fingerprint: dict[str, Any]) -> Deployment:
    """The deployment an endpoint calibration was made for."""
    return Deployment(model=fingerprint["model"], hardware=fingerprint["hardware"], gpus=fingerprint["gpus"],
                      weights=fingerprint["weights"], kv_dtype=fingerprint["kv_dtype"],
                      tensor_parallel=fingerprint["tensor_parallel"], expert_parallel=fingerprint["expert_parallel"])


async def serve_workload(client: Client, specs: list[RequestSpec], vocab_size: int) -> list[RequestTiming]:
    """The workload's requests sent at their arrival times (open loop), each timed as it streams."""
    rng = np.random.default_rng(1)
    prompts = [synthetic_prompt(spec.prompt_tokens, vocab_size, rng) for spec in specs]
    origin = time.perf_counter()

    async def one(spec: RequestSpec, prompt: list[int]) -> RequestTiming:
        await asyncio.sleep(max(0.0, origin + spec.arrival_s - time.perf_counter()))
        timing = await client.stream(prompt, spec.output_tokens, StreamTiming(spec.prompt_tokens))
        return RequestTiming(spec.request_id, timing.sent_s - origin, spec.prompt_tokens, timing.completion_tokens,
                             timing.token_s[0] - origin if timing.token_s else None,
                             (timing.token_s[-1] if timing.token_s else time.perf_counter()) - origin)

    return list(await asyncio.gather(*(one(spec, prompt) for spec, prompt in zip(specs, prompts))))


def predicted_capacity(deployment: Deployment, page_size: int, kv_cache_gib: float | None) -> int:
    """The planner's KV capacity for the server: its own arithmetic over a given KV budget (a CPU server's
    `--memory-gib`), else the memory plan of the deployment (per replica)."""
    _costs, _peaks, plan = catalogue_costs(deployment)
    if kv_cache_gib is None:
        return plan.kv_pages_per_replica * plan.page_size
    layout = kv_layout(get_model(deployment.model), deployment.kv_dtype, deployment.parallel.tp)
    return kv_pages_for_budget(int(kv_cache_gib * GIB), layout, page_size) * page_size


def verify_endpoint(url: str, calibration_path: str, workload: Workload, kv_cache_gib: float | None = None,
                    limits: dict[str, int] | None = None, served_name: str | None = None) -> dict[str, Any]:
    """The workload against the live endpoint and through the simulator calibrated on it: the error per
    metric, as `planner verify` reports for the engine here. `limits` gives the scheduler limits a server does
    not publish (max_num_seqs, max_num_batched_tokens, max_model_len, page_size, capacity_tokens)."""
    calibration = load_calibration(calibration_path)
    fingerprint = calibration.fingerprint
    if not calibration.from_endpoint:
        raise PlannerError(f"calibration {calibration_path!r} was not made against an endpoint: "
                           f"use `planner calibrate --endpoint`")
    deployment = deployment_of(fingerprint)
    specs = workload.requests()
    if any(spec.arrival_s is None for spec in specs):
        raise PlannerError("verification needs arrival times: use a poisson, gamma or trace workload")
    shape = replace(server_shape(url), **{k: v for k, v in (limits or {}).items() if v is not None})
    missing = [name for name in ("capacity_tokens", "page_size", "max_num_seqs", "max_num_batched_tokens",
                                 "max_model_len") if getattr(shape, name) is None]
    if missing:
        raise PlannerError(f"the {shape.kind} server at {url} does not publish {', '.join(missing)}: give "
                           + ", ".join(f"--{name.replace('_', '-')}" for name in missing))
    name = served_name or served_model(url)
    vocab_size = get_model(deployment.model).vocab_size
    run = with_client(lambda client: probed_workload(client, calibration.document, specs, vocab_size), url, name)
    speed = (run.before + run.after) / 2
    predicted = simulate_endpoint(calibration, shape, specs).report()
    corrected = simulate_endpoint(calibration, shape, specs, speed).report()
    measured = summarize(run.timings)
    metrics = {"kv_capacity_tokens": compared(predicted_capacity(deployment, shape.page_size, kv_cache_gib),
                                             shape.capacity_tokens),
               **{metric: compared(predicted[metric], measured[metric]) for metric in TIMING_METRICS}}
    return {"metrics": metrics, "endpoint": _base(url), "server": asdict(shape), "fingerprint": fingerprint,
            "workload": workload_dict(workload),
            "calibration": {key: value for key, value in calibration.document.items()
                            if key.startswith(("mape", "holdout")) or key == "parameters"},
            "completed": measured.get("completed", 0),
            "machine": {"slowdown_vs_profile_pct": round(100 * (speed - 1), 2),
                        "slowdown_before_pct": round(100 * (run.before - 1), 2),
                        "slowdown_after_pct": round(100 * (run.after - 1), 2),
                        "metrics_drift_corrected": {metric: compared(corrected[metric], measured[metric])
                                                    for metric in TIMING_METRICS}}}


@dataclass(frozen=True)
class ProbedRun:
    """A workload as the endpoint served it, between two drift probes; `window_s` is when it ran (perf_counter)."""

    timings: list[RequestTiming]
    before: float
    after: float
    window_s: tuple[float, float]


async def probed_workload(client: Client, document: dict[str, Any], specs: list[RequestSpec],
                          vocab_size: int) -> ProbedRun:
    before = await slowdown(client, document, vocab_size)
    started = time.perf_counter()
    timings = await serve_workload(client, specs, vocab_size)
    window = (started, time.perf_counter())
    return ProbedRun(timings, before, await slowdown(client, document, vocab_size), window)


def calibrated_step(calibration: Calibration) -> tuple[Callable[[BatchShape], float], int]:
    """The server's step seconds as the calibration prices them, row residuals added; and its index_topk."""
    costs, _peaks, _plan = catalogue_costs(deployment_of(calibration.fingerprint))
    residuals = RowResiduals.of(calibration.document)

    def step_seconds(batch: BatchShape) -> float:
        return step_time(costs, calibration.peaks, calibration.parameters, batch) + residuals.at(batch.new_tokens)
    return step_seconds, costs.index_topk


def simulate_endpoint(calibration: Calibration, shape: ServerShape, specs: list[RequestSpec],
                      speed: float = 1.0) -> SimulationResult:
    """The workload through the simulator with the server's limits and the calibrated steps (times `speed`)."""
    calibrated, index_topk = calibrated_step(calibration)
    config = SchedulerConfig(num_pages=shape.capacity_tokens // shape.page_size, page_size=shape.page_size,
                             max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens,
                             max_model_len=shape.max_model_len)
    return Simulation(config, model_step_time(lambda batch: speed * calibrated(batch), index_topk)).run(
        list(specs))


async def slowdown(client: Client, document: dict[str, Any], vocab_size: int) -> float:
    """How much slower the endpoint steps now than when it was calibrated: the calibration's longest prefill and
    its smallest decode batch timed again, against their calibrated times (the geometric mean of the two ratios).
    A server's speed drifts (a shared machine, thermals, other tenants); this tells drift from model error."""
    samples, sweep = document["samples"], document["sweep"]
    prefill = max((s for s in samples if s["kind"] == "prefill"), key=lambda s: s["batch"]["prefill_tokens"])
    decode = min((s for s in samples if s["kind"] == "decode"), key=lambda s: s["batch"]["num_decodes"])
    rng = np.random.default_rng(2)
    ttfts = await _prefill_ttfts(client, prefill["batch"]["prefill_tokens"], PROBE_REPEATS, vocab_size, rng)
    gaps = await _decode_gaps(client, decode["batch"]["num_decodes"], sweep["decode_prompt_tokens"],
                              sweep["decode_output_tokens"], vocab_size, rng)
    ratios = [statistics.median(ttfts) / prefill["median_s"],
              statistics.median(gap for _, gap in gaps) / decode["median_s"]]
    return float(np.sqrt(ratios[0] * ratios[1]))


def endpoint_report(result: dict[str, Any]) -> str:
    fp = result["fingerprint"]
    return "\n".join([
        f"# Verification against {result['endpoint']} ({result['server']['kind']} server): {fp['model']} "
        f"({fp['weights']} weights, {fp['kv_dtype']} KV) as {fp['gpus']} x {fp['hardware']}", "",
        f"Workload: `{result['workload']}`; {result['completed']} requests completed", "",
        *metrics_table(result["metrics"]), "",
        f"The calibration's own probes ran {result['machine']['slowdown_before_pct']:+.1f}% slower than when "
        f"calibrated before the workload, {result['machine']['slowdown_after_pct']:+.1f}% after it; with every "
        "predicted step scaled by their mean:", "", *metrics_table(result["machine"]["metrics_drift_corrected"]),
        "", f"Calibration fit: {result['calibration']}", ""])
