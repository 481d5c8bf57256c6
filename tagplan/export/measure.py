"""Measure a plan for real: run its exported torch program on local gloo processes and time it.

`measure` writes the program (`torch_program.write_torch_program`) for the model as given (on CPU,
keep it small), runs `warmup + steps` training steps on `len(plan.devices)` processes, discards the
warm-up, and returns the median step time of the slowest rank with the spread (min and max of the
kept steps). `tagplan measure` appends it to a trace bundle as an `iteration` record: what
`tagplan calibrate` fits the named physical parameters to, and what the learned correction trains on.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tagplan.export.checks import ExportError
from tagplan.export.runtime_launch import launch
from tagplan.export.torch_program import write_torch_program
from tagplan.frontends.model_spec import ModelSpec
from tagplan.ir.plan import Plan
from tagplan.ir.workload import DType, Optimizer


@dataclass(frozen=True)
class Measurement:
    """Seconds per training step: the median of the kept steps on the slowest rank, and their range."""

    median_s: float
    min_s: float
    max_s: float
    steps: int
    peak_memory_bytes: float | None = None  # on GPUs: the largest rank's peak allocation over the run


def measure(model_spec: str | ModelSpec, plan: Plan, *, seq_len: int, global_batch: int, steps: int = 5,
            warmup: int = 2, optimizer: Optimizer = Optimizer.ADAM, timeout_s: float = 600.0,
            dtype: DType = DType.FP32, device: Literal["cpu", "cuda"] = "cpu") -> Measurement:
    """Run `plan` for `warmup + steps` steps in `dtype` (fp32, or bf16/fp16 autocast) on local processes,
    on CPUs (gloo) or, with `device` "cuda", one GPU per rank (NCCL); ExportError when it fails."""
    if steps < 1 or warmup < 0:
        raise ExportError(f"steps={steps}, warmup={warmup}: need at least one timed step and no negative warm-up")
    with tempfile.TemporaryDirectory(prefix="tagplan-measure-") as tmp:
        program = write_torch_program(model_spec, plan, Path(tmp), seq_len=seq_len, global_batch=global_batch,
                                      steps=warmup + steps, dtype=dtype, optimizer=optimizer)
        runs = launch(program, len(plan.devices), [], timeout_s=timeout_s, device=device)
    failed = [r for r in runs if r.returncode != 0]
    if failed:
        tail = failed[0].stderr_tail.strip().splitlines()[-1:] or ["(no output)"]
        raise ExportError(f"rank {failed[0].rank} exited with {failed[0].returncode}: {tail[0][:300]}")
    per_step: dict[int, float] = {}
    for run in runs:  # a step takes as long as its slowest rank
        for line in run.lines:
            step = int(line["step"])
            per_step[step] = max(per_step.get(step, 0.0), float(line["time_s"]))
    kept = [t for step, t in sorted(per_step.items()) if step >= warmup]
    if not kept:
        raise ExportError(f"the program printed {len(per_step)} step times; expected {warmup + steps}")
    peaks = [float(line["peak_memory_bytes"]) for run in runs for line in run.lines if "peak_memory_bytes" in line]
    return Measurement(statistics.median(kept), min(kept), max(kept), len(kept), max(peaks) if peaks else None)
