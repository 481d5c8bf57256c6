"""nccl-tests logs (all_reduce_perf and friends) -> measured bandwidths, and their use on a `Cluster`.

A log has `#` comment lines (the run header names every rank's host and device), then one row
per message size: `size count type [redop root] | time algbw busbw #wrong` out of place, then
the same four in place (`N/A` where the test has no in-place variant). Units in the log are
B, us and GB/s (1e9 bytes/s); here seconds and bytes/s.

`peak_busbw_Bps` is the plateau NCCL reaches on large messages: the largest bus bandwidth
(either variant) among sizes within 8x of the largest size, so one slow last row does not
decide it and small-message latency never does.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tagplan.errors import SpecError
from tagplan.frontends.catalog import find_device
from tagplan.frontends.presets import replace_node
from tagplan.frontends.textfile import read_text
from tagplan.ir.cluster import Cluster, Node

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "reduce",
               "sendrecv", "gather", "scatter", "hypercube")  # longest match first where they overlap
PLATEAU_SPAN = 8  # sizes within this factor of the largest count towards the peak
_RANK = re.compile(r"^#\s*Rank\s+(\d+)(?:\s+Group\s+\d+)?\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+"
                   r"\[[^\]]*\]\s+(.*\S)")
_STARTING = re.compile(r"Collective test starting:\s*(\w+?)(?:_perf)?\b")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([\d.]+)")


@dataclass(frozen=True)
class Measurement:
    """One timing: seconds, algorithm and bus bandwidth in bytes/s."""

    time_s: float
    algbw_Bps: float
    busbw_Bps: float


@dataclass(frozen=True)
class NcclTestRow:
    """One message size: out-of-place and (where measured) in-place timings."""

    size_bytes: int
    count: int
    dtype: str
    out_of_place: Measurement
    in_place: Measurement | None


@dataclass(frozen=True)
class NcclTestResult:
    """A parsed nccl-tests run: collective, rank hosts (one entry per rank), device and rows; `source`
    names the log in error messages."""

    collective: str
    rank_hosts: tuple[str, ...]
    device_name: str
    rows: tuple[NcclTestRow, ...]
    avg_busbw_Bps: float | None = None
    source: str = "nccl-tests log"

    @property
    def ranks(self) -> int:
        """Number of ranks."""
        return len(self.rank_hosts)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Distinct hosts, in rank order."""
        return tuple(dict.fromkeys(self.rank_hosts))

    @property
    def peak_busbw_Bps(self) -> float:
        """Large-message plateau of the bus bandwidth, bytes/s (see the module docstring)."""
        largest = max(r.size_bytes for r in self.rows)
        return max(m.busbw_Bps for r in self.rows if r.size_bytes * PLATEAU_SPAN >= largest
                   for m in (r.out_of_place, r.in_place) if m is not None)


def _measurement(tokens: list[str], line: int) -> Measurement | None:
    """time (us), algbw, busbw (GB/s) -> a Measurement; None for `N/A`; SpecError naming the line."""
    if "N/A" in tokens[:3]:
        return None
    try:
        time_us, algbw, busbw = (float(t) for t in tokens[:3])
    except ValueError:
        raise SpecError(f"nccl-tests log: line {line}: {' '.join(tokens[:3])!r} is not accepted; expected "
                        "time (us), algbw and busbw (GB/s)") from None
    return Measurement(time_us / 1e6, algbw * 1e9, busbw * 1e9)


def _row(tokens: list[str], line: int) -> NcclTestRow:
    if len(tokens) < 11:
        raise SpecError(f"nccl-tests log: line {line}: {len(tokens)} columns; expected size count type "
                        "[redop root] then time algbw busbw #wrong twice")
    oop = _measurement(tokens[-8:-5], line)
    if oop is None:
        raise SpecError(f"nccl-tests log: line {line}: out-of-place columns are N/A")
    return NcclTestRow(int(tokens[0]), int(tokens[1]), tokens[2], oop, _measurement(tokens[-4:-1], line))


def _collective(text: str, source: str) -> str:
    if m := _STARTING.search(text):
        return m.group(1)
    stem = re.sub(r"[_\-. ]", "", Path(source).name.lower())  # all_reduce, all-reduce, allreduce alike
    by_length = sorted(COLLECTIVES, key=len, reverse=True)  # "allreduce" before "reduce"
    return next((c for c in by_length if c.replace("_", "") in stem), "unknown")


