"""NCCL topology XML parsing: NVSwitch, direct NVLink, PCIe paths, NICs, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.nccl_xml import parse_nccl_xml
from tagplan.ir import Cluster, LinkKind

FIXTURES = Path(__file__).parent / "fixtures"

# Two sockets: GPU0/GPU1 behind one PCIe switch, GPU2 on another root port of socket 0 (x8),
# GPU3 on socket 1; one 25 Gb/s NIC that the dump lists under both CPUs.
PCIE_BOX = """<system version="1">
  <cpu numaid="0" arch="x86_64" vendor="GenuineIntel">
    <pci busid="0000:10:00.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16">
      <pci busid="0000:11:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16">
        <gpu dev="0" sm="89" rank="0" gdr="1"/>
      </pci>
      <pci busid="0000:12:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16">
        <gpu dev="1" sm="89" rank="1" gdr="1"/>
      </pci>
    </pci>
    <pci busid="0000:30:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="8">
      <gpu dev="2" sm="89" rank="2" gdr="1"/>
    </pci>
    <nic><net name="eth0" dev="0" speed="25000" port="0" latency="0" gdr="0"/></nic>
  </cpu>
  <cpu numaid="1" arch="x86_64" vendor="GenuineIntel">
    <pci busid="0000:90:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="0">
      <gpu dev="3" sm="89" rank="3" gdr="1"/>
    </pci>
    <nic><net name="eth0" dev="0" speed="25000" port="0" latency="0" gdr="0"/></nic>
  </cpu>
</system>
"""

# Two V100s joined by NVLink directly (tclass 0x030200 = a GPU), two by PCIe only.
DIRECT_NVLINK = """<system version="1">
  <cpu numaid="0">
    <pci busid="0000:1a:00.0" class="0x030200" link_speed="8.0 GT/s PCIe" link_width="16">
      <gpu dev="0" sm="70" rank="0" gdr="1">
        <nvlink target="0000:1b:00.0" count="2" tclass="0x030200"/>
      </gpu>
    </pci>
    <pci busid="0000:1b:00.0" class="0x030200" link_speed="8.0 GT/s PCIe" link_width="16">
      <gpu dev="1" sm="70" rank="1" gdr="1">
        <nvlink target="0000:1a:00.0" count="2" tclass="0x030200"/>
      </gpu>
    </pci>
    <pci busid="0000:1c:00.0" class="0x030200" link_speed="8.0 GT/s PCIe" link_width="16">
      <gpu dev="2" sm="70" rank="2" gdr="1"/>
    </pci>
  </cpu>
</system>
"""


def test_dgx_a100_nvswitch_and_nics() -> None:
    node = parse_nccl_xml((FIXTURES / "nccl_topo_dgx_a100.xml").read_text(), name="dgx")
    assert (node.name, node.gpus, node.device.name) == ("dgx", 8, "A100-SXM-40GB")  # sm80 default
    assert node.fabric is LinkKind.NVSWITCH
    assert node.fabric_bandwidth_Bps == 240e9  # 6 switches x 2 links x 20 GB/s
    assert node.pair_links == ()
    assert (node.nics, node.nic_bandwidth_Bps) == (8, 25e9)  # 200000 Mb/s each


def test_gpu_and_nic_overrides() -> None:
    text = (FIXTURES / "nccl_topo_dgx_a100.xml").read_text()
    node = parse_nccl_xml(text, gpu=lookup_device("A100-SXM-80GB"), nics=4, nic_speed_Gbps=100)
    assert node.device.name == "A100-SXM-80GB"
    assert (node.nics, node.nic_bandwidth_Bps) == (4, 12.5e9)


def test_pcie_paths_follow_the_tree() -> None:
    node = parse_nccl_xml(PCIE_BOX)
    assert node.device.name == "L4"  # sm89 default
    c = Cluster(name="t", nodes=(node,))
    assert (c.link(0, 1).kind, c.link(0, 1).bandwidth_Bps) == (LinkKind.PCIE, 24e9)  # same switch, Gen4 x16
    host = c.link(0, 2)  # same CPU, GPU2 on an x8 link: 12 GB/s, through the host bridge
    assert (host.kind, host.bandwidth_Bps) == (LinkKind.PCIE_HOST, pytest.approx(12e9 * 5 / 6))
    cross = c.link(1, 3)  # width 0 counts as x16
    assert (cross.kind, cross.bandwidth_Bps) == (LinkKind.SMP, 10e9)
    assert (node.nics, node.nic_bandwidth_Bps) == (1, 25e9 / 8)  # eth0 listed twice, counted once


def test_direct_nvlink_pairs() -> None:
    node = parse_nccl_xml(DIRECT_NVLINK)
    c = Cluster(name="t", nodes=(node,))
    assert node.device.name == "V100-SXM2-16GB"
    assert (c.link(0, 1).kind, c.link(0, 1).bandwidth_Bps) == (LinkKind.NVLINK, 40e9)
    assert c.link(0, 2).kind is LinkKind.PCIE_HOST
    assert c.link(0, 2).bandwidth_Bps == pytest.approx(10e9)  # Gen3 x16 through the host bridge
    assert len(node.pair_links) == 3


def test_malformed_xml_names_the_line() -> None:
    # the <gpu> on line 14 is left open, so the </pci> on line 15 does not match
    broken = DIRECT_NVLINK.replace('<gpu dev="2" sm="70" rank="2" gdr="1"/>', '<gpu dev="2" sm="70">')
    with pytest.raises(SpecError, match=r"NCCL topology XML: line 15, column 7: malformed XML: mismatched tag"):
        parse_nccl_xml(broken)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("<topology/>", r"root element is <topology>; expected <system"),
        ('<system version="1"><cpu/></system>', r"no <gpu> element"),
        ('<system><cpu><pci busid="a"><gpu dev="0" sm="61"/></pci></cpu></system>', r"sm/gcn '61'.*pass gpu"),
        ('<system><cpu><pci busid="a"><gpu dev="x" sm="80"/></pci></cpu></system>', r"<gpu> attribute dev='x'"),
    ],
)
def test_bad_topologies(text: str, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        parse_nccl_xml(text)
