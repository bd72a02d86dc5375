"""Device specs for the roofline that gives compute nodes their `duration_micros`.

A node takes max(FLOPs / peak, bytes / memory bandwidth) -- the same roofline ASTRA-sim
applies in its `roofline-enabled` mode, so replay and roofline runs agree. Peaks are the
vendors' dense tensor-core figures (no sparsity) per operand dtype: bf16 and fp16 share one,
fp32 GEMMs run as TF32 on tensor cores (PyTorch's `allow_tf32` / matmul precision "high";
strict IEEE fp32 is 8-16x slower), fp8 is twice bf16 where the chip has it (H100 onwards,
MI300X). Bandwidths are HBM peaks. The numbers live in stg/data/devices/*.yaml with
their datasheet sources.
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


def from_dict(data: dict, where: str = "device") -> DeviceSpec:
    """A DeviceSpec from a device file's mapping (stg/data/devices/*.yaml); PlanError naming the field."""
    try:
        peaks = data["peak_tflops"]
        spec = DeviceSpec(str(data["name"]), float(peaks["bf16"]), float(data["memory_tbps"]),
                          float(data["memory_gib"]), float(peaks["tf32"]),
                          float(peaks["fp8"]) if peaks.get("fp8") is not None else None)
    except KeyError as missing:
        raise PlanError(f"{where}: missing field {missing.args[0]}") from None
    except (TypeError, ValueError, AttributeError) as error:
        raise PlanError(f"{where}: malformed device description ({error})") from None
    if min(spec.peak_tflops, spec.memory_tbps, spec.memory_gib, spec.tf32_tflops) <= 0:
        raise PlanError(f"{where}: peak_tflops, memory_tbps and memory_gib must be positive")
    return spec


def load_device(name_or_path: str) -> DeviceSpec:
    """A packaged device by name, or a device file by path."""
    from stg.data import load

    return from_dict(load("devices", name_or_path), f"device {name_or_path}")


# the packaged devices; a plan names one of these (a device file is registered under its name)
DEVICES = {d.name: d for d in map(load_device, ("h100", "h200", "a100", "b200", "mi300x"))}
DEFAULT_DEVICE = "h100"


def register_device(name_or_path: str) -> DeviceSpec:
    """Load a device (name or file) and make plans able to name it."""
    spec = DEVICES.get(name_or_path) or load_device(name_or_path)
    DEVICES.setdefault(spec.name, spec)
    if DEVICES[spec.name] != spec:
        raise PlanError(f"device: {name_or_path} redefines device {spec.name!r} with other numbers")
    return spec


def device_spec(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise PlanError(f"device: unknown device {name!r}; known: {', '.join(DEVICES)}") from None
