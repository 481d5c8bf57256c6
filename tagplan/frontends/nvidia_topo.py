"""`nvidia-smi topo -m` output -> one `Node`, with a link for every GPU pair.

Cells map to links (one way, bytes/s; figures of the GPU generation, see `catalog`):
- `NV#`: NVLINK, # x the per-link rate (20 GB/s sm70/sm80, 20.6 GB/s sm90). When every pair shows
  the same `NV#` with # >= 12 (DGX A100 NV12, DGX H100 NV18), or every pair shows one and some GPU's
  counts add up to more links than it has (a switch with a degraded link: NV17 among NV18s), the node
  is an NVSwitch fabric at the slowest pair's rate. Point-to-point NVLinks (the DGX-1's hybrid cube
  mesh) stay pair links, whose rings the cost model searches (`cost.mesh_rings`).
- `PIX`/`PXB` (PCIe switches): PCIE at the GPU's host-link rate.
- `PHB`/`NODE` (through a host bridge): PCIE_HOST at 5/6 of it.
- `SYS` (old drivers: `SOC`; across sockets): SMP at 10 GB/s (at most the host link).
If all pairs are alike the node carries only its fabric; otherwise every pair gets a `PairLink`
and the fabric is the slowest pair.

The matrix does not name the GPU: pass `gpu`. Without it the type is inferred where the NVLink
pattern is unambiguous (all NV18 -> H100-SXM, all NV12 -> A100-SXM-40GB, NV1/NV2 -> V100-SXM2-16GB,
the smaller-memory parts, logged as a warning); otherwise SpecError asks for it.

NICs (`NIC0` columns, or `mlx5_0` on older drivers): only compute NICs count, told apart from
storage and management NICs by the GPU affinity NCCL uses: a NIC is a compute NIC when it is the
closest NIC of some GPU (ties all count) and that path is `PIX` or `PXB` (a PCIe switch shared
with the GPU). A DGX A100 shows 10 NICs; its two storage NICs sit behind the host bridge, so 8
count. Without any `PIX`/`PXB` NIC, each GPU's closest NICs count. `nics` overrides the count.
Compute NICs run at `nic_speed_Gbps` (default 100, as topo -m shows RDMA NICs only); with no NIC
column, one 10 Gb/s host Ethernet NIC is assumed.
"""

from __future__ import annotations

import logging
import re

from tagplan.errors import SpecError
from tagplan.frontends import catalog
from tagplan.frontends.presets import gbps_to_Bps
from tagplan.ir.cluster import DeviceSpec, LinkKind, Node, PairLink

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU = re.compile(r"GPU\d+$")
_NV = re.compile(r"NV(\d+)$")
_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
_CLOSENESS = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4, "SOC": 4}  # GPU-NIC paths, closest first
_SWITCHED = 1  # PIX or PXB: the NIC shares a PCIe switch with the GPU
_AFFINITY_WORDS = ("CPU", "NUMA", "GPU")  # first words of the trailing affinity columns
Cell = tuple[str, int]  # (cell text, 1-based line number)


def _header(lines: list[str]) -> tuple[int, list[str]]:
    """Index of the header line and its device column names (GPUs, then NICs)."""
    for i, line in enumerate(lines):
        tokens = line.split()
        if tokens and tokens[0] == "GPU0" and (len(tokens) == 1 or tokens[1] != "X"):
            columns: list[str] = []
            for token in tokens:
                if token in _AFFINITY_WORDS:
                    break
                columns.append(token)
            return i, columns
    raise SpecError("nvidia-smi topo -m: no header line starting with GPU0 found")


