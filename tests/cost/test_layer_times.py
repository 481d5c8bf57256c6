"""Measured layer times: interpolated over micro-batch and tp, never extrapolated."""

from __future__ import annotations

import pytest

from tagplan.cost.calibration import LayerTime
from tagplan.cost.compute import profiled_block_time
from tagplan.ir.workload import DType


def point(tp: int, mb: float, seconds: float) -> LayerTime:
    return LayerTime(block_hash="b", device="d", dtype=DType.BF16, seq_len=8, tp=tp, micro_batch=mb,
                     forward_s=seconds, backward_s=2 * seconds)


PROFILES = [point(1, 1, 1.0), point(1, 4, 4.0), point(4, 1, 0.25), point(4, 4, 1.0)]


def test_interpolates_over_micro_batch_and_tp() -> None:
    t, why = profiled_block_time(PROFILES, tp=1, samples=2)
    assert t is not None and t.forward_s == pytest.approx(2.0) and t.backward_s == pytest.approx(4.0)
    assert why == "layer profile (interpolated)"
    t, why = profiled_block_time(PROFILES, tp=2, samples=4)  # linear in 1/tp: halfway between 1/1 and 1/4 is 1/2
    assert t is not None and t.forward_s == pytest.approx(4.0 + (1.0 - 4.0) * (2 / 3))


def test_never_extrapolates() -> None:
    assert profiled_block_time(PROFILES, tp=8, samples=1) == (None, "tp 8 outside the profiled degrees [1, 4]")
    t, why = profiled_block_time(PROFILES, tp=1, samples=8)
    assert t is None and "outside the profiled sizes 1-4" in why
