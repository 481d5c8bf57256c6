"""Named machines: one `Node` each, plus the `Network` its usual deployment implies.

Figures come from reference/hardware.md. Network latency defaults by class, because the NIC
alone does not say how the fabric behaves:
- InfiniBand/RoCE (RDMA, DGX presets): 5 us.
- AWS EFA (SRD through the Nitro card; kernel bypass, but slower than IB): 15 us.
- Plain Ethernet through the kernel TCP stack (NCCL's socket transport: p3, g4dn, the RTX 4090
  box): 30 us.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tagplan.errors import unknown
from tagplan.frontends.catalog import (
    HOST_BRIDGE_FACTOR,
    NVLINK_LATENCY_S,
    NVLINK_SM80_BPS,
    NVLINK_SM90_BPS,
    NVLINK_SM100_BPS,
    PCIE_GEN4_BPS,
    PCIE_HOST_LATENCY_S,
    SMP_BPS,
    SMP_LATENCY_S,
    lookup_device,
)
from tagplan.ir.cluster import DeviceSpec, LinkKind, Network, Node, PairLink

IB_LATENCY_S = 5e-6
EFA_LATENCY_S = 15e-6
TCP_LATENCY_S = 30e-6

# DGX-1V hybrid cube mesh (as `nvidia-smi topo -m` prints it): NVLinks per GPU pair. Each V100 has
# 6 links; GPUs 0-3 and 4-7 sit on different sockets, and unlisted pairs cross them (SYS).
DGX1V_NVLINKS: dict[tuple[int, int], int] = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
    (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}


@dataclass(frozen=True)
class Preset:
    """A named machine: its node and the network it is usually deployed on."""

    name: str
    node: Node
    network: Network


def latency_for_nic(nic_bandwidth_Bps: float) -> float:
    """Default network latency (s) for a NIC of this speed: >= 100 Gb/s is taken as RDMA (IB/RoCE)."""
    return IB_LATENCY_S if nic_bandwidth_Bps >= gbps_to_Bps(100) else TCP_LATENCY_S


def gbps_to_Bps(gbps: float) -> float:
    """Bytes/s of a link rated `gbps` gigabits/s."""
    return gbps * 1e9 / 8


def replace_node(node: Node, **changes: object) -> Node:
    """A validated copy of `node` with `changes` applied (rebuilt, so no cached lookups go stale)."""
    return Node.model_validate({**node.model_dump(), **changes})


def nvlink_pairs(links: dict[tuple[int, int], int], rate_Bps: float) -> tuple[PairLink, ...]:
    """Pair links for a map of (GPU a, GPU b) -> NVLink count, at `rate_Bps` per link."""
    return tuple(
        PairLink(a=a, b=b, kind=LinkKind.NVLINK, bandwidth_Bps=n * rate_Bps, latency_s=NVLINK_LATENCY_S)
        for (a, b), n in sorted(links.items())
    )


def _nvswitch(name: str, gpu: str, bw_Bps: float, nics: int, nic_gbps: float, gpus: int = 8) -> Node:
    return Node(
        name=name, device=lookup_device(gpu), gpus=gpus, fabric=LinkKind.NVSWITCH,
        fabric_bandwidth_Bps=bw_Bps, fabric_latency_s=NVLINK_LATENCY_S, nics=nics,
        nic_bandwidth_Bps=gbps_to_Bps(nic_gbps),
    )


def dgx_a100_40gb() -> Node:
    """DGX A100 40GB: NVSwitch, 12 NVLinks x 20 GB/s per GPU, 8 x 200 Gb/s HDR compute NICs."""
    return _nvswitch("dgx-a100-40gb", "A100-SXM-40GB", 12 * NVLINK_SM80_BPS, 8, 200)


def dgx_a100_80gb() -> Node:
    """DGX A100 80GB: as `dgx_a100_40gb` with 80 GB parts."""
    return _nvswitch("dgx-a100-80gb", "A100-SXM-80GB", 12 * NVLINK_SM80_BPS, 8, 200)


def dgx_h100() -> Node:
    """DGX H100: NVSwitch, 18 NVLinks x 20.6 GB/s per GPU, 8 x 400 Gb/s NDR compute NICs."""
    return _nvswitch("dgx-h100", "H100-SXM", 18 * NVLINK_SM90_BPS, 8, 400)


def dgx_h200() -> Node:
    """DGX H200: as `dgx_h100` with 141 GB H200 parts."""
    return _nvswitch("dgx-h200", "H200-SXM", 18 * NVLINK_SM90_BPS, 8, 400)


def dgx_b200() -> Node:
    """DGX B200: NVSwitch, 18 NVLink-5 links x 50 GB/s per GPU (datasheet), 8 x 400 Gb/s compute NICs."""
    return _nvswitch("dgx-b200", "B200", 18 * NVLINK_SM100_BPS, 8, 400)


def gb200_nvl72() -> Node:
    """GB200 NVL72: 72 Blackwell GPUs in one NVLink-5 switch domain (18 links x 50 GB/s per GPU),
    modelled as one node; 72 x 400 Gb/s compute NICs to leave the rack."""
    return _nvswitch("gb200-nvl72", "GB200", 18 * NVLINK_SM100_BPS, 72, 400, gpus=72)


def dgx_b300() -> Node:
    """DGX B300: as `dgx_b200` with Blackwell Ultra parts and 8 x 800 Gb/s ConnectX-8 compute NICs."""
    return _nvswitch("dgx-b300", "B300", 18 * NVLINK_SM100_BPS, 8, 800)


def gb300_nvl72() -> Node:
    """GB300 NVL72: as `gb200_nvl72` with Blackwell Ultra GPUs and 72 x 800 Gb/s ConnectX-8 NICs."""
    return _nvswitch("gb300-nvl72", "GB300", 18 * NVLINK_SM100_BPS, 72, 800, gpus=72)


def p4d_24xlarge() -> Node:
    """AWS p4d.24xlarge: 8 x A100 40GB on NVSwitch; 400 Gb/s EFA modelled as 4 NICs x 100 Gb/s."""
    return _nvswitch("p4d.24xlarge", "A100-SXM-40GB", 12 * NVLINK_SM80_BPS, 4, 100)


def p3_8xlarge() -> Node:
    """AWS p3.8xlarge: 4 x V100 16GB, one quad of the DGX-1V mesh; 10 Gb/s Ethernet.

    Every pair is NVLinked, by one link (20 GB/s) or two (40 GB/s), as the quad of GPUs 0-3 in
    the DGX-1V mesh; the fabric figure is the one-link rate, the pairs carry the exact counts.
    """
    quad = {pair: n for pair, n in DGX1V_NVLINKS.items() if max(pair) < 4}
    return Node(
        name="p3.8xlarge", device=lookup_device("V100-SXM2-16GB"), gpus=4, fabric=LinkKind.NVLINK,
        fabric_bandwidth_Bps=NVLINK_SM80_BPS, fabric_latency_s=NVLINK_LATENCY_S,
        pair_links=nvlink_pairs(quad, NVLINK_SM80_BPS), nics=1, nic_bandwidth_Bps=gbps_to_Bps(10),
    )


def p3_16xlarge() -> Node:
    """AWS p3.16xlarge: 8 x V100 16GB in the DGX-1V hybrid cube mesh; 25 Gb/s Ethernet.

    NVLinked pairs carry 1 or 2 links x 20 GB/s; the other pairs cross the CPU sockets (SMP).
    """
    return Node(
        name="p3.16xlarge", device=lookup_device("V100-SXM2-16GB"), gpus=8, fabric=LinkKind.SMP,
        fabric_bandwidth_Bps=SMP_BPS, fabric_latency_s=SMP_LATENCY_S,
        pair_links=nvlink_pairs(DGX1V_NVLINKS, NVLINK_SM80_BPS), nics=1, nic_bandwidth_Bps=gbps_to_Bps(25),
    )


G4DN_GPU_TO_GPU_BPS = gbps_to_Bps(50)
"""What one g4dn.12xlarge T4 reaches another at: 50 Gb/s, as AMP (Li et al., NeurIPS 2022, section 5)
describes the instances it measured on, half the PCIe Gen3 x16 rate: the VM gives the GPUs no
peer-to-peer path, so NCCL stages their traffic through host memory."""


def g4dn_12xlarge() -> Node:
    """AWS g4dn.12xlarge: 4 x T4 on PCIe Gen3 x16, staged through host memory (50 Gb/s); 50 Gb/s Ethernet."""
    return Node(
        name="g4dn.12xlarge", device=lookup_device("T4"), gpus=4, fabric=LinkKind.PCIE_HOST,
        fabric_bandwidth_Bps=G4DN_GPU_TO_GPU_BPS, fabric_latency_s=PCIE_HOST_LATENCY_S, nics=1,
        nic_bandwidth_Bps=gbps_to_Bps(50),
    )


def rtx4090x4() -> Node:
    """A workstation with 4 x RTX 4090 on PCIe Gen4 x16 (24 GB/s) and one 25 Gb/s NIC (assumed).

    GeForce 40-series cards have peer-to-peer disabled, so GPU-to-GPU traffic is staged through
    host memory (NCCL's SHM transport): modelled as PCIE_HOST, i.e. 5/6 of the host link
    (20 GB/s) with the host-bridge latency.
    """
    return Node(
        name="rtx4090x4", device=lookup_device("RTX4090"), gpus=4, fabric=LinkKind.PCIE_HOST,
        fabric_bandwidth_Bps=PCIE_GEN4_BPS * HOST_BRIDGE_FACTOR, fabric_latency_s=PCIE_HOST_LATENCY_S, nics=1,
        nic_bandwidth_Bps=gbps_to_Bps(25),
    )


_PRESETS: dict[str, tuple[Callable[[], Node], float]] = {
    "dgx-a100-40gb": (dgx_a100_40gb, IB_LATENCY_S),
    "dgx-a100-80gb": (dgx_a100_80gb, IB_LATENCY_S),
    "dgx-h100": (dgx_h100, IB_LATENCY_S),
    "dgx-h200": (dgx_h200, IB_LATENCY_S),
    "dgx-b200": (dgx_b200, IB_LATENCY_S),
    "gb200-nvl72": (gb200_nvl72, IB_LATENCY_S),
    "dgx-b300": (dgx_b300, IB_LATENCY_S),
    "gb300-nvl72": (gb300_nvl72, IB_LATENCY_S),
    "p4d.24xlarge": (p4d_24xlarge, EFA_LATENCY_S),
    "p3.8xlarge": (p3_8xlarge, TCP_LATENCY_S),
    "p3.16xlarge": (p3_16xlarge, TCP_LATENCY_S),
    "g4dn.12xlarge": (g4dn_12xlarge, TCP_LATENCY_S),
    "rtx4090x4": (rtx4090x4, TCP_LATENCY_S),
}


def preset_names() -> tuple[str, ...]:
    """Names of the shipped presets."""
    return tuple(_PRESETS)


def preset(name: str) -> Preset:
    """The preset called `name` (case-insensitive); SpecError suggests the nearest names."""
    entry = _PRESETS.get(name.strip().lower())
    if entry is None:
        raise unknown("cluster preset", name, preset_names())
    build, latency_s = entry
    node = build()
    return Preset(node.name, node, Network(latency_s=latency_s))


def with_overrides(
    node: Node,
    *,
    name: str | None = None,
    gpu: DeviceSpec | None = None,
    nics: int | None = None,
    nic_speed_Gbps: float | None = None,
) -> Node:
    """`node` with some fields replaced; `gpu` swaps the device figures only, links stay as they are."""
    changes: dict[str, object] = {}
    if name is not None:
        changes["name"] = name
    if gpu is not None:
        changes["device"] = gpu
    if nics is not None:
        changes["nics"] = nics
    if nic_speed_Gbps is not None:
        changes["nic_bandwidth_Bps"] = gbps_to_Bps(nic_speed_Gbps)
    return replace_node(node, **changes) if changes else node
