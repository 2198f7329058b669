"""Serving benchmark results as measured points: what ran (deployment, lengths, load) and what was measured.

Four formats, read as the tools that write them lay them out:
- vLLM: `vllm bench serve --save-result` (vllm/benchmarks/serve.py) and the older `benchmarks/benchmark_serving.py`,
  one JSON object per run: `model_id`, `max_concurrency`, `request_rate`, `completed`, `total_input_tokens`,
  `total_output_tokens`, `output_throughput`, `{mean,median}_{ttft,tpot,itl}_ms`;
- SGLang: `python -m sglang.bench_serving --output-file` JSONL, one run per line, the same summary names plus
  `random_input_len`/`random_output_len`;
- guidellm: its benchmarks report (`guidellm benchmark --output-path report.json`), one entry per benchmark,
  with its strategy (synchronous, concurrent streams, constant or poisson rate) and distributions of
  `time_to_first_token_ms`, `time_per_output_token_ms`, `inter_token_latency_ms`, `output_tokens_per_second`;
- CSV, this planner's own, one row per point (`CSV_COLUMNS`): the catalogue of public measurements
  (`planner/data/benchmarks/`) is written in it, each row with its source URL, date and an exact quote.

None of the tools' files say which GPUs ran or in which precision: `PointDefaults` (the CLI's flags) fill what a
file leaves out. A value the file states wins; a file that states nothing usable is refused in one line.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from planner.catalog.models import REPOSITORIES
from planner.errors import PlannerError
from planner.files import BENCHMARKS
from planner.simulation.simulator import BatchWait

METRICS = ("tpot", "itl", "ttft", "output_tokens_per_s")
STATISTICS = ("median", "mean")
# LLMPerf's "inter-token latency": each request's (TTFT + its gaps) / its output tokens, then median over requests
LLMPERF = "llmperf"
CSV_COLUMNS = ("published_model", "model", "hardware", "gpus", "tensor_parallel", "expert_parallel",
               "attention_data_parallel", "max_num_seqs", "max_num_batched_tokens", "weights",
               "kv_dtype", "input_tokens", "output_tokens", "total_input_tokens", "total_output_tokens", "concurrency",
               "request_rate", "num_prompts", "speculative", "tpot_ms",
               "tpot_stat", "itl_ms", "itl_stat", "ttft_ms", "ttft_stat", "output_tokens_per_s", "engine",
               "engine_version", "date", "source", "quote", "length_range_ratio", "settings_source", "inferred",
               "scheduler_recv_interval", "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio")
HELD_OUT_FAMILIES = ("kimi-k2.6", "glm-5.2")    # the catalogue's own check: never in a committed fit


@dataclass(frozen=True)
class Measurement:
    """One measured figure: `tpot`, `itl`, `ttft` in seconds (`statistic` median or mean over requests, or over
    tokens for ITL), or the run's `output_tokens_per_s` (statistic `total`)."""

    metric: str
    value: float
    statistic: str = "total"

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise PlannerError(f"unknown measured metric {self.metric!r} (choose from {', '.join(METRICS)})")
        if not (isinstance(self.value, (int, float)) and math.isfinite(self.value) and self.value > 0):
            raise PlannerError(f"measured {self.metric} must be a positive number, got {self.value!r}")
        expected = (("total",) if self.metric == "output_tokens_per_s" else
                    (*STATISTICS, LLMPERF) if self.metric == "itl" else STATISTICS)
        if self.statistic not in expected:
            raise PlannerError(f"{self.metric} is given as {self.statistic!r}; it must be one of {', '.join(expected)}")


@dataclass(frozen=True)
class PointDefaults:
    """What a benchmark file does not say about its deployment (the CLI's flags); None: the file must say it."""

    model: str | None = None
    hardware: str | None = None
    gpus: int | None = None
    tensor_parallel: int | None = None
    expert_parallel: bool = False
    weights: str | None = None
    kv_dtype: str | None = None
    engine: str | None = None


