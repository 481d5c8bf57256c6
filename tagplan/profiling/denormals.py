"""Measure a CPU with subnormal floats flushed to zero, as a GPU computes them.

A training step's small values (a squared gradient in Adam's second moment, a gradient that has nearly
vanished) fall below float32's smallest normal number, 1.2e-38. A GPU runs subnormal arithmetic at full
speed (or flushes it); an x86 CPU takes a microcode assist on each such operation, about a hundred
cycles. On the Intel Xeon VM of this project one quick-grid iteration (`profiling.iterations`: a
4-layer, 256-wide GPT at 128 tokens) ran 15.3 s with subnormals and 0.29 s flushed, and the grid's times
stopped following the shapes' work. The assists measure the CPU's slow path, not the step the cost model
describes, so measurements on a CPU flush subnormals to zero (x86 SSE3 and AArch64: `torch.set_flush_denormal`).
The values flushed are below 1.2e-38; no loss or update a test compares moves by them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def flushed_denormals(device: str) -> Iterator[bool]:
    """Within the block, CPU arithmetic flushes subnormal floats to zero where the CPU supports it (yields
    whether it does; False for a GPU device, which needs none); afterwards PyTorch's default (keep them)."""
    if torch.device(device).type != "cpu":
        yield False
        return
    supported = torch.set_flush_denormal(True)
    try:
        yield supported
    finally:
        torch.set_flush_denormal(False)
