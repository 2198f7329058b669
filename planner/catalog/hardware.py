"""The hardware catalogue: per-device memory, bandwidth, peak FLOP/s, interconnect, launch costs and a price.

Data lives in `planner/data/hardware.json`. `cpu` is a placeholder whose real rates come from a
calibration: `with_measured_peaks` replaces the catalogue's figures by those a profile measured.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache

from planner.errors import PlannerError
from planner.files import DATA

HARDWARE_FILE = DATA / "hardware.json"
MIB = 1 << 20


@dataclass(frozen=True)
class HardwareSpec:
    key: str
    name: str
    memory_bytes: int               # as the device reports it
    bandwidth_bytes_per_s: float    # peak memory (HBM) bandwidth
    bf16_flops_per_s: float         # dense tensor-core peak
    fp8_flops_per_s: float | None   # None where the device has no FP8 tensor cores
    fp4_flops_per_s: float | None   # None where it has no FP4 tensor cores: NVFP4 is Blackwell's
    link_bytes_per_s: float         # what one GPU sends per second to the others (one direction)
    network_bytes_per_s: float      # what one GPU sends per second to another node (its NIC, one direction)
    gpu_hour_usd: float
    calibrated: bool = False        # True for `cpu`: only meaningful with a calibration's measured peaks
    allreduce_latency_s: float = 0.0            # one small all-reduce, inside a CUDA graph
    allreduce_latency_eager_s: float = 0.0      # the same launched on its own
    kernel_launch_s: float = 0.0                # host time per kernel an eager step launches
    cuda_graphs: bool = False                   # serving engines capture decode steps in CUDA graphs here
    gpus_per_node: int = 8                      # GPUs one NVLink domain joins; beyond, traffic crosses the NICs
    same_silicon_as: str | None = None          # the GPU whose die it is (H800: the H100 SXM's): its fits apply

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "bandwidth_bytes_per_s", "bf16_flops_per_s", "link_bytes_per_s",
                     "network_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise PlannerError(f"hardware {self.key!r}: {name} must be positive, got {getattr(self, name)!r}")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node > 0):
            raise PlannerError(f"hardware {self.key!r}: gpus_per_node must be a positive integer, got "
                               f"{self.gpus_per_node!r}")
        for name in ("gpu_hour_usd", "allreduce_latency_s", "allreduce_latency_eager_s", "kernel_launch_s"):
            if not getattr(self, name) >= 0:
                raise PlannerError(f"hardware {self.key!r}: {name} must be >= 0, got {getattr(self, name)!r}")

    def shares_kernels_with(self, kinds: list[str]) -> bool:
        """Whether fits made on these GPU kinds price this one: one of them, or its die."""
        return self.key in kinds or self.same_silicon_as in kinds

    def collective_latency(self, cuda_graphs: bool) -> float:
        return self.allreduce_latency_s if cuda_graphs else self.allreduce_latency_eager_s

    def launch_cost(self, cuda_graphs: bool) -> float:
        """Host seconds per kernel a step launches: none inside a CUDA graph (one launch for the whole step)."""
        return 0.0 if cuda_graphs else self.kernel_launch_s

    @property
    def supports_nvfp4(self) -> bool:
        return self.fp4_flops_per_s is not None

    def peak_flops(self, weights: str) -> float:
        """The matmul peak for a weight dtype: FP8 weights run FP8 tensor cores (W8A8) where there are
        any, NVFP4 the FP4 ones; BF16, INT4 (dequantized to BF16 in the kernel) and the rest run BF16."""
        if weights == "fp8" and self.fp8_flops_per_s:
            return self.fp8_flops_per_s
        if weights == "nvfp4" and self.fp4_flops_per_s:
            return self.fp4_flops_per_s
        return self.bf16_flops_per_s

    def with_price(self, gpu_hour_usd: float | None) -> HardwareSpec:
        return self if gpu_hour_usd is None else replace(self, gpu_hour_usd=gpu_hour_usd)

    def with_measured_peaks(self, bandwidth_bytes_per_s: float, flops_per_s: float,
                            memory_bytes: int | None = None) -> HardwareSpec:
        return replace(self, bandwidth_bytes_per_s=bandwidth_bytes_per_s, bf16_flops_per_s=flops_per_s,
                       fp8_flops_per_s=None, fp4_flops_per_s=None, memory_bytes=memory_bytes or self.memory_bytes)


@lru_cache(maxsize=1)
def catalogue() -> dict[str, HardwareSpec]:
    entries = json.loads(HARDWARE_FILE.read_text())
    specs = {}
    for key, entry in entries.items():
        if key.startswith("_"):
            continue
        fp8, fp4 = entry["fp8_tflops"], entry["fp4_tflops"]
        specs[key] = HardwareSpec(
            key=key, name=entry["name"], memory_bytes=entry["memory_mib"] * MIB,
            bandwidth_bytes_per_s=entry["bandwidth_gb_s"] * 1e9, bf16_flops_per_s=entry["bf16_tflops"] * 1e12,
            fp8_flops_per_s=None if fp8 is None else fp8 * 1e12, fp4_flops_per_s=None if fp4 is None else fp4 * 1e12,
            link_bytes_per_s=entry["link_gb_s_per_direction"] * 1e9,
            network_bytes_per_s=entry["network_gb_s_per_gpu"] * 1e9, gpu_hour_usd=entry["gpu_hour_usd"],
            calibrated=entry.get("calibrated", False),
            allreduce_latency_s=entry["allreduce_latency_us"]["cuda_graphs"] * 1e-6,
            allreduce_latency_eager_s=entry["allreduce_latency_us"]["eager"] * 1e-6,
            kernel_launch_s=entry["kernel_launch_us"] * 1e-6, cuda_graphs=entry["cuda_graphs"],
            gpus_per_node=entry["gpus_per_node"], same_silicon_as=entry.get("same_silicon_as"))
    for spec in specs.values():
        if spec.same_silicon_as is not None and spec.same_silicon_as not in specs:
            raise PlannerError(f"hardware {spec.key!r}: same_silicon_as names {spec.same_silicon_as!r}, not in the "
                               f"catalogue")
    return specs


def hardware_names() -> list[str]:
    return list(catalogue())


def get_hardware(name: str) -> HardwareSpec:
    specs = catalogue()
    if name not in specs:
        raise PlannerError(f"unknown hardware {name!r} (choose from {', '.join(specs)})")
    return specs[name]
