"""Timing one call: warm-up, then as many repetitions as a time budget allows, and their median.

On CPU each call is timed with `time.perf_counter`; on CUDA with a pair of CUDA events around
each call (the queue is drained once, after all of them), so a time is the GPU's, launch gaps
between calls excluded. Medians, not means, because a background process or a page fault can
stretch a few calls by orders of magnitude.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Timing:
    """How long to measure each op: `warmup` untimed calls, then `budget_s` seconds of calls,
    at least `min_repeats` and at most `max_repeats` of them."""

    warmup: int = 2
    budget_s: float = 0.5
    min_repeats: int = 3
    max_repeats: int = 50


QUICK_TIMING = Timing(warmup=2, budget_s=0.15, min_repeats=3, max_repeats=15)
FULL_TIMING = Timing()


@dataclass(frozen=True, slots=True)
class Measured:
    """The median seconds of `repeats` timed calls."""

    median_s: float
    repeats: int


def time_calls(fn: Callable[[], object], *, device: Literal["cpu", "cuda"], repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`."""
    if device == "cuda":
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]  # elapsed_time is in ms
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return times


def measure(fn: Callable[[], object], *, device: Literal["cpu", "cuda"], timing: Timing) -> Measured:
    """Median seconds per call of `fn` after warm-up; the repeat count fits `timing.budget_s` at the
    speed of the last warm-up call."""
    estimate_s = 0.0
    for _ in range(max(timing.warmup, 1)):
        estimate_s = time_calls(fn, device=device, repeats=1)[0]
    repeats = int(timing.budget_s / estimate_s) if estimate_s > 0 else timing.max_repeats
    repeats = min(max(repeats, timing.min_repeats), timing.max_repeats)
    times = time_calls(fn, device=device, repeats=repeats)
    return Measured(median_s=max(statistics.median(times), 1e-9), repeats=repeats)
