"""NCCL topology XML (NCCL_TOPO_FILE / NCCL_TOPO_DUMP_FILE) -> one `Node`.

The tree is `<system>` > `<cpu>` > nested `<pci busid link_speed link_width>` > `<gpu dev sm>` >
`<nvlink target count tclass>` (RCCL: `<xgmi>`), with NICs as `<nic><net speed=Mb/s/></nic>`.
Bandwidths are NCCL's (one way, bytes/s):
- NVLink to an NVSwitch (tclass 0x068000): the GPU's links to all switches x the per-link rate; a
  pair of GPUs gets the smaller of their two figures (an NVSWITCH link).
- NVLink (or xGMI) straight to another GPU: count x the per-link rate.
- Otherwise the PCIe path: PCIE when the GPUs meet under a PCIe switch, PCIE_HOST under one CPU
  (5/6 of the host link), SMP across CPUs (10 GB/s at most). The host link is the GPU's own
  `link_speed` x `link_width` (x16 Gen3/4/5 = 12/24/48 GB/s; width 0 or missing counts as x16).
- NICs: every distinct `<net name>`, at their mean speed (Mb/s x 1e6 / 8 -> bytes/s); with none,
  one 10 Gb/s NIC. `nics` and `nic_speed_Gbps` override both.

GPU type: `gpu` if given, else from `sm` (AMD: `gcn`) via `SM_DEFAULTS`, the smaller-memory
part of each generation (a plan that fits it also fits the larger one), logged as a warning.
"""

from __future__ import annotations

import logging
import re
import xml.etree.ElementTree as ET
from typing import NamedTuple

from tagplan.errors import SpecError
from tagplan.frontends import catalog
from tagplan.frontends.nvidia_topo import LinkFigures, node_from_links
from tagplan.frontends.presets import gbps_to_Bps
from tagplan.ir.cluster import DeviceSpec, LinkKind, Node

log = logging.getLogger(__name__)

NVSWITCH_TCLASS = 0x068000
SM_DEFAULTS = {"70": "V100-SXM2-16GB", "75": "T4", "80": "A100-SXM-40GB", "86": "A10", "89": "L4",
               "90": "H100-SXM", "gfx90a": "MI250X", "gfx942": "MI300X"}
_GTS = re.compile(r"([\d.]+)\s*GT/s")


def _attr(el: ET.Element, key: str, base: int = 10) -> int:
    """Integer attribute `key` of `el`; SpecError naming the element, attribute and value."""
    value = el.get(key)
    try:
        return int(value or "", base)
    except ValueError:
        raise SpecError(f"NCCL topology XML: <{el.tag}> attribute {key}={value!r} is not accepted; "
                        "expected an integer") from None


def _pci_Bps(pci: ET.Element | None, default_Bps: float) -> float:
    """One-way bytes/s of a `<pci>` link: GT/s x lanes x 12/128 GB/s (Gen3 x16 = 12 GB/s, NCCL's)."""
    m = _GTS.search(pci.get("link_speed", "")) if pci is not None else None
    if pci is None or m is None:
        return default_Bps
    width = int(pci.get("link_width") or 0) or 16
    return float(m.group(1)) * width * 12e9 / 128


def _device(first: ET.Element, gpu: DeviceSpec | None) -> DeviceSpec:
    if gpu is not None:
        return gpu
    key = first.get("gcn") or first.get("sm", "")
    if key not in SM_DEFAULTS:
        raise SpecError(f"NCCL topology XML: no default GPU for sm/gcn {key!r} (known: {', '.join(SM_DEFAULTS)}); "
                        f"pass gpu (known: {', '.join(catalog.known_devices())})")
    log.warning("NCCL topology XML names no GPU type; assuming %s for %r", SM_DEFAULTS[key], key)
    return catalog.lookup_device(SM_DEFAULTS[key])


class _GpuTree(NamedTuple):
    """Per GPU (in `dev` order): ancestors of its <pci> device, nearest first; host link bytes/s;
    NVLinks to NVSwitches; and direct GPU-GPU links by (a, b) with a < b."""

    chains: list[list[ET.Element]]
    host_Bps: list[float]
    switch_links: list[int]
    direct: dict[tuple[int, int], tuple[LinkKind, int]]