def parse_nccl_tests(text: str, *, source: str = "nccl-tests log") -> NcclTestResult:
    """The run in an nccl-tests log; the collective comes from the log or else from `source`'s name.

    SpecError names the line of a malformed row, or says what is missing.
    """
    hosts: dict[int, str] = {}
    devices: list[str] = []
    rows: list[NcclTestRow] = []
    avg: float | None = None
    for i, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if m := _RANK.match(line):
            hosts[int(m.group(1))] = m.group(2)
            devices.append(m.group(3))
        elif m := _AVG.match(line):
            avg = float(m.group(1)) * 1e9
        elif (tokens := line.split())[:2] and all(t.isdigit() for t in tokens[:2]):
            rows.append(_row(tokens, i))
    if not rows:
        raise SpecError(f"{source}: no data rows (size count type ... busbw) found")
    if not hosts:
        raise SpecError(f"{source}: no '#  Rank N ... on HOST device ...' header lines; cannot tell hosts")
    return NcclTestResult(_collective(text, source), tuple(hosts[r] for r in sorted(hosts)), devices[0],
                          tuple(rows), avg, source)


def load_nccl_tests(path: str | Path) -> NcclTestResult:
    """The run in the nccl-tests log at `path` (see `parse_nccl_tests`)."""
    return parse_nccl_tests(read_text(path), source=str(path))


def _catalog_name(name: str) -> str | None:
    """The device catalog's name for the GPU `name` spells (nvidia-smi names accepted); None if it knows none."""
    found = find_device(name)
    return found.name if found is not None else None


def _target_nodes(cluster: Cluster, result: NcclTestResult) -> list[int]:
    """Indices of the nodes with the device the test ran on, names compared through the device catalog.

    A log whose rank lines name a GPU the catalog does not know, or one given to a one-type cluster of a GPU the
    catalog does not know (a cluster file's own, e.g. a power-capped A100 with `base:`), applies to every node of
    that cluster (nothing to check it against); SpecError where no node has the log's GPU.
    """
    tested = _catalog_name(result.device_name)
    targets = [i for i, node in enumerate(cluster.nodes)
               if (_catalog_name(node.device.name) or node.device.name) == (tested or result.device_name)]
    custom = all(_catalog_name(node.device.name) is None for node in cluster.nodes)  # a cluster file's own GPU
    if not targets and (tested is None or custom) and len(cluster.device_types) == 1:
        targets = list(range(len(cluster.nodes)))
    if not targets:
        known = f" ({tested} in the device catalog)" if tested and tested != result.device_name else ""
        raise SpecError(f"{result.source}: nccl-tests ran on {result.device_name!r}{known}; the cluster's devices "
                        f"are {', '.join(cluster.device_types)}, none of them that one; give a log measured on "
                        "the cluster's GPUs, or leave this one out")
    return targets


def _measured(node: Node, result: NcclTestResult) -> Node:
    peak_Bps = result.peak_busbw_Bps
    if len(result.hosts) == 1:
        return replace_node(node, fabric_bandwidth_Bps=peak_Bps, pair_links=())
    ranks_per_host = max(Counter(result.rank_hosts).values())
    nics_used = max(1, min(node.nics, ranks_per_host))
    return replace_node(node, nic_bandwidth_Bps=peak_Bps / nics_used)


def apply_nccl_tests(cluster: Cluster, result: NcclTestResult) -> Cluster:
    """A copy of `cluster` whose nodes of the tested device carry the measured bandwidth.

    All ranks on one host: the node's fabric becomes uniform at the peak bus bandwidth and its
    pair links are dropped; a collective over the node measures what the pairs achieve together,
    and one number cannot say which pairs are slower.
    Ranks on several hosts: per-NIC bandwidth = peak busbw / min(nics, ranks per host). NCCL runs
    a ring per NIC, a ring's bus bandwidth is its bottleneck link's (here the NIC), so k parallel
    rings reach k x one NIC; a host's ranks use one NIC each, at most all of them. The network's
    oversubscription still applies on top. SpecError if no node has the tested device.
    """
    if result.ranks < 2:
        raise SpecError(f"nccl-tests run has {result.ranks} rank; a bandwidth needs at least 2")
    targets = set(_target_nodes(cluster, result))
    nodes = tuple(_measured(n, result) if i in targets else n for i, n in enumerate(cluster.nodes))
    return Cluster(name=cluster.name, nodes=nodes, network=cluster.network)
