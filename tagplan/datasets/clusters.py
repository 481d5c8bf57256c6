"""Random clusters for datasets: 1-8 nodes (sometimes 16) of one or two GPU types from the catalog.

Each node's intra-node fabric follows its GPU's form factor, with the catalog's link figures
(`device_links`): SXM A100/H100/H200 boards sit on NVSwitch; V100-SXM2 nodes are the DGX-1V
hybrid cube mesh (8 GPUs) or one quad of it (4 GPUs); PCIe cards talk over the host's PCIe
switches (GeForce cards through host memory), with cross-socket pairs at the inter-socket rate
in 8-card servers and optional NVLink bridges on the data-centre PCIe parts; AMD parts use a full
xGMI mesh. All nodes of one GPU type in a cluster are alike (GPUs, NICs, NIC speed), as a real
cluster's partitions are.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tagplan.frontends.catalog import (
    HOST_BRIDGE_FACTOR,
    NVLINK_LATENCY_S,
    PCIE_HOST_LATENCY_S,
    PCIE_LATENCY_S,
    SMP_BPS,
    SMP_LATENCY_S,
    device_links,
    lookup_device,
)
from tagplan.frontends.presets import DGX1V_NVLINKS, gbps_to_Bps, nvlink_pairs
from tagplan.ir.cluster import Cluster, DeviceSpec, LinkKind, Network, Node, PairLink

TRAIN_GPU_TYPES: tuple[str, ...] = (
    "V100-SXM2-16GB", "V100-SXM2-32GB", "V100-PCIe-32GB", "A100-SXM-40GB", "A100-SXM-80GB", "A100-PCIe-80GB",
    "H100-SXM", "H100-PCIe", "L40S", "T4", "A10", "RTX4090", "MI250X",
)
"""Catalog GPU types training data is drawn from."""
HELD_OUT_GPU_TYPES: tuple[str, ...] = ("H200-SXM", "L4", "MI300X")
"""Catalog GPU types never drawn with the default types: evaluation on unseen hardware."""

NIC_SPEEDS_GBPS: tuple[int, ...] = (10, 25, 100, 200, 400)
GPU_COUNTS: tuple[int, ...] = (1, 2, 4, 8)
_GEFORCE = ("RTX4090",)  # peer-to-peer disabled: GPU-to-GPU traffic is staged through host memory


@dataclass(frozen=True)
class NodeKind:
    """The node every node of one GPU type in a cluster is: GPU count and NICs."""

    device: DeviceSpec
    gpus: int
    nics: int
    nic_gbps: int
    bridges: bool  # NVLink bridges on GPU pairs (data-centre PCIe parts only)


def random_cluster(rng: random.Random, *, gpu_types: Sequence[str]) -> Cluster:
    """A cluster drawn with `rng` from `gpu_types` (catalog names; at most two types per cluster).

    1-8 nodes (16 with probability 0.1); two GPU types with probability 0.4 when there are two or
    more nodes and types; per type, GPUs per node in {1, 2, 4, 8} (mostly 8 for NVSwitch boards),
    1-8 NICs of 10-400 Gb/s; network latency 5-30 us and oversubscription 1-2.
    """
    if not gpu_types:
        raise ValueError("random_cluster: gpu_types is empty; give catalog GPU names such as 'A100-SXM-80GB'")
    nodes = 16 if rng.random() < 0.1 else rng.randint(1, 8)
    mixed = nodes >= 2 and len(set(gpu_types)) >= 2 and rng.random() < 0.4
    types = rng.sample(sorted(set(gpu_types)), 2 if mixed else 1)
    kinds = [_random_kind(rng, lookup_device(t)) for t in types]
    order = [kinds[0]] * nodes
    if mixed:
        second = rng.randint(1, nodes - 1)
        order = [kinds[0]] * (nodes - second) + [kinds[1]] * second
        if rng.random() < 0.5:  # interleave the two types instead of keeping them contiguous
            rng.shuffle(order)
    built = tuple(_node(f"node{i:02d}-{_slug(kind.device.name)}", kind) for i, kind in enumerate(order))
    network = Network(latency_s=round(rng.uniform(5.0, 30.0) * 1e-6, 7),
                      oversubscription=round(rng.uniform(1.0, 2.0), 2))
    label = "+".join(f"{sum(k is kind for k in order)}x{kind.gpus}x{_slug(kind.device.name)}" for kind in kinds)
    return Cluster(name=f"random-{label}", nodes=built, network=network)


def _slug(name: str) -> str:
    return name.lower().replace("_", "-")


def _random_kind(rng: random.Random, device: DeviceSpec) -> NodeKind:
    links = device_links(device)
    weights = (1, 1, 2, 6) if links.default_fabric is LinkKind.NVSWITCH else (1, 2, 3, 3)
    gpus = rng.choices(GPU_COUNTS, weights=weights)[0]
    nics = rng.choice([n for n in range(1, 9) if n <= max(gpus, 1)])
    bridges = links.default_fabric is LinkKind.PCIE and links.nvlinks > 0 and rng.random() < 0.5
    return NodeKind(device, gpus, nics, rng.choice(NIC_SPEEDS_GBPS), bridges)


def _node(name: str, kind: NodeKind) -> Node:
    """A node of `kind` with the fabric its GPU type implies (see the module docstring)."""
    fabric, bandwidth, latency, pairs = _fabric(kind)
    return Node(name=name, device=kind.device, gpus=kind.gpus, fabric=fabric, fabric_bandwidth_Bps=bandwidth,
                fabric_latency_s=latency, pair_links=pairs, nics=kind.nics,
                nic_bandwidth_Bps=gbps_to_Bps(kind.nic_gbps))


def _fabric(kind: NodeKind) -> tuple[LinkKind, float, float, tuple[PairLink, ...]]:
    """(fabric, bandwidth per pair, latency, pair overrides) of a node of `kind`."""
    links, gpus = device_links(kind.device), kind.gpus
    if links.default_fabric is LinkKind.NVSWITCH:
        return LinkKind.NVSWITCH, links.nvlinks * links.nvlink_rate_Bps, NVLINK_LATENCY_S, ()
    if links.default_fabric is LinkKind.XGMI:
        return LinkKind.XGMI, links.xgmi_pair_Bps, NVLINK_LATENCY_S, ()
    if links.default_fabric is LinkKind.NVLINK:  # V100-SXM2: the DGX-1V mesh or a part of it
        if gpus == 8:
            return LinkKind.SMP, SMP_BPS, SMP_LATENCY_S, nvlink_pairs(DGX1V_NVLINKS, links.nvlink_rate_Bps)
        quad = {pair: n for pair, n in DGX1V_NVLINKS.items() if max(pair) < gpus}
        return LinkKind.NVLINK, links.nvlink_rate_Bps, NVLINK_LATENCY_S, nvlink_pairs(quad, links.nvlink_rate_Bps)
    if kind.device.name in _GEFORCE:
        return LinkKind.PCIE_HOST, links.host_link_Bps * HOST_BRIDGE_FACTOR, PCIE_HOST_LATENCY_S, ()
    pairs: list[PairLink] = []
    if gpus == 8:  # two sockets of four cards: pairs across them go through the inter-socket link
        pairs += [PairLink(a=a, b=b, kind=LinkKind.SMP, bandwidth_Bps=SMP_BPS, latency_s=SMP_LATENCY_S)
                  for a in range(4) for b in range(4, 8)]
    if kind.bridges and gpus >= 2:
        pairs += nvlink_pairs({(a, a + 1): links.nvlinks for a in range(0, gpus, 2)}, links.nvlink_rate_Bps)
    return LinkKind.PCIE, links.host_link_Bps, PCIE_LATENCY_S, tuple(sorted(pairs, key=lambda p: (p.a, p.b)))