def _gpu_tree(root: ET.Element, gpus: list[ET.Element], figures: catalog.DeviceLinks) -> _GpuTree:
    parent = {child: el for el in root.iter() for child in el}
    tree = _GpuTree([], [_pci_Bps(parent.get(g), figures.host_link_Bps) for g in gpus], [0] * len(gpus), {})
    for g in gpus:
        chain, el = [], parent.get(g)
        while el is not None:
            chain.append(el)
            el = parent.get(el)
        tree.chains.append(chain[1:] if chain and chain[0].tag == "pci" else chain)  # not the GPU's own <pci>
    index = {parent[g].get("busid", "").lower(): i for i, g in enumerate(gpus) if g in parent}
    for i, g in enumerate(gpus):
        for link in [*g.iter("nvlink"), *g.iter("xgmi")]:
            j = index.get(link.get("target", "").lower())
            if link.get("tclass") and _attr(link, "tclass", 16) == NVSWITCH_TCLASS:
                tree.switch_links[i] += _attr(link, "count")
            elif j is not None and j != i:
                kind = LinkKind.NVLINK if link.tag == "nvlink" else LinkKind.XGMI
                tree.direct[min(i, j), max(i, j)] = (kind, _attr(link, "count"))
    return tree


def _pair(a: int, b: int, tree: _GpuTree, links: catalog.DeviceLinks) -> LinkFigures:
    """(kind, bytes/s, latency s) between GPUs `a` < `b`."""
    if (a, b) in tree.direct:
        kind, count = tree.direct[a, b]
        rate = links.nvlink_rate_Bps if kind is LinkKind.NVLINK else links.xgmi_pair_Bps or links.nvlink_rate_Bps
        return kind, count * rate, catalog.NVLINK_LATENCY_S
    if tree.switch_links[a] and tree.switch_links[b]:
        switched_Bps = min(tree.switch_links[a], tree.switch_links[b]) * links.nvlink_rate_Bps
        return LinkKind.NVSWITCH, switched_Bps, catalog.NVLINK_LATENCY_S
    common = next(el for el in tree.chains[a] if any(el is other for other in tree.chains[b]))
    bw = min(tree.host_Bps[a], tree.host_Bps[b])
    if common.tag == "pci":
        return LinkKind.PCIE, bw, catalog.PCIE_LATENCY_S
    if common.tag == "cpu":
        return LinkKind.PCIE_HOST, bw * catalog.HOST_BRIDGE_FACTOR, catalog.PCIE_HOST_LATENCY_S
    return LinkKind.SMP, min(bw, catalog.SMP_BPS), catalog.SMP_LATENCY_S


def _nics(root: ET.Element) -> tuple[int, float | None]:
    """Distinct NICs (dumps repeat a socket NIC under each CPU) and their mean speed in bytes/s."""
    nets = {n.get("name") or str(i): n for i, n in enumerate(root.iter("net"))}
    speeds_Bps = [_attr(n, "speed") * 1e6 / 8 for n in nets.values()]
    mean = sum(speeds_Bps) / len(speeds_Bps) if speeds_Bps and min(speeds_Bps) > 0 else None
    return len(nets), mean


def _root(text: str) -> ET.Element:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        line, column = err.position
        problem = str(err).rsplit(": line", 1)[0]
        raise SpecError(f"NCCL topology XML: line {line}, column {column + 1}: malformed XML: {problem}") from None
    if root.tag != "system":
        raise SpecError(f"NCCL topology XML: root element is <{root.tag}>; expected <system version=...>")
    return root


def parse_nccl_xml(
    text: str,
    *,
    gpu: DeviceSpec | None = None,
    name: str = "node",
    nics: int | None = None,
    nic_speed_Gbps: float | None = None,
) -> Node:
    """The node an NCCL topology XML describes (GPUs in `dev` order; bandwidths one way, bytes/s)."""
    root = _root(text)
    gpus = sorted(root.iter("gpu"), key=lambda g: _attr(g, "dev"))
    if not gpus:
        raise SpecError("NCCL topology XML: no <gpu> element found")
    device = _device(gpus[0], gpu)
    figures = catalog.device_links(device)
    tree = _gpu_tree(root, gpus, figures)
    pairs = {(a, b): _pair(a, b, tree, figures) for a in range(len(gpus)) for b in range(a + 1, len(gpus))}
    count, mean_Bps = _nics(root)
    if nic_speed_Gbps is not None:
        nic_Bps = gbps_to_Bps(nic_speed_Gbps)
    else:
        nic_Bps = mean_Bps if mean_Bps is not None else gbps_to_Bps(10)
    return node_from_links(name, device, len(gpus), pairs, nics if nics is not None else max(count, 1), nic_Bps)
