"""Launch configurations of the Triton kernels, per GPU, as `bench/autotune_kernels.py` measured and committed them.

`engine/kernels/tuned/<gpu>.json` (the GPU's name in lower case, spaces as dashes: `nvidia-h200.json`) maps a kernel
to shape buckets and each bucket to its configuration, e.g. {"w4a16": {"rows<=16": {"block_n": 32, "num_warps": 4,
"num_stages": 3, "target_programs": 1024}}}. A kernel asks `launch_config(kernel, bucket, device)` and gets its
defaults overlaid by what the file says; on a GPU without a file, or on CPU (the interpreter), the defaults.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch

TUNED = Path(__file__).resolve().parent / "tuned"
DEFAULTS: dict[str, dict[str, Any]] = {
    "w4a16": {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "target_programs": 512},
    "w8a16": {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 2, "target_programs": 512},
    "paged_decode": {"num_warps": 4, "num_stages": 2, "target_programs": 8192},
    "grouped_gemm": {"block_n": 64, "num_warps": 4, "num_stages": 2},
    "int4_linear": {},          # {"path": ...}: which kernel serves a quantized linear (engine.model.quantized_linear)
    "fp8_linear": {},
}


def gpu_key(name: str) -> str:
    """A GPU's name as a file name: `NVIDIA H200` -> `nvidia-h200`."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


ROWS_BUCKETS = ("rows<=1", "rows<=4", "rows<=16", "rows<=64")


def rows_bucket(rows: int) -> str:
    """The shape bucket of a GEMM by its rows: decode's few rows tune apart from a batch's."""
    for bucket in ROWS_BUCKETS:
        if rows <= int(bucket.removeprefix("rows<=")):
            return bucket
    return "rows>64"


_trying: dict[tuple[str, str], dict[str, Any]] = {}        # the autotuner's candidate, while it times it


@contextmanager
def trying(kernel: str, bucket: str, config: dict[str, Any]) -> Iterator[None]:
    """Calls of `kernel` in `bucket` use `config` (over the defaults) inside the block: how the autotuner times a
    candidate through the kernels' own entry points."""
    _trying[kernel, bucket] = config
    try:
        yield
    finally:
        del _trying[kernel, bucket]


@cache
def _tuned(key: str) -> dict[str, Any]:
    path = TUNED / f"{key}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@cache
def _device_key(index: int | None) -> str:
    """A CUDA device's file name, asked of the driver once: every quantized linear and kernel call looks it up."""
    return gpu_key(torch.cuda.get_device_name(index))


def reread_tuned_files() -> None:
    """The autotuner, having written a stage's configurations, times the next stage on them."""
    _tuned.cache_clear()


def launch_config(kernel: str, bucket: str, device: torch.device) -> dict[str, Any]:
    """The kernel's configuration for a shape bucket on this device: its defaults, overlaid by the committed tuning of
    this GPU where there is one."""
    config = dict(DEFAULTS[kernel])
    if device.type == "cuda":
        config.update(_tuned(_device_key(device.index)).get(kernel, {}).get(bucket, {}))
    config.update(_trying.get((kernel, bucket), {}))
    return config
