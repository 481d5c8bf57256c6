"""CPU measurements flush subnormal floats, as a GPU computes them (profiling.denormals)."""

from __future__ import annotations

import pytest
import torch

from tagplan.profiling import iterations
from tagplan.profiling.denormals import flushed_denormals
from tagplan.profiling.iterations import QUICK_CASES, measure_iteration
from tagplan.profiling.layers import time_block

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def _kept() -> bool:
    """Whether CPU arithmetic keeps a subnormal float32 now (False: flushed to zero)."""
    return bool((torch.tensor([SUBNORMAL]) * 1.0).item() > 0)


def _flushes_here() -> bool:
    """Whether this CPU can flush subnormals (torch supports x86 with SSE3 and AArch64); PyTorch's default
    (keep them) restored."""
    with flushed_denormals("cpu") as supported:
        return supported


def test_a_cpu_block_flushes_subnormals_where_the_cpu_can_and_then_keeps_them_again() -> None:
    assert _kept()
    with flushed_denormals("cpu") as supported:
        # where the CPU cannot flush, the block says so and arithmetic is unchanged
        assert _kept() is not supported
    assert _kept()
    with flushed_denormals("cuda") as supported:  # a GPU needs none, and the host's arithmetic is left alone
        assert supported is False and _kept()


def test_an_iteration_and_a_block_are_timed_with_subnormals_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    kept_inside = not _flushes_here()
    seen: list[bool] = []
    monkeypatch.setattr(iterations, "training_step", lambda *a, **k: lambda: seen.append(_kept()))
    measure_iteration(QUICK_CASES[0], steps=2, warmup=1)
    assert seen == [kept_inside] * 3 and _kept()

    class Probe(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(_kept())
            return super().forward(x)

    seen.clear()
    time_block(Probe(4, 4), lambda: torch.ones(2, 4), repeats=1, warmup=1)
    assert seen == [kept_inside] * 2 and _kept()
