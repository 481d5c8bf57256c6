"""nccl-tests logs (all_reduce_perf and friends) -> `CollectiveRecord`s, one per message size.

Parsing is `tagplan.frontends.nccl_tests`'s; this module only maps its rows to records: the
out-of-place time and bus bandwidth of each size row, the collective named as `CollectiveRecord`
names it, ranks and nodes from the log's `# Rank N ... on HOST` header unless given, and
`repeats` from the header's `iters: N` (nccl-tests reports the mean over those iterations).
Rows of 0 bytes (`-b 0`) measure no transfer and are left out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from tagplan.errors import SpecError
from tagplan.frontends.nccl_tests import NcclTestResult, NcclTestRow, parse_nccl_tests
from tagplan.frontends.textfile import read_text

from .bundle import CollectiveRecord

CollectiveName = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "broadcast"]
COLLECTIVE_NAMES: dict[str, CollectiveName] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "sendrecv": "p2p",
    "broadcast": "broadcast",
}
_ITERS = re.compile(r"(?<!warmup )(?<!agg )\biters:\s*(\d+)")


def import_nccl_tests(path: str | os.PathLike[str], *, device: str, ranks: int | None = None,
                      nodes: int | None = None) -> list[CollectiveRecord]:
    """One record per size row of the nccl-tests log at `path`: bytes, seconds, bus bytes/s.

    `ranks` and `nodes` override the counts read from the log header. SpecError naming the file
    for a log that cannot be parsed, a collective outside `COLLECTIVE_NAMES`, or fewer than 2 ranks.
    """
    text = read_text(Path(path))
    try:
        result = parse_nccl_tests(text, source=str(path))
    except SpecError as err:
        message = str(err)
        raise SpecError(message if str(path) in message else f"{path}: {message}") from None
    collective = _collective(result, path)
    ranks = result.ranks if ranks is None else ranks
    nodes = len(result.hosts) if nodes is None else nodes
    if ranks < 2 or nodes < 1:
        raise SpecError(f"{path}: ranks {ranks}, nodes {nodes}; a collective record needs ranks >= 2 and "
                        "nodes >= 1 (pass ranks=/nodes= when the log header does not list every rank)")
    iters = _ITERS.search(text)
    repeats = int(iters.group(1)) if iters and int(iters.group(1)) > 0 else 1
    return [_record(row, collective, device, ranks, nodes, repeats, path) for row in result.rows if row.size_bytes > 0]


def _collective(result: NcclTestResult, path: str | os.PathLike[str]) -> CollectiveName:
    """The CollectiveRecord name of the log's collective; SpecError for one with no such name."""
    name = COLLECTIVE_NAMES.get(result.collective)
    if name is None:
        accepted = ", ".join(f"{k} ({v})" for k, v in COLLECTIVE_NAMES.items())
        binaries = ", ".join(f"{k}_perf.log" for k in COLLECTIVE_NAMES)
        found = (f"collective {result.collective!r} (from the '# Collective test starting' line or the file name "
                 f"{Path(path).name!r}) is not accepted; accepted: {accepted}")
        if result.collective == "unknown":
            found = (f"cannot tell which collective this log measured: it has no '# Collective test starting: "
                     f"NAME_perf' line and its file name {Path(path).name!r} names none")
        raise SpecError(f"{path}: {found}; rename the file after the nccl-tests binary that wrote it ({binaries}), "
                        "or add the line '# Collective test starting: all_reduce_perf' (that binary's name) to it")
    return name


def _record(row: NcclTestRow, collective: CollectiveName, device: str, ranks: int, nodes: int, repeats: int,
            path: str | os.PathLike[str]) -> CollectiveRecord:
    m = row.out_of_place
    if m.time_s <= 0:
        raise SpecError(f"{path}: the {row.size_bytes} B row has out-of-place time {m.time_s * 1e6:g} us; "
                        "a record needs a time > 0")
    return CollectiveRecord(collective=collective, backend="nccl", device=device, ranks=ranks,
                            nodes=nodes, bytes=float(row.size_bytes), time_s=m.time_s, repeats=repeats,
                            bus_bandwidth_Bps=m.busbw_Bps if m.busbw_Bps > 0 else None)
