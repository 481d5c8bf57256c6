"""`profile`: measure this machine's ops and collectives and write a `tagplan-traces/1` bundle.

`profile` is what `tagplan profile` runs: the device's `DeviceSpec` (`device`), an op grid timed
forward and backward (`ops`, `grids`), collectives among local ranks (`collectives`), written with
the host's fingerprint. The bundle is the input of calibration: each op record's FLOPs and bytes
are those `ir.model.Op` and `cost.compute.op_time` use, each collective's size and bus bandwidth
those of nccl-tests.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from tagplan.datasets.traces.bundle import Manifest, OpRecord, TraceRecord, now_iso, write_bundle
from tagplan.errors import SpecError
from tagplan.ir.cluster import DeviceSpec
from tagplan.profiling.collectives import COLLECTIVES, CollectiveName, measure_collectives
from tagplan.profiling.device import (
    cpu_device_spec,
    cuda_device_spec,
    fingerprint,
    idle_cores,
    require_cuda,
    with_peaks_at_least,
)
from tagplan.profiling.grids import message_sizes, op_grid
from tagplan.profiling.ops import OpCase, achieved_flops, measure_ops
from tagplan.profiling.timing import FULL_TIMING, QUICK_TIMING, Timing

log = logging.getLogger(__name__)


def default_world(device: Literal["cpu", "cuda"]) -> int:
    """Ranks for collectives when none is asked for: 2 on CPU, every GPU on CUDA (1: no collectives)."""
    if device == "cpu":
        return 2
    import torch

    return torch.cuda.device_count()


def command_line(out_dir: str | os.PathLike[str], *, device: str, quick: bool, world: int | None = None,
                 threads: int | None = None) -> str:
    """The `tagplan profile` command equivalent to a `profile` call, as the manifest's source."""
    parts = ["tagplan profile", f"--device {device}", "--quick" if quick else "",
             f"--world {world}" if world is not None else "", f"--threads {threads}" if threads is not None else "",
             f"--out {out_dir}"]
    return " ".join(p for p in parts if p)


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def profile(out_dir: str | os.PathLike[str], *, device: Literal["cpu", "cuda"] = "cpu", quick: bool = False,
            world: int | None = None, threads: int | None = None, progress: Callable[[str], None] | None = None,
            grid: Sequence[OpCase] | None = None, sizes_bytes: Sequence[int] | None = None,
            collectives: Sequence[CollectiveName] = COLLECTIVES) -> Path:
    """Measure this machine and write a bundle to `out_dir`; returns the bundle's directory.

    `quick` picks the small grids (about a minute on two CPU cores) and short timing. `grid` and
    `sizes_bytes` replace the op grid and the collective message sizes (bytes); an empty one skips
    that part. Collectives run among `world` ranks (default `default_world`; below 2, none).
    On CPU the ops run on `threads` torch threads and the DeviceSpec's peaks count that many cores.
    The default is torch's thread count, at most the cores no other process keeps busy
    (`idle_cores`): a thread sharing a core with another job makes its siblings wait for the
    scheduler, and a 0.5 ms GEMM then takes 8-24 ms, which would time the scheduler, not the op.
    `progress` receives one line per measured op and collective size. SpecError when `device` is
    not 'cpu' or 'cuda', or is 'cuda' on a host where torch sees no GPU.
    """
    _check_arguments(device, threads)
    import torch

    started = time.perf_counter()
    op_threads = threads if threads is not None else min(torch.get_num_threads(), idle_cores())
    cases = op_grid(device, quick=quick) if grid is None else list(grid)
    timing = QUICK_TIMING if quick else FULL_TIMING
    spec, ops, spec_note = _measure_device(device, cases, timing=timing, threads=op_threads, progress=progress)
    records: list[TraceRecord] = list(ops)
    ranks = default_world(device) if world is None else world
    sizes = message_sizes(quick=quick) if sizes_bytes is None else list(sizes_bytes)
    if ranks >= 2 and sizes and collectives:
        records += measure_collectives(sizes, device_type=spec.name, world=ranks, device=device,
                                       collectives=collectives, max_repeats=20 if quick else 30, progress=progress)
    notes = (f"torch threads {op_threads}; {len(cases)} op cases, {len(sizes)} message sizes; {spec_note}; "
             f"took {time.perf_counter() - started:.0f} s")
    source = command_line(out_dir, device=device, quick=quick, world=world, threads=threads)
    manifest = Manifest(created=now_iso(), source=source, fingerprint=fingerprint(device), device=spec, notes=notes)
    return write_bundle(out_dir, manifest, records)


def _measure_device(device: Literal["cpu", "cuda"], cases: Sequence[OpCase], *, timing: Timing, threads: int,
                    progress: Callable[[str], None] | None) -> tuple[DeviceSpec, list[OpRecord], str]:
    """The device's spec (peaks raised to rates its ops reached), its op records, and a note on the spec."""
    with _torch_threads(threads):
        spec = cpu_device_spec(cores=threads) if device == "cpu" else cuda_device_spec()
        if progress is not None:
            progress(f"device {spec.name}: {spec.peak_flops_fp32 / 1e9:.4g} GFLOP/s fp32, "
                     f"{spec.mem_bandwidth_Bps / 1e9:.3g} GB/s memory")
        ops = list(measure_ops(cases, device=device, device_type=spec.name, timing=timing, progress=progress))
    measured = with_peaks_at_least(spec, achieved_flops(ops))
    note = "peaks estimated from the ISA and clock (CPU) or the catalog (GPU)"
    if measured != spec:
        note += (f", raised to the best measured matmul/attention rate (fp32 estimate {spec.peak_flops_fp32:.4g} "
                 f"FLOP/s, measured {measured.peak_flops_fp32:.4g})")
    bandwidth = "measured" if device == "cpu" else "from the catalog (measured for a GPU outside it)"
    return measured, ops, f"{note}; memory bandwidth {bandwidth}"


def _check_arguments(device: str, threads: int | None) -> None:
    if device not in ("cpu", "cuda"):
        raise SpecError(f"device {device!r} is not accepted; expected 'cpu' or 'cuda'")
    if device == "cuda":
        require_cuda()
    if threads is not None and threads < 1:
        raise SpecError(f"threads {threads}: must be at least 1")
