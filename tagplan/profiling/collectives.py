"""Measure collectives among `world` local processes as `CollectiveRecord`s (nccl-tests conventions).

Ranks are processes started with `torch.multiprocessing.spawn`, meeting through a store file in the
job's own folder, over gloo on CPU and NCCL on CUDA (rank r on GPU r). Per message size each collective runs
after a barrier, `WARMUP` times untimed, then a fixed number of times (more for small messages:
`repeats_for`), each call timed alone between barriers. A call's time is the mean over the ranks
taking part (nccl-tests' default averaging); the record holds the median over calls.

Sizes and bus bandwidth follow nccl-tests (`bytes` is its "size" column): all_reduce, the buffer;
all_gather, the gathered output (each rank contributes bytes/ranks); reduce_scatter, the input
(each rank keeps bytes/ranks); all_to_all, each rank's send buffer; p2p, the message rank 0 sends
rank 1 (the other ranks idle; the record says ranks=2). bus bandwidth = algbw x factor with
algbw = bytes / time and factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter
and all_to_all, 1 for p2p. Sizes are rounded down to a multiple of 4 x ranks bytes (fp32
elements split evenly).

gloo supports all five on CPU in the torch versions we use (all_gather_into_tensor,
reduce_scatter_tensor and all_to_all_single included); a collective the backend refuses is
skipped with a warning rather than emulated, since a CollectiveRecord cannot say it was.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tagplan.datasets.traces.bundle import CollectiveRecord
from tagplan.errors import SpecError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

CollectiveName = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
COLLECTIVES: tuple[CollectiveName, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
WARMUP = 2
REPEAT_BYTES = 256 * 2**20  # repeats_for: about this many bytes moved per collective and size
_RESULTS_FILE = "results.json"


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw factor for `collective` among `ranks` ranks."""
    if collective == "all_reduce":
        return 2.0 * (ranks - 1) / ranks
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    return 1.0


