"""Device specs for the roofline that gives compute nodes their `duration_micros`.

A node takes max(FLOPs / peak, bytes / memory bandwidth) -- the same roofline ASTRA-sim
applies in its `roofline-enabled` mode, so replay and roofline runs agree. Peaks are the
vendors' dense tensor-core figures (no sparsity) per operand dtype: bf16 and fp16 share one,
fp32 GEMMs run as TF32 on tensor cores (PyTorch's `allow_tf32` / matmul precision "high";
strict IEEE fp32 is 8-16x slower), fp8 is twice bf16 where the chip has it (H100 onwards,
MI300X). Bandwidths are HBM peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.errors import PlanError
from stg.graph import DType


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: float  # dense bf16 / fp16
    memory_tbps: float  # HBM bandwidth, TB/s
    memory_gib: float
    tf32_tflops: float  # dense TF32: what fp32 GEMMs run at
    fp8_tflops: float | None = None  # dense fp8; None: no fp8 tensor cores

    def peak(self, dtype: DType) -> float:
        """Dense TFLOP/s of a GEMM whose operands are `dtype`."""
        if dtype is DType.FP8:
            if self.fp8_tflops is None:
                raise PlanError(f"fp8: device {self.name} has no fp8 tensor cores")
            return self.fp8_tflops
        return self.tf32_tflops if dtype is DType.FP32 else self.peak_tflops

    def duration_us(self, flops: int, nbytes: int, dtype: DType = DType.BF16) -> float:
        return max(flops / (self.peak(dtype) * 1e12), nbytes / (self.memory_tbps * 1e12)) * 1e6


DEVICES = {
    d.name: d
    for d in (
        DeviceSpec("h100", 989.4, 3.35, 80, 494.7, 1978.9),  # H100 SXM5 datasheet
        DeviceSpec("h200", 989.4, 4.8, 141, 494.7, 1978.9),  # H200 SXM datasheet
        DeviceSpec("a100", 312.0, 2.039, 80, 156.0),  # A100 SXM4 80GB datasheet (no fp8)
        DeviceSpec("b200", 2250.0, 8.0, 180, 1100.0, 4500.0),  # B200 (HGX) datasheet, dense
        DeviceSpec("mi300x", 1307.4, 5.3, 192, 653.7, 2614.9),  # AMD Instinct MI300X datasheet, dense
    )
}
DEFAULT_DEVICE = "h100"


def device_spec(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise PlanError(f"device: unknown device {name!r}; known: {', '.join(DEVICES)}") from None
