"""Presets: figures from reference/hardware.md, network classes, overrides."""

from __future__ import annotations

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.presets import (
    DGX1V_NVLINKS,
    EFA_LATENCY_S,
    IB_LATENCY_S,
    TCP_LATENCY_S,
    preset,
    preset_names,
    replace_node,
    with_overrides,
)
from tagplan.ir import Cluster, LinkKind


def _cluster(name: str) -> Cluster:
    return Cluster(name=name, nodes=(preset(name).node,))


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds_a_valid_node(name: str) -> None:
    p = preset(name)
    assert p.name == name == p.node.name
    assert p.node.gpus in (4, 8, 72)  # 72: a GB200 NVL72 rack is one NVLink domain
    assert p.node.nics >= 1


@pytest.mark.parametrize(
    ("name", "gpu", "fabric_Bps", "nics", "nic_Bps", "latency_s"),
    [
        ("dgx-a100-40gb", "A100-SXM-40GB", 240e9, 8, 25e9, IB_LATENCY_S),
        ("dgx-a100-80gb", "A100-SXM-80GB", 240e9, 8, 25e9, IB_LATENCY_S),
        ("dgx-h100", "H100-SXM", 18 * 20.6e9, 8, 50e9, IB_LATENCY_S),
        ("p4d.24xlarge", "A100-SXM-40GB", 240e9, 4, 12.5e9, EFA_LATENCY_S),
    ],
)
def test_nvswitch_presets(name: str, gpu: str, fabric_Bps: float, nics: int, nic_Bps: float,
                          latency_s: float) -> None:
    p = preset(name)
    assert p.node.device.name == gpu
    assert p.node.fabric is LinkKind.NVSWITCH
    assert p.node.fabric_bandwidth_Bps == pytest.approx(fabric_Bps)
    assert (p.node.nics, p.node.nic_bandwidth_Bps) == (nics, nic_Bps)
    assert p.network.latency_s == latency_s


def test_p4d_efa_totals_400_gbps() -> None:
    node = preset("p4d.24xlarge").node
    assert node.nics * node.nic_bandwidth_Bps * 8 == 400e9


def test_p3_8xlarge_is_an_nvlinked_quad_of_the_dgx1v_mesh() -> None:
    c = _cluster("p3.8xlarge")
    links = [c.link(a, b) for a in range(4) for b in range(a + 1, 4)]
    assert all(link.kind is LinkKind.NVLINK for link in links)
    assert {link.bandwidth_Bps for link in links} == {20e9, 40e9}
    assert c.link(0, 3).bandwidth_Bps == 40e9 and c.link(0, 1).bandwidth_Bps == 20e9
    assert c.nodes[0].nic_bandwidth_Bps * 8 == 10e9
    assert preset("p3.8xlarge").network.latency_s == TCP_LATENCY_S


def test_p3_16xlarge_hybrid_cube_mesh() -> None:
    c = _cluster("p3.16xlarge")
    for gpu in range(8):  # every V100 uses its 6 NVLinks
        assert sum(n for pair, n in DGX1V_NVLINKS.items() if gpu in pair) == 6
    assert c.link(0, 3).bandwidth_Bps == 40e9  # NV2
    assert c.link(0, 1).bandwidth_Bps == 20e9  # NV1
    cross = c.link(0, 5)  # not NVLinked: across the sockets
    assert cross.kind is LinkKind.SMP
    assert cross.bandwidth_Bps < c.link(0, 1).bandwidth_Bps
    assert cross.latency_s > c.link(0, 1).latency_s


def test_pcie_presets() -> None:
    g4 = preset("g4dn.12xlarge")
    # no P2P in the VM: T4s reach each other at 50 Gb/s through host memory (AMP's figure for the instance)
    assert (g4.node.device.name, g4.node.fabric, g4.node.fabric_bandwidth_Bps) == ("T4", LinkKind.PCIE_HOST, 6.25e9)
    assert g4.node.nic_bandwidth_Bps * 8 == 50e9
    rtx = preset("rtx4090x4").node
    assert rtx.fabric is LinkKind.PCIE_HOST  # no P2P on GeForce: staged through host memory
    assert rtx.fabric_bandwidth_Bps == pytest.approx(20e9)
    assert rtx.nic_bandwidth_Bps * 8 == 25e9


def test_unknown_preset_suggests_the_nearest() -> None:
    with pytest.raises(SpecError, match=r"unknown cluster preset 'p3.8xlarg'\. Did you mean 'p3.8xlarge'"):
        preset("p3.8xlarg")


def test_preset_names_are_case_insensitive() -> None:
    assert preset("DGX-H100").node.device.name == "H100-SXM"


def test_with_overrides_changes_only_what_is_asked() -> None:
    base = preset("dgx-a100-40gb").node
    node = with_overrides(base, name="x", gpu=lookup_device("A100-SXM-80GB"), nics=4, nic_speed_Gbps=400)
    assert (node.name, node.device.name, node.nics, node.nic_bandwidth_Bps) == ("x", "A100-SXM-80GB", 4, 50e9)
    assert node.fabric_bandwidth_Bps == base.fabric_bandwidth_Bps
    assert with_overrides(base) is base


def test_replace_node_does_not_keep_stale_pair_lookups() -> None:
    node = preset("p3.16xlarge").node
    assert Cluster(name="a", nodes=(node,)).link(0, 3).bandwidth_Bps == 40e9  # fills the node's pair cache
    flat = replace_node(node, pair_links=())
    assert Cluster(name="b", nodes=(flat,)).link(0, 3).kind is LinkKind.SMP