def repeats_for(nbytes: int, *, min_repeats: int = 5, max_repeats: int = 30) -> int:
    """Timed calls per size: REPEAT_BYTES / nbytes, clamped to [min_repeats, max_repeats]."""
    return min(max(REPEAT_BYTES // max(nbytes, 1), min_repeats), max_repeats)


@dataclass(frozen=True, slots=True)
class _Job:
    """What every rank runs (picklable plain data)."""

    world: int
    device: Literal["cpu", "cuda"]
    sizes_bytes: tuple[int, ...]
    collectives: tuple[CollectiveName, ...]
    out_dir: str
    max_repeats: int

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def _call(collective: CollectiveName, count: int, rank: int, world: int, device: str) -> Callable[[], object]:
    """One call of `collective` over `count` fp32 elements (nccl-tests size / 4), buffers allocated once."""
    import torch
    import torch.distributed as dist

    def buf(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32, device=device)

    if collective == "all_reduce":
        data = buf(count)
        return lambda: dist.all_reduce(data)
    if collective == "all_gather":
        part, out = buf(count // world), buf(count)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, part)
    if collective == "reduce_scatter":
        full, part = buf(count), buf(count // world)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, full)
    if collective == "all_to_all":
        send, recv = buf(count), buf(count)
        return lambda: dist.all_to_all_single(recv, send)
    message = buf(count)
    if rank == 0:
        return lambda: dist.send(message, dst=1)
    if rank == 1:
        return lambda: dist.recv(message, src=0)
    return lambda: None


def _time_size(job: _Job, collective: CollectiveName, count: int, rank: int,
               stats: ProcessGroup | None) -> list[float] | None:
    """Per-call seconds averaged over the ranks taking part (on every rank); None if the backend refuses."""
    import torch
    import torch.distributed as dist

    device = f"cuda:{rank}" if job.device == "cuda" else "cpu"
    fn = _call(collective, count, rank, job.world, device)
    repeats = repeats_for(count * 4, max_repeats=job.max_repeats)
    times = torch.zeros(repeats, dtype=torch.float64)
    failed = torch.zeros(1)
    for i in range(-WARMUP, repeats):
        dist.barrier(group=stats)
        if failed.item():
            break
        if job.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            fn()
        except (RuntimeError, NotImplementedError):
            failed += 1
        if job.device == "cuda":
            torch.cuda.synchronize()
        if i >= 0:
            times[i] = time.perf_counter() - start
        dist.all_reduce(failed, group=stats)
    if failed.item():
        return None
    dist.all_reduce(times, group=stats)
    taking_part = 2 if collective == "p2p" else job.world
    return [float(t) / taking_part for t in times]


def _rank_main(rank: int, job: _Job) -> None:
    """One rank: join the group, time every collective and size, rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    if job.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.world))
    # the ranks meet through a store file in the job's own folder: a TCP port picked free can be another run's too
    dist.init_process_group(job.backend, init_method=(Path(job.out_dir) / "rendezvous").as_uri(), rank=rank,
                            world_size=job.world, timeout=timedelta(minutes=5))
    stats = dist.new_group(backend="gloo") if job.backend != "gloo" else None
    results = []
    for collective in job.collectives:
        for size in job.sizes_bytes:
            count = max(size // (4 * job.world), 1) * job.world
            times = _time_size(job, collective, count, rank, stats)
            if times is not None:
                results.append({"collective": collective, "bytes": count * 4, "time_s": statistics.median(times),
                                "repeats": len(times)})
    dist.barrier(group=stats)
    dist.destroy_process_group()
    if rank == 0:
        (Path(job.out_dir) / _RESULTS_FILE).write_text(json.dumps(results))


def _check_world(world: int, device: str) -> None:
    if world < 2:
        raise SpecError(f"world {world}: collectives need at least 2 ranks")
    if device == "cuda":
        import torch

        if world > torch.cuda.device_count():
            raise SpecError(f"world {world}: this host has {torch.cuda.device_count()} CUDA devices; NCCL needs "
                            "one GPU per rank")


def measure_collectives(sizes_bytes: Sequence[int], *, device_type: str, world: int = 2,
                        device: Literal["cpu", "cuda"] = "cpu", collectives: Sequence[CollectiveName] = COLLECTIVES,
                        max_repeats: int = 30, progress: Callable[[str], None] | None = None) -> list[CollectiveRecord]:
    """Time each of `collectives` at each size in bytes among `world` local ranks; one record per pair
    the backend supports, in collective-then-size order. Seconds and bytes/s as the module docstring says."""
    _check_world(world, device)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tagplan-collectives-") as tmp:
        job = _Job(world=world, device=device, sizes_bytes=tuple(sizes_bytes),
                   collectives=tuple(collectives), out_dir=tmp, max_repeats=max_repeats)
        if progress is not None:
            progress(f"collectives: {world} {job.backend} ranks, {len(collectives)} collectives x {len(sizes_bytes)} "
                     "sizes")
        mp.spawn(_rank_main, args=(job,), nprocs=world, join=True)
        results = json.loads((Path(tmp) / _RESULTS_FILE).read_text())
    records = []
    for r in results:
        ranks = 2 if r["collective"] == "p2p" else world
        bus = bus_factor(r["collective"], ranks) * r["bytes"] / r["time_s"]
        records.append(CollectiveRecord(collective=r["collective"], backend=job.backend, device=device_type,
                                        ranks=ranks, bytes=r["bytes"], time_s=r["time_s"], repeats=r["repeats"],
                                        bus_bandwidth_Bps=bus))
        if progress is not None:
            progress(f"{r['collective']} {r['bytes']} B x {ranks} ranks: {r['time_s'] * 1e6:.4g} us, "
                     f"busbw {bus / 1e9:.3g} GB/s")
    measured = {r["collective"] for r in results}
    skipped = [c for c in collectives if c not in measured]
    if skipped:
        log.warning("collectives the %s backend refused (skipped): %s", job.backend, skipped)
    return records