def _gpu_rows(lines: list[str], start: int, columns: list[str], gpus: int) -> list[list[Cell]]:
    """The cells of each GPU row (GPU columns, then NIC columns), with their line numbers."""
    rows: list[list[Cell]] = []
    for i in range(start, len(lines)):
        tokens = lines[i].split()
        if not tokens or not _GPU.match(tokens[0]):
            if tokens and tokens[0].rstrip(":") in ("Legend", "NIC"):
                break
            continue
        if len(tokens) < 1 + len(columns):
            raise SpecError(f"nvidia-smi topo -m: line {i + 1}: row {tokens[0]} has {len(tokens) - 1} "
                            f"cells; expected {len(columns)} ({' '.join(columns)})")
        rows.append([(cell, i + 1) for cell in tokens[1 : 1 + len(columns)]])
    if len(rows) != gpus:
        raise SpecError(f"nvidia-smi topo -m: found {len(rows)} GPU rows for {gpus} GPU columns")
    return rows


def _check(rows: list[list[Cell]]) -> None:
    """SpecError naming the line of the first cell that is not a known link or breaks symmetry."""
    for a, row in enumerate(rows):
        for b, (cell, line) in enumerate(row[: len(rows)]):
            ok = cell == "X" if a == b else (cell in _PATHS or _NV.match(cell) is not None)
            if not ok:
                raise SpecError(f"nvidia-smi topo -m: line {line}: GPU{a}-GPU{b} cell {cell!r} is not "
                                f"accepted; expected {'X' if a == b else 'NV#, ' + ', '.join(_PATHS)}")
            if cell != rows[b][a][0]:
                raise SpecError(f"nvidia-smi topo -m: line {line}: GPU{a}-GPU{b} is {cell!r} but "
                                f"GPU{b}-GPU{a} is {rows[b][a][0]!r}")


def _infer_device(cells: list[str]) -> DeviceSpec:
    """The GPU type implied by the NVLink pattern; SpecError when it does not pin one down."""
    counts = {int(m.group(1)) for c in cells if (m := _NV.match(c))}
    all_nv = len(counts) > 0 and all(_NV.match(c) for c in cells)
    name = None
    if all_nv and counts in ({18}, {12}):
        name = "H100-SXM" if counts == {18} else "A100-SXM-40GB"
    elif counts and max(counts) <= 2:
        name = "V100-SXM2-16GB"
    if name is None:
        raise SpecError("nvidia-smi topo -m does not name the GPU type and the links do not imply one; "
                        f"pass gpu (known: {', '.join(catalog.known_devices())})")
    log.warning("nvidia-smi topo -m names no GPU type; assuming %s from the NVLink pattern", name)
    return catalog.lookup_device(name)


def _link(cell: str, links: catalog.DeviceLinks) -> tuple[LinkKind, float, float]:
    """(kind, one-way bytes/s, latency s) of one matrix cell."""
    if m := _NV.match(cell):
        return LinkKind.NVLINK, int(m.group(1)) * links.nvlink_rate_Bps, catalog.NVLINK_LATENCY_S
    if cell in ("PIX", "PXB"):
        return LinkKind.PCIE, links.host_link_Bps, catalog.PCIE_LATENCY_S
    if cell in ("PHB", "NODE"):
        return LinkKind.PCIE_HOST, links.host_link_Bps * catalog.HOST_BRIDGE_FACTOR, catalog.PCIE_HOST_LATENCY_S
    return LinkKind.SMP, min(catalog.SMP_BPS, links.host_link_Bps), catalog.SMP_LATENCY_S


LinkFigures = tuple[LinkKind, float, float]  # (kind, one-way bytes/s, latency s)


def _switched(cells: dict[tuple[int, int], str], gpus: int, nvlinks: int) -> bool:
    """Whether the GPUs meet on an NVSwitch: every pair shows `NV#`, and either all alike with # >= 12 or
    some GPU's counts over its peers add up to more NVLinks than the GPU has (`nvlinks`, the catalog's):
    point-to-point NVLinks split a GPU's links among its peers, a switch shows each peer them all, so a
    pair that lost a link (NV17 among NV18s) still reads as the switch it is."""
    counts = {pair: int(m.group(1)) for pair, c in cells.items() if (m := _NV.match(c))}
    if not counts or len(counts) < len(cells):
        return False
    if len(set(counts.values())) == 1 and min(counts.values()) >= 12:
        return True
    per_gpu = [sum(n for pair, n in counts.items() if g in pair) for g in range(gpus)]
    return nvlinks > 0 and max(per_gpu) > nvlinks


