"""`nvidia-smi topo -m` parsing: NVSwitch, hybrid mesh and PCIe boxes; errors with line numbers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tagplan.cost.comm import group_topology
from tagplan.errors import SpecError
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.nvidia_topo import compute_nics, parse_nvidia_topo
from tagplan.ir import Cluster, LinkKind, Node

FIXTURES = Path(__file__).parent / "fixtures"


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


def _cluster(node: Node) -> Cluster:
    return Cluster(name="t", nodes=(node,))


def test_dgx_a100_nv12_everywhere_is_an_nvswitch_fabric() -> None:
    text = _read("topo_dgx_a100.txt")
    assert "\x1b[4m" in text  # the fixture keeps nvidia-smi's ANSI underline
    node = parse_nvidia_topo(text, gpu=lookup_device("A100-SXM-80GB"), name="dgx")
    assert (node.name, node.gpus, node.device.name) == ("dgx", 8, "A100-SXM-80GB")
    assert node.fabric is LinkKind.NVSWITCH
    assert node.fabric_bandwidth_Bps == 240e9
    assert node.pair_links == ()
    assert node.nics == 8  # NIC0..NIC7 columns; CPU/NUMA/GPU NUMA ID columns are not NICs
    assert node.nic_bandwidth_Bps == 12.5e9  # default 100 Gb/s


def test_gpu_type_inferred_from_nvlink_pattern_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        node = parse_nvidia_topo(_read("topo_dgx_a100.txt"))
    assert node.device.name == "A100-SXM-40GB"
    assert "assuming A100-SXM-40GB" in caplog.text
    assert parse_nvidia_topo(_read("topo_dgx1v.txt")).device.name == "V100-SXM2-16GB"


def test_dgx1v_hybrid_cube_mesh() -> None:
    node = parse_nvidia_topo(_read("topo_dgx1v.txt"), nic_speed_Gbps=100)
    c = _cluster(node)
    assert node.nics == 4  # mlx5_0, mlx5_2, mlx5_1, mlx5_3 columns
    assert len(node.pair_links) == 28  # every pair, since they differ
    nv2, nv1, sys = c.link(0, 3), c.link(0, 1), c.link(0, 5)
    assert (nv2.kind, nv2.bandwidth_Bps) == (LinkKind.NVLINK, 40e9)
    assert (nv1.kind, nv1.bandwidth_Bps) == (LinkKind.NVLINK, 20e9)
    assert sys.kind is LinkKind.SMP
    assert sys.bandwidth_Bps < nv1.bandwidth_Bps < nv2.bandwidth_Bps
    assert sys.latency_s > nv2.latency_s
    assert node.fabric is LinkKind.SMP  # the fabric is the slowest pair
    assert c.bottleneck([0, 1, 2, 3]).bandwidth_Bps == 20e9  # a socket's quad is all NVLink


def test_pcie_box_requires_a_gpu_type() -> None:
    with pytest.raises(SpecError, match=r"does not name the GPU type.*pass gpu.*T4"):
        parse_nvidia_topo(_read("topo_pcie4.txt"))


def test_pcie_box_link_classes() -> None:
    node = parse_nvidia_topo(_read("topo_pcie4.txt"), gpu=lookup_device("T4"))
    c = _cluster(node)
    pix, phb, sys = c.link(0, 1), c.link(0, 2), c.link(0, 3)
    assert (pix.kind, pix.bandwidth_Bps) == (LinkKind.PCIE, 12e9)  # Gen3 x16
    assert (phb.kind, phb.bandwidth_Bps) == (LinkKind.PCIE_HOST, pytest.approx(10e9))
    assert sys.kind is LinkKind.SMP and sys.bandwidth_Bps <= phb.bandwidth_Bps
    assert pix.latency_s < phb.latency_s < sys.latency_s
    assert node.fabric is LinkKind.SMP  # ties on bandwidth go to the higher latency
    assert node.nics == 1


def test_gen4_gpu_uses_its_own_host_link() -> None:
    node = parse_nvidia_topo(_read("topo_pcie4.txt"), gpu=lookup_device("L40S"), nics=2, nic_speed_Gbps=25)
    assert _cluster(node).link(0, 1).bandwidth_Bps == 24e9
    assert (node.nics, node.nic_bandwidth_Bps) == (2, 25e9 / 8)


def test_h100_nv18_with_spaces_and_no_nics() -> None:
    header = "        " + "  ".join(f"GPU{i}" for i in range(4)) + "    CPU Affinity    NUMA Affinity"
    cells = [["  X " if a == b else "NV18" for b in range(4)] for a in range(4)]
    rows = [f"GPU{a}  " + "  ".join(cells[a]) + "  0-55  0" for a in range(4)]
    node = parse_nvidia_topo("\n".join([header, *rows, "", "Legend:", "  X = Self"]))
    assert node.device.name == "H100-SXM"
    assert node.fabric is LinkKind.NVSWITCH
    assert node.fabric_bandwidth_Bps == pytest.approx(18 * 20.6e9)
    assert (node.nics, node.nic_bandwidth_Bps) == (1, 10e9 / 8)  # host Ethernet assumed


def test_an_nvswitch_with_a_degraded_link_is_still_a_switch() -> None:
    """NV17 on one pair among NV18s: each GPU shows 7 x ~18 links, more than the 18 an H100 has, so the GPUs
    meet on a switch (at the slowest pair's rate), not on point-to-point links whose rings would add up."""
    header = "        " + "  ".join(f"GPU{i}" for i in range(8))
    cells = [["  X " if a == b else ("NV17" if {a, b} == {0, 1} else "NV18") for b in range(8)] for a in range(8)]
    rows = [f"GPU{a}  " + "  ".join(cells[a]) for a in range(8)]
    node = parse_nvidia_topo("\n".join([header, *rows]), gpu=lookup_device("H100-SXM"))
    assert node.fabric is LinkKind.NVSWITCH and node.pair_links == ()
    assert node.fabric_bandwidth_Bps == pytest.approx(17 * 20.6e9)


def test_dgx1v_file_rings_over_its_nvlinks() -> None:
    """The imported hybrid cube mesh keeps its pair links, and the cost model rings over them as NCCL does:
    six NVLinks a GPU (`cost.mesh_rings`), where rank order would cross the sockets."""
    c = _cluster(parse_nvidia_topo(_read("topo_dgx1v.txt")))
    assert group_topology(c, list(range(8))).ring_bandwidth_Bps == pytest.approx(6 * 20e9)


def test_single_gpu() -> None:
    node = parse_nvidia_topo("\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n", gpu=lookup_device("L4"))
    assert node.gpus == 1 and node.fabric_bandwidth_Bps == 24e9


def test_bad_cell_names_its_line() -> None:
    lines = _read("topo_pcie4.txt").splitlines()
    lines[2] = lines[2].replace("PHB", "QPI", 1)
    with pytest.raises(SpecError, match=r"line 3: GPU1-GPU2 cell 'QPI' is not accepted; expected NV#, PIX"):
        parse_nvidia_topo("\n".join(lines), gpu=lookup_device("T4"))


def test_short_row_names_its_line() -> None:
    lines = _read("topo_pcie4.txt").splitlines()
    lines[4] = "GPU3    SYS     SYS"
    with pytest.raises(SpecError, match=r"line 5: row GPU3 has 2 cells; expected 5"):
        parse_nvidia_topo("\n".join(lines), gpu=lookup_device("T4"))


def test_asymmetric_matrix_is_rejected() -> None:
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tNV1\t X \n"
    with pytest.raises(SpecError, match=r"line 2: GPU0-GPU1 is 'NV2' but GPU1-GPU0 is 'NV1'"):
        parse_nvidia_topo(text, gpu=lookup_device("V100"))


def test_not_a_topo_matrix() -> None:
    with pytest.raises(SpecError, match=r"no header line starting with GPU0"):
        parse_nvidia_topo("hello\nworld\n")


def test_dgx_a100_storage_nics_are_not_compute_nics() -> None:
    text = (FIXTURES / "topo_dgx_a100_storage.txt").read_text()  # 10 NICs: 8 compute, 2 storage (NIC4, NIC5)
    node = parse_nvidia_topo(text, gpu=lookup_device("A100-SXM-80GB"), nic_speed_Gbps=200)
    assert node.nics == 8
    assert node.nics * node.nic_bandwidth_Bps / node.gpus == pytest.approx(25e9)  # 200 Gb/s per GPU
    assert parse_nvidia_topo(text, gpu=lookup_device("A100-SXM-80GB"), nics=10).nics == 10  # the override


def test_compute_nics_by_gpu_affinity() -> None:
    names = ["NIC0", "NIC1", "NIC2"]
    assert compute_nics(names, [["PIX", "SYS", "NODE"], ["SYS", "PXB", "NODE"]]) == ["NIC0", "NIC1"]
    assert compute_nics(names, [["SYS", "NODE", "NODE"]]) == ["NIC1", "NIC2"]  # no switch: the closest ones
    with pytest.raises(SpecError, match="GPU0-NIC0 cell 'NV4'"):
        compute_nics(names, [["NV4", "SYS", "SYS"]])
