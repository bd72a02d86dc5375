"""Device specs for the roofline that gives compute nodes their `duration_micros`.

A node takes max(FLOPs / (peak x achieved fraction), bytes / (memory bandwidth x memory
efficiency)). Peaks are the vendors' dense tensor-core figures (no sparsity) per operand dtype:
bf16 and fp16 share one, fp32 GEMMs run as TF32 on tensor cores (PyTorch's `allow_tf32` /
matmul precision "high"; strict IEEE fp32 is 8-16x slower), fp8 is twice bf16 where the chip
has it (H100 onwards, MI300X). Bandwidths are HBM peaks. A GEMM (an einsum op) reaches a
fraction of its peak that grows with its size: `matmul_efficiency` gives measured points
(GFLOP of one GEMM, achieved / peak), interpolated in log size and held flat beyond the ends;
a device without them runs every GEMM at peak. `memory_efficiency` scales the bandwidth.
The numbers live in stg/data/devices/*.yaml with their sources.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

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
    # (GFLOP of one GEMM, achieved fraction of peak), ascending in size; (): every GEMM at peak
    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    memory_efficiency: float = 1.0  # achieved fraction of the HBM bandwidth

    def peak(self, dtype: DType) -> float:
        """Dense TFLOP/s of a GEMM whose operands are `dtype`."""
        if dtype is DType.FP8:
            if self.fp8_tflops is None:
                raise PlanError(f"fp8: device {self.name} has no fp8 tensor cores")
            return self.fp8_tflops
        return self.tf32_tflops if dtype is DType.FP32 else self.peak_tflops

    def matmul_fraction(self, flops):
        """The achieved fraction of peak of a GEMM of `flops` (a number or an array of them)."""
        if isinstance(flops, np.ndarray):
            return _fractions(self.matmul_efficiency, flops)
        return _fraction(self.matmul_efficiency, flops)  # the copies of a layer ask for a few sizes

    def duration_us(self, flops, nbytes, dtype: DType = DType.BF16, matmul=False):
        """Microseconds of an op of `flops` and `nbytes`; `matmul`: it is a GEMM, which runs at
        its size's fraction of peak. Numbers, or arrays of them (one op per element; `matmul`
        then an array of flags)."""
        peak, bandwidth = self.peak(dtype) * 1e12, self.memory_tbps * 1e12 * self.memory_efficiency
        if isinstance(flops, np.ndarray):
            fraction = np.where(matmul, self.matmul_fraction(flops), 1.0)
            return np.maximum(flops / (peak * fraction), nbytes / bandwidth) * 1e6
        fraction = self.matmul_fraction(flops) if matmul else 1.0
        return max(flops / (peak * fraction), nbytes / bandwidth) * 1e6


def _fractions(curve: tuple[tuple[float, float], ...], flops: np.ndarray) -> np.ndarray:
    """`curve`'s fraction at each GEMM size of `flops`: interpolated in log size, flat beyond its
    ends; 1 without a curve."""
    if not curve:
        return np.ones(np.shape(flops))
    sizes, fractions = zip(*curve)
    gflop = np.maximum(np.asarray(flops, dtype=float), 1) / 1e9  # (float: counts past int64 are refused later)
    return np.interp(np.log(gflop), np.log(sizes), fractions)


@functools.lru_cache(maxsize=1 << 14)
def _fraction(curve: tuple[tuple[float, float], ...], flops: int) -> float:
    return float(_fractions(curve, flops))


def from_dict(data: dict, where: str = "device") -> DeviceSpec:
    """A DeviceSpec from a device file's mapping (stg/data/devices/*.yaml); PlanError naming the field."""
    try:
        peaks = data["peak_tflops"]
        spec = DeviceSpec(str(data["name"]), float(peaks["bf16"]), float(data["memory_tbps"]),
                          float(data["memory_gib"]), float(peaks["tf32"]),
                          float(peaks["fp8"]) if peaks.get("fp8") is not None else None,
                          tuple((float(size), float(fraction)) for size, fraction in data.get("matmul_efficiency", ())),
                          float(data.get("memory_efficiency", 1.0)))
    except KeyError as missing:
        raise PlanError(f"{where}: missing field {missing.args[0]}") from None
    except (TypeError, ValueError, AttributeError) as error:
        raise PlanError(f"{where}: malformed device description ({error})") from None
    if min(spec.peak_tflops, spec.memory_tbps, spec.memory_gib, spec.tf32_tflops) <= 0:
        raise PlanError(f"{where}: peak_tflops, memory_tbps and memory_gib must be positive")
    if not 0 < spec.memory_efficiency <= 1:
        raise PlanError(f"{where}: memory_efficiency must be in (0, 1], not {spec.memory_efficiency}")
    sizes = [size for size, _ in spec.matmul_efficiency]
    if any(not 0 < f <= 1 for _, f in spec.matmul_efficiency) or min(sizes, default=1) <= 0 \
            or sizes != sorted(set(sizes)):
        raise PlanError(f"{where}: matmul_efficiency must be [GFLOP, fraction] pairs with sizes > 0 ascending "
                        "and fractions in (0, 1]")
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