@dataclass(frozen=True)
class BenchmarkPoint:
    """One measured run: the deployment, the lengths and load it ran, and what it measured."""

    model: str
    hardware: str
    gpus: int
    weights: str
    kv_dtype: str
    input_tokens: int
    output_tokens: int
    measurements: tuple[Measurement, ...]
    tensor_parallel: int | None = None
    expert_parallel: bool = False
    attention_data_parallel: bool = False   # each GPU holds its own requests' KV (SGLang's and TRT-LLM's DP attention)
    max_num_seqs: int | None = None         # the engine's batch limit per replica, where the source states it
    max_num_batched_tokens: int | None = None   # its tokens per step (prefill chunk budget), where stated
    concurrency: int | None = None          # closed loop: requests in flight (None: open loop at request_rate)
    request_rate: float | None = None       # open loop: Poisson arrivals per second
    num_prompts: int | None = None
    engine: str = ""
    engine_version: str = ""
    date: str = ""
    source: str = ""                        # a URL, or the file it was read from
    quote: str = ""
    published_model: str = ""
    speculative: str = ""                   # a draft method it decoded with (mtp, eagle, ngram): not replayed yet
    # lengths drawn uniformly from [ratio x L, L] of the nominal L in input_tokens / output_tokens, as benchmark
    # clients' --random-range-ratio does (None: every request of those lengths)
    length_range_ratio: float | None = None
    scheduler_recv_interval: int | None = None  # SGLang's `--scheduler-recv-interval`: decode steps between polls
    batch_wait: BatchWait | None = None     # TensorRT-LLM's batch waiting, where the run set it
    label: str = field(default="", compare=False)     # where in its file: "name.csv:12", "run.jsonl:2"

    def __post_init__(self) -> None:
        where = self.label or self.source or "a benchmark point"
        for name in ("gpus", "input_tokens", "output_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlannerError(f"{where}: {name.replace('_', ' ')} must be a positive integer, got {value!r}")
        if self.concurrency is None and self.request_rate is None:
            raise PlannerError(f"{where}: neither a concurrency nor a request rate: the load it ran is unknown")
        if self.concurrency is not None and (not isinstance(self.concurrency, int) or self.concurrency <= 0):
            raise PlannerError(f"{where}: concurrency must be a positive integer, got {self.concurrency!r}")
        if self.request_rate is not None and not (math.isfinite(self.request_rate) and self.request_rate > 0):
            raise PlannerError(f"{where}: the request rate must be a positive finite number, got {self.request_rate!r}")
        if not self.measurements:
            raise PlannerError(f"{where}: no TPOT, ITL, TTFT or output throughput measured")
        if self.length_range_ratio is not None and not 0 <= self.length_range_ratio <= 1:
            raise PlannerError(f"{where}: the length range ratio must be in [0, 1], got {self.length_range_ratio!r}")
        if self.scheduler_recv_interval is not None and self.scheduler_recv_interval < 1:
            raise PlannerError(f"{where}: the scheduler's receive interval must be a positive number of steps, got "
                               f"{self.scheduler_recv_interval!r}")

    @property
    def held_out(self) -> bool:
        """Kimi and GLM points: the catalogue's held-out check, never fitted by default."""
        return self.model in HELD_OUT_FAMILIES

    @property
    def single_stream(self) -> bool:
        return self.concurrency == 1

    def measured(self, metric: str) -> Measurement | None:
        return next((m for m in self.measurements if m.metric == metric), None)

    @property
    def deployment_text(self) -> str:
        parallel = (f"TP{self.tensor_parallel or self.gpus}" + (" EP" if self.expert_parallel else "")
                    + (" DP-attn" if self.attention_data_parallel else ""))
        load = f"c={self.concurrency}" if self.concurrency is not None else f"{self.request_rate:g} req/s"
        return (f"{self.model} {self.gpus}x{self.hardware} {parallel} {self.weights}/kv {self.kv_dtype} "
                f"{self.input_tokens}/{self.output_tokens} {load}")


def catalogue_points() -> list[BenchmarkPoint]:
    """Every point of the committed catalogue (`planner/data/benchmarks/*.csv`)."""
    return read_benchmarks(sorted(BENCHMARKS.glob("*.csv")))


def read_benchmarks(paths: list[str | Path], defaults: PointDefaults = PointDefaults()) -> list[BenchmarkPoint]:
    """Every point of every file, each format told by its content; PlannerError naming the file otherwise."""
    points = []
    for path in paths:
        points.extend(read_benchmark_file(Path(path), defaults))
    if not points:
        raise PlannerError("no benchmark points in " + ", ".join(str(path) for path in paths))
    return points


def read_benchmark_file(path: Path, defaults: PointDefaults = PointDefaults()) -> list[BenchmarkPoint]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlannerError(f"benchmark file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlannerError(f"benchmark file {str(path)!r} is not readable: {error}") from None
    if path.suffix.lower() == ".csv":
        return read_csv(text, path, defaults)
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            rows = [json.loads(line) for line in lines]
        except json.JSONDecodeError:
            raise PlannerError(f"benchmark file {str(path)!r} is neither JSON, JSONL nor CSV (.csv)") from None
        return [_tool_point(row, path, number, defaults) for number, row in enumerate(rows, 1)]
    if isinstance(document, dict) and isinstance(document.get("benchmarks"), list):
        return [_guidellm_point(entry, document, path, number, defaults)
                for number, entry in enumerate(document["benchmarks"], 1)]
    if isinstance(document, list):
        return [_tool_point(row, path, number, defaults) for number, row in enumerate(document, 1)]
    return [_tool_point(document, path, 1, defaults)]


def _model_name(name: str | None, defaults: PointDefaults, where: str) -> str:
    """A preset from the file's model id (a Hugging Face repository or a preset name), else the --model flag."""
    if defaults.model is not None:
        return defaults.model
    if name:
        short = str(name).rstrip("/").split("/")[-1].lower()
        for preset, repository in REPOSITORIES.items():
            if str(name) in (preset, repository) or short in (preset, repository.split("/")[-1].lower()):
                return preset
    raise PlannerError(f"{where}: model {name!r} is not a preset the planner knows; give --model")


def _deployment(defaults: PointDefaults, where: str, **stated: Any) -> dict[str, Any]:
    """The deployment fields: what the file states, else the flags; one line naming what is missing."""
    values = {name: stated.get(name) if stated.get(name) not in (None, "") else getattr(defaults, name)
              for name in ("hardware", "gpus", "weights", "kv_dtype")}
    missing = [name for name, value in values.items() if value is None]
    if missing:
        flags = {"hardware": "--hardware", "gpus": "--gpus", "weights": "--weights", "kv_dtype": "--kv"}
        raise PlannerError(f"{where}: the file does not say its {', '.join(missing)}; give "
                           f"{' '.join(flags[name] for name in missing)}")
    tp = stated.get("tensor_parallel") or defaults.tensor_parallel
    expert = stated.get("expert_parallel")
    return values | {"tensor_parallel": tp, "expert_parallel": defaults.expert_parallel if expert is None else expert}


def _number(row: dict[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value)
    return None


def _tool_measurements(row: dict[str, Any]) -> tuple[Measurement, ...]:
    """The vLLM / SGLang summary: medians where present (robust to the stragglers of a run), else means."""
    found = []
    for metric in ("tpot", "itl", "ttft"):
        for statistic in STATISTICS:
            value = _number(row, f"{statistic}_{metric}_ms")
            if value is not None:
                found.append(Measurement(metric, value / 1000, statistic))
                break
    throughput = _number(row, "output_throughput")
    if throughput is not None:
        found.append(Measurement("output_tokens_per_s", throughput))
    return tuple(found)


def _tool_point(row: Any, path: Path, number: int, defaults: PointDefaults) -> BenchmarkPoint:
    """One run of vLLM's `--save-result` JSON or one line of SGLang's `--output-file` JSONL."""
    where = f"{path.name}:{number}"
    if not isinstance(row, dict) or not any(f"{s}_tpot_ms" in row or f"{s}_ttft_ms" in row for s in STATISTICS):
        raise PlannerError(f"{where}: not a vLLM or SGLang serving benchmark result (no mean/median TTFT or TPOT)")
    completed = _number(row, "completed")
    lengths = {}
    for side, tool_key in (("input", "random_input_len"), ("output", "random_output_len")):
        total = _number(row, f"total_{side}_tokens")
        lengths[side] = (round(total / completed) if total and completed else
                         round(_number(row, tool_key) or 0) or None)
        if not lengths[side]:
            raise PlannerError(f"{where}: no {side} token counts (total_{side}_tokens with completed, or {tool_key})")
    concurrency = _number(row, "max_concurrency")
    rate = _number(row, "request_rate")
    if concurrency is None and rate is None:        # an unlimited rate without a cap: every request at once
        concurrency = completed
    server = row.get("server_info") if isinstance(row.get("server_info"), dict) else {}
    engine = "sglang" if "random_input_len" in row or server else "vllm"
    model = row.get("model_id") or server.get("model_path") or row.get("model") or row.get("tokenizer_id")
    return BenchmarkPoint(
        model=_model_name(model, defaults, where),
        **_deployment(defaults, where, tensor_parallel=server.get("tp_size")), input_tokens=lengths["input"],
        output_tokens=lengths["output"], measurements=_tool_measurements(row),
        concurrency=None if concurrency is None else int(concurrency),
        request_rate=None if concurrency is not None else rate,
        num_prompts=int(completed) if completed else None, engine=defaults.engine or engine,
        engine_version=str(row.get("version") or ""), date=str(row.get("date") or ""), source=str(path), label=where)


def _summary(metrics: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A guidellm distribution summary of successful requests: {"mean", "median", ...}."""
    entry = metrics.get(name)
    if isinstance(entry, dict):
        entry = entry.get("successful", entry)
    return entry if isinstance(entry, dict) else None


def _guidellm_point(entry: Any, report: dict[str, Any], path: Path, number: int,
                    defaults: PointDefaults) -> BenchmarkPoint:
    """One benchmark of a guidellm report: its strategy gives the load, its metrics the distributions."""
    where = f"{path.name}:benchmark {number}"
    metrics = entry.get("metrics") if isinstance(entry, dict) else None
    if not isinstance(metrics, dict):
        raise PlannerError(f"{where}: not a guidellm benchmark (no metrics)")
    strategy = _strategy(entry)
    kind = strategy.get("type_") or strategy.get("type")
    concurrency = rate = None
    if kind == "synchronous":
        concurrency = 1
    elif kind == "concurrent":
        concurrency = int(strategy.get("streams") or 0) or None
    elif kind in ("constant", "poisson"):
        rate = _number(strategy, "rate")
    if concurrency is None and rate is None:
        raise PlannerError(f"{where}: strategy {kind!r} has no fixed load (synchronous, concurrent, constant or "
                           f"poisson are replayed; throughput and sweep runs are not)")
    found = []
    # guidellm's inter-token latency per request is what vLLM and SGLang call TPOT (its time_per_output_token_ms
    # counts the first token's wait too, from v0.4 on)
    for metric, name in (("tpot", "inter_token_latency_ms"), ("ttft", "time_to_first_token_ms")):
        summary = _summary(metrics, name) or {}
        value = _number(summary, "median", "mean")
        if value is not None:
            found.append(Measurement(metric, value / 1000, "median" if _number(summary, "median") else "mean"))
    throughput = _summary(metrics, "output_tokens_per_second") or {}
    # guidellm's output_tokens_per_second distribution is over time; its mean is the run's rate
    if _number(throughput, "mean") is not None:
        found.append(Measurement("output_tokens_per_s", _number(throughput, "mean")))
    lengths = [round(_number(_summary(metrics, name) or {}, "mean") or 0)
               for name in ("prompt_token_count", "output_token_count")]
    if not all(lengths):
        raise PlannerError(f"{where}: no prompt_token_count / output_token_count means")
    model = _guidellm_model(entry, report)
    return BenchmarkPoint(model=_model_name(model, defaults, where), **_deployment(defaults, where),
                          input_tokens=lengths[0], output_tokens=lengths[1], measurements=tuple(found),
                          concurrency=concurrency, request_rate=rate, engine=defaults.engine or "",
                          source=str(path), label=where)


def _strategy(entry: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's scheduling strategy, wherever the report's version keeps it."""
    for holder in (entry.get("args") or {}, entry.get("scheduler") or {}, entry.get("config") or {}, entry):
        strategy = holder.get("strategy") if isinstance(holder, dict) else None
        if isinstance(strategy, dict):
            return strategy
    return {}


def _guidellm_model(entry: dict[str, Any], report: dict[str, Any]) -> str | None:
    """v0.4-0.6: config.backend.model; v0.2-0.3: worker.backend_model; else the report's args."""
    config = entry.get("config") or {}
    for holder in (config.get("backend") or {}, entry.get("worker") or {}, entry.get("backend") or {},
                   entry.get("args") or {}, config, report.get("args") or {}, report.get("config") or {}):
        if isinstance(holder, dict):
            for key in ("model", "backend_model", "processor"):
                if isinstance(holder.get(key), str) and holder[key]:
                    return holder[key]
    return None


def _csv_value(row: dict[str, str], name: str, convert: Any, where: str) -> Any:
    text = (row.get(name) or "").strip()
    if not text:
        return None
    try:
        return convert(text)
    except ValueError:
        raise PlannerError(f"{where}: column {name} has {text!r}, not a {convert.__name__}") from None


def _flag(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(text)
    return lowered in ("true", "1", "yes")


def read_csv(text: str, path: Path, defaults: PointDefaults = PointDefaults()) -> list[BenchmarkPoint]:
    """The planner's CSV (`CSV_COLUMNS`; only the deployment, lengths, load and one measured figure are required)."""
    reader = csv.DictReader(text.splitlines())
    unknown = [name for name in reader.fieldnames or () if name not in CSV_COLUMNS]
    if not reader.fieldnames or unknown:
        raise PlannerError(f"benchmark CSV {str(path)!r}: unknown columns {unknown or 'none'} "
                           f"(the columns are {', '.join(CSV_COLUMNS)})")
    points = []
    for number, row in enumerate(reader, 2):
        try:
            points.append(_csv_point(row, f"{path.name}:{number}", defaults))
        except PlannerError as error:
            message = str(error)
            raise PlannerError(message if message.startswith(path.name) else f"{path.name}:{number}: {message}") \
                from None
    if not points:
        raise PlannerError(f"benchmark CSV {str(path)!r} has no rows")
    return points


def _csv_point(row: dict[str, str], where: str, defaults: PointDefaults) -> BenchmarkPoint:
    """One CSV row. Lengths are per request, or a run's totals over its requests (what bench_serving prints);
    a rate of `inf` with a number of prompts sends them all at once (a closed loop of that many users)."""
    found = []
    for metric in ("tpot", "itl", "ttft"):
        value = _csv_value(row, f"{metric}_ms", float, where)
        if value is not None:
            found.append(Measurement(metric, value / 1000, (row.get(f"{metric}_stat") or "").strip()))
    throughput = _csv_value(row, "output_tokens_per_s", float, where)
    if throughput is not None:
        found.append(Measurement("output_tokens_per_s", throughput))
    stated = {name: _csv_value(row, name, convert, where) for name, convert in
              (("hardware", str), ("gpus", int), ("weights", str), ("kv_dtype", str), ("tensor_parallel", int),
               ("expert_parallel", _flag))}
    limits = {name: _csv_value(row, name, int, where)
              for name in ("max_num_seqs", "max_num_batched_tokens", "scheduler_recv_interval")}
    prompts = _csv_value(row, "num_prompts", int, where)
    ratio = _csv_value(row, "length_range_ratio", float, where)
    wait_steps = _csv_value(row, "batch_wait_timeout_iters", int, where)
    wait_ratio = _csv_value(row, "batch_wait_max_tokens_ratio", float, where)
    if (wait_steps is None) != (wait_ratio is None):
        raise PlannerError(f"{where}: batch waiting needs both batch_wait_timeout_iters and "
                           f"batch_wait_max_tokens_ratio, got {wait_steps!r} and {wait_ratio!r}")
    try:
        batch_wait = None if wait_steps is None else BatchWait(wait_steps, wait_ratio)
    except PlannerError as error:
        raise PlannerError(f"{where}: {error}") from None
    lengths = {}
    for side in ("input", "output"):
        total = _csv_value(row, f"total_{side}_tokens", int, where)
        if total and prompts:           # a run's totals: the mean, whose nominal is 2 / (1 + ratio) of it
            mean = total / prompts
            lengths[side] = round(mean if ratio is None else 2 * mean / (1 + ratio))
        else:
            lengths[side] = _csv_value(row, f"{side}_tokens", int, where) or 0
    concurrency = _csv_value(row, "concurrency", int, where)
    rate = _csv_value(row, "request_rate", float, where)
    if rate == math.inf and concurrency is None and prompts:
        concurrency, rate = prompts, None
    return BenchmarkPoint(
        model=_model_name(_csv_value(row, "model", str, where), replace(defaults, model=None), where)
        if row.get("model") else _model_name(None, defaults, where),
        **_deployment(defaults, where, **stated), input_tokens=lengths["input"], output_tokens=lengths["output"],
        measurements=tuple(found), concurrency=concurrency, request_rate=rate, num_prompts=prompts,
        attention_data_parallel=bool(_csv_value(row, "attention_data_parallel", _flag, where)), **limits,
        length_range_ratio=ratio, batch_wait=batch_wait,
        **{name: (row.get(name) or "").strip() for name in ("engine", "engine_version", "date", "source", "quote",
                                                            "published_model", "speculative")}, label=where)