def node_from_links(
    name: str, device: DeviceSpec, gpus: int, links: dict[tuple[int, int], LinkFigures], nics: int, nic_Bps: float
) -> Node:
    """A node whose GPU pairs have `links`: fabric only if all pairs are alike, else a PairLink each.

    With pair links, the fabric figures are the slowest pair's (ties: the higher latency). A single
    GPU gets its host link.
    """
    fallback = (LinkKind.PCIE, catalog.device_links(device).host_link_Bps, catalog.PCIE_LATENCY_S)
    fabric, bw_Bps, latency_s = min(links.values(), key=lambda k: (k[1], -k[2]), default=fallback)
    pair_links: tuple[PairLink, ...] = ()
    if len(set(links.values())) > 1:
        pair_links = tuple(PairLink(a=a, b=b, kind=k, bandwidth_Bps=bw, latency_s=lat)
                           for (a, b), (k, bw, lat) in sorted(links.items()))
    return Node(name=name, device=device, gpus=gpus, fabric=fabric, fabric_bandwidth_Bps=bw_Bps,
                fabric_latency_s=latency_s, pair_links=pair_links, nics=nics, nic_bandwidth_Bps=nic_Bps)


def parse_nvidia_topo(
    text: str,
    *,
    gpu: DeviceSpec | None = None,
    name: str = "node",
    nics: int | None = None,
    nic_speed_Gbps: float | None = None,
) -> Node:
    """The node an `nvidia-smi topo -m` matrix describes (bandwidths one way in bytes/s).

    SpecError names the line of a malformed row or cell.
    """
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    head, columns = _header(lines)
    gpus = sum(1 for c in columns if _GPU.match(c))
    rows = _gpu_rows(lines, head + 1, columns, gpus)
    _check(rows)
    cells = {(a, b): rows[a][b][0] for a in range(gpus) for b in range(a + 1, gpus)}
    device = gpu if gpu is not None else _infer_device(list(cells.values()))
    figures = catalog.device_links(device)
    links = {pair: _link(cell, figures) for pair, cell in cells.items()}
    if _switched(cells, gpus, figures.nvlinks):
        slowest = min(links.values(), key=lambda k: k[1])
        links = {pair: (LinkKind.NVSWITCH, slowest[1], slowest[2]) for pair in links}
    nic_columns = columns[gpus:]
    compute = compute_nics(nic_columns, [[cell for cell, _ in row[gpus:]] for row in rows])
    if nic_columns and len(compute) < len(nic_columns):
        log.info("nvidia-smi topo -m: %d of %d NICs are compute NICs (%s); the others serve storage or "
                 "management", len(compute), len(nic_columns), ", ".join(compute))
    speed_Gbps = nic_speed_Gbps if nic_speed_Gbps is not None else (100.0 if nic_columns else 10.0)
    return node_from_links(name, device, gpus, links, nics if nics is not None else max(len(compute), 1),
                           gbps_to_Bps(speed_Gbps))


def compute_nics(names: list[str], gpu_cells: list[list[str]]) -> list[str]:
    """The NICs some GPU would use (module docstring), in column order.

    `gpu_cells[g][n]` is the path from GPU g to NIC `names[n]`; SpecError for an unknown path.
    """
    closest: set[int] = set()
    for g, cells in enumerate(gpu_cells):
        ranks = []
        for n, cell in enumerate(cells):
            if cell not in _CLOSENESS:
                raise SpecError(f"nvidia-smi topo -m: GPU{g}-{names[n]} cell {cell!r} is not accepted; "
                                f"expected one of {', '.join(_PATHS)}")
            ranks.append(_CLOSENESS[cell])
        if ranks:
            closest.update(n for n, r in enumerate(ranks) if r == min(ranks))
    switched = {n for n in closest if any(_CLOSENESS[cells[n]] <= _SWITCHED for cells in gpu_cells)}
    return [names[n] for n in sorted(switched or closest)]
