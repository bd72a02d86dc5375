"""Device specs for the roofline that gives compute nodes their `duration_micros`.

A node takes max(FLOPs / peak, bytes / memory bandwidth) -- the same roofline ASTRA-sim
applies in its `roofline-enabled` mode, so replay and roofline runs agree. Peaks are the
vendors' dense bf16 tensor-core figures (no sparsity); bandwidths are HBM peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.errors import PlanError


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: float  # dense bf16
    memory_tbps: float  # HBM bandwidth, TB/s
    memory_gib: float

    def duration_us(self, flops: int, nbytes: int) -> float:
        return max(flops / (self.peak_tflops * 1e12), nbytes / (self.memory_tbps * 1e12)) * 1e6


DEVICES = {
    d.name: d
    for d in (
        DeviceSpec("h100", 989.4, 3.35, 80),  # H100 SXM5 datasheet
        DeviceSpec("h200", 989.4, 4.8, 141),  # H200 SXM datasheet
        DeviceSpec("a100", 312.0, 2.039, 80),  # A100 SXM4 80GB datasheet
        DeviceSpec("b200", 2250.0, 8.0, 180),  # B200 (HGX) datasheet, dense
        DeviceSpec("mi300x", 1307.4, 5.3, 192),  # AMD Instinct MI300X datasheet, dense
    )
}
DEFAULT_DEVICE = "h100"


def device_spec(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise PlanError(f"device: unknown device {name!r}; known: {', '.join(DEVICES)}") from None
