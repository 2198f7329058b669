"""Serving engines as the calibrations tell them apart: the families fitted on their own (vLLM, SGLang, TensorRT-LLM),
their versions, and where each family's fit to the public measurements lives.

The same deployment measures up to 2x apart between engines and versions (the catalogue's TensorRT-LLM 0.21 rows
against SGLang's, vLLM 0.7 against SGLang 0.5), so each family gets its own step parameters over the shared physics
(the catalogue's peaks); NVIDIA's aiconfigurator keeps one performance database per backend and version for the same
reason. Within a family, one minor version is the reference (the newest measured on two models or more); the
points of every other version are fitted with it only where they agree with its fit (`planner.benchmarks.engine_fit`):
otherwise they are kept apart, not averaged.
"""
from __future__ import annotations

import re
from pathlib import Path

from engine.core.memory import GIB
from planner.catalog.hardware import HardwareSpec
from planner.errors import PlannerError
from planner.files import PROFILES

ENGINES = ("vllm", "sglang", "trtllm")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM", "other": "other engines"}


def check_engine(engine: str | None) -> str | None:
    """None (every engine's fit) or one family, else a one-line error naming it."""
    if engine is not None and engine not in ENGINES:
        raise PlannerError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    return engine


def engine_family(engine: str) -> str:
    """A point's engine as a family fitted on its own, or `other` (NIM and the unnamed)."""
    return engine if engine in ENGINES else "other"


def minor_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a release name (`0.21.0rc2`, `v1.2.0rc1`, `0.5.13.post1`); None for a commit or nothing."""
    found = re.match(r"v?(\d+)\.(\d+)", version.strip())
    return (int(found.group(1)), int(found.group(2))) if found else None


def engine_calibration(engine: str) -> Path:
    """Where a family's fit to the public measurements is committed."""
    return PROFILES / f"public-benchmarks-{engine}.calibration.json"


def version_groups(points: list) -> tuple[list, dict[tuple[int, int], list]]:
    """A family's points split into the reference group and every other minor version's points, newest first. The
    reference is the newest minor version whose points span two models or more (one model's points cannot tell the
    engine's own terms from that model's; where no version does, the newest), with the points whose version is not
    named. The others join it only where they agree with its fit (`planner.benchmarks.engine_fit`)."""
    versions = [(point, minor_version(point.engine_version)) for point in points]
    groups: dict[tuple[int, int] | None, list] = {}
    for point, version in versions:
        groups.setdefault(version, []).append(point)
    named = sorted((version for version in groups if version is not None), reverse=True)
    reference = next((version for version in named if len({point.model for point in groups[version]}) >= 2),
                     named[0] if named else None)
    current = [point for point, version in versions if version is None or version == reference]
    return current, {version: groups[version] for version in named if version != reference}


def default_limits(engine: str, gpu: HardwareSpec, attention_ranks: int = 1) -> tuple[int, int] | None:
    """The batch limit and tokens per step an engine's server takes when a run does not set them, per replica (a
    data-parallel attention rank), by the GPU's memory (and, for vLLM, its name: an A100 keeps the small defaults);
    None for an engine whose defaults are not known (NIM). Read 2026-12-05:

    - vLLM's API server, vllm/engine/arg_utils.py `EngineArgs._set_default_args` (the vllm 0.11.0 wheel): "if
      device_memory >= 70 * GiB_bytes and "a100" not in device_name:" ... "UsageContext.OPENAI_API_SERVER: 8192" ...
      "UsageContext.OPENAI_API_SERVER: 1024"; below, 2048 and 256.
    - SGLang, python/sglang/srt/server_args.py (the sglang 0.5.12 wheel): "elif gpu_mem < 160 * 1024:" ...
      "self.chunked_prefill_size = 8192", else "self.chunked_prefill_size = 16384"; with DP attention
      "self.chunked_prefill_size = self.chunked_prefill_size // self.dp_size"; running requests from the KV pool,
      model_runner_kv_cache_mixin.py: "estimated = max(min(estimated, 4096), 2048)".
    - trtllm-serve, tensorrt_llm/commands/serve.py takes BuildConfig's defaults, tensorrt_llm/builder.py:
      "max_batch_size: int = 2048", "max_num_tokens: int = 8192" (trtllm-bench picks its own per model)."""
    memory_gib = gpu.memory_bytes / GIB
    if engine == "vllm":
        return (1024, 8192) if memory_gib >= 70 and "a100" not in gpu.name.lower() else (256, 2048)
    if engine == "sglang":
        return 2048, (8192 if memory_gib < 160 else 16384) // max(1, attention_ranks)
    if engine == "trtllm":
        return 2048, 8192
    return None
