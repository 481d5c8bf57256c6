"""Calibration: achieved fraction of peak per device type, op kind and op size.

The shipped defaults are one table for every device, justified from public measurements
(not fitted to any benchmark row); `tagplan calibrate` (traces work) writes a measured table
in the same JSON shape and it replaces them.

- Tensor-core GEMMs (bf16/fp16): cuBLAS reaches 75-80% of dense peak on large square GEMMs
  on A100 and H100 (NVIDIA's cuBLAS and Megatron-LM reports; 8192^3 bf16 on H100 SXM runs near
  750-800 TFLOP/s), about 60% for a few GFLOP, and falls off steeply below 100 MFLOP where
  launch and tail effects dominate. The curve is piecewise-linear in log10(FLOPs per call).
- Fused attention (FlashAttention-2): 50-70% of peak forward and lower backward (Dao 2023); we
  use 0.85 x the GEMM curve, and the backward pass does 2.5x the forward FLOPs.
- Memory-bound kernels (norms, pointwise, softmax): 80% of datasheet HBM bandwidth, as STREAM-
  like copies reach 85-90% and PyTorch pointwise kernels somewhat less.
- Launch overhead: 4 us per kernel (CUDA launch plus framework dispatch, as profiles show).
"""

from __future__ import annotations

import bisect
import math
from functools import cached_property

from pydantic import Field, model_validator

from tagplan.ir.base import Record
from tagplan.ir.model import OpKind

ANY_DEVICE = "*"


class EfficiencyCurve(Record):
    """Fraction of peak FLOP/s reached as a function of FLOPs per kernel call."""

    flops: tuple[float, ...] = Field(min_length=1, description="increasing FLOPs per call")
    efficiency: tuple[float, ...] = Field(min_length=1, description="fraction of peak at each point, (0, 1]")

    @model_validator(mode="after")
    def _check(self) -> EfficiencyCurve:
        if len(self.flops) != len(self.efficiency):
            raise ValueError(f"{len(self.flops)} flops points but {len(self.efficiency)} efficiencies")
        if any(b <= a for a, b in zip(self.flops, self.flops[1:], strict=False)) or min(self.flops) <= 0:
            raise ValueError(f"flops points must be positive and increasing, got {list(self.flops)}")
        if any(not 0 < e <= 1 for e in self.efficiency):
            raise ValueError(f"efficiencies must be in (0, 1], got {list(self.efficiency)}")
        return self

    @cached_property
    def _logs(self) -> list[float]:
        return [math.log10(f) for f in self.flops]

    def at(self, flops: float) -> float:
        """Efficiency for a call of `flops` FLOPs (clamped at the curve's ends)."""
        if flops <= self.flops[0]:
            return self.efficiency[0]
        if flops >= self.flops[-1]:
            return self.efficiency[-1]
        x = math.log10(flops)
        i = bisect.bisect_right(self._logs, x)
        x0, x1 = self._logs[i - 1], self._logs[i]
        e0, e1 = self.efficiency[i - 1], self.efficiency[i]
        return e0 + (e1 - e0) * (x - x0) / (x1 - x0)


def scaled(curve: EfficiencyCurve, factor: float) -> EfficiencyCurve:
    """The curve with every efficiency multiplied by `factor` (capped at 1)."""
    return EfficiencyCurve(flops=curve.flops, efficiency=tuple(min(1.0, e * factor) for e in curve.efficiency))


GEMM_CURVE = EfficiencyCurve(
    flops=(1e6, 1e8, 1e9, 1e10, 1e11, 1e12),
    efficiency=(0.02, 0.25, 0.45, 0.62, 0.72, 0.78),
)


class Calibration(Record):
    """Efficiencies by device type (`*` for any) and op kind; memory and launch figures."""

    name: str = "defaults"
    compute: dict[str, dict[OpKind, EfficiencyCurve]] = Field(
        default_factory=lambda: {ANY_DEVICE: {OpKind.MATMUL: GEMM_CURVE, OpKind.CONV: scaled(GEMM_CURVE, 0.9),
                                              OpKind.ATTENTION: scaled(GEMM_CURVE, 0.85)}})
    memory_efficiency: dict[str, float] = Field(default_factory=lambda: {ANY_DEVICE: 0.8})
    launch_overhead_s: float = Field(default=4e-6, ge=0)
    attention_backward_factor: float = Field(default=2.5, gt=0, description="backward / forward FLOPs")

    def curve(self, device: str, kind: OpKind) -> EfficiencyCurve | None:
        """The curve for `kind` on `device`, else the any-device curve, else None (memory-bound)."""
        for key in (device, ANY_DEVICE):
            table = self.compute.get(key)
            if table is not None and kind in table:
                return table[kind]
        return None

    def bandwidth_fraction(self, device: str) -> float:
        """Fraction of datasheet memory bandwidth memory-bound kernels reach on `device`."""
        return self.memory_efficiency.get(device, self.memory_efficiency.get(ANY_DEVICE, 0.8))


DEFAULT_CALIBRATION = Calibration()
