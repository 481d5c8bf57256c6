import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tagplan.ir import Cluster, DeviceSpec, DType, LinkKind, Network, Node, PairLink

FAST = DeviceSpec(name="FAST", peak_flops_bf16=300e12, peak_flops_fp16=300e12, peak_flops_fp32=20e12,
                  mem_bytes=80 * 10**9, mem_bandwidth_Bps=2e12)
OLD = DeviceSpec(name="OLD", peak_flops_bf16=None, peak_flops_fp16=125e12, peak_flops_fp32=15e12,
                 mem_bytes=16 * 10**9, mem_bandwidth_Bps=9e11)


def mixed() -> Cluster:
    """Two nodes of different types and GPU counts: 8 x FAST on NVSwitch, 4 x OLD on PCIe."""
    a = Node(name="a", device=FAST, gpus=8, fabric=LinkKind.NVSWITCH, fabric_bandwidth_Bps=240e9,
             nics=8, nic_bandwidth_Bps=25e9)
    b = Node(name="b", device=OLD, gpus=4, fabric=LinkKind.PCIE, fabric_bandwidth_Bps=12e9,
             nics=1, nic_bandwidth_Bps=6.25e9,
             pair_links=(PairLink(a=0, b=3, kind=LinkKind.SMP, bandwidth_Bps=6e9, latency_s=5e-6),))
    return Cluster(name="mixed", nodes=(a, b), network=Network(latency_s=5e-6, oversubscription=2.0))


def test_devices_are_node_major_and_nodes_may_differ_in_size() -> None:
    c = mixed()
    assert c.num_devices == 12
    assert [d.node for d in c.devices] == [0] * 8 + [1] * 4
    assert c.devices[9].local == 1 and c.devices[9].spec.name == "OLD"
    assert c.device_types == ("FAST", "OLD")


def test_links_follow_the_topology() -> None:
    c = mixed()
    assert c.link(0, 7).kind is LinkKind.NVSWITCH and c.link(0, 7).bandwidth_Bps == 240e9
    assert c.link(8, 9).bandwidth_Bps == 12e9
    assert c.link(11, 8).kind is LinkKind.SMP  # explicit pair override, either direction
    net = c.link(0, 8)
    # the slower side's per-GPU NIC share (6.25 GB/s over 4 GPUs), halved by oversubscription
    assert net.kind is LinkKind.NETWORK and net.bandwidth_Bps == pytest.approx(6.25e9 / 4 / 2)
    slow = c.bottleneck([0, 1, 8])
    assert slow.kind is LinkKind.NETWORK and slow.latency_s == 5e-6


def test_peak_flops_falls_back_to_fp16_without_bf16() -> None:
    assert OLD.peak_flops(DType.BF16) == 125e12
    assert FAST.peak_flops(DType.FP32) == 20e12


def test_bad_sizes_are_rejected_with_the_value() -> None:
    with pytest.raises(ValidationError, match="gpus"):
        Node(name="x", device=FAST, gpus=0, fabric_bandwidth_Bps=1e9)
    with pytest.raises(ValidationError, match=r"pair_links\[0\] \(0, 4\) must name two different GPUs in 0..3"):
        Node(name="x", device=FAST, gpus=4, fabric_bandwidth_Bps=1e9,
             pair_links=(PairLink(a=0, b=4, kind=LinkKind.PCIE, bandwidth_Bps=1e9, latency_s=0),))
    with pytest.raises(IndexError, match=r"device 12 is not in cluster 'mixed' \(0..11\)"):
        mixed().link(0, 12)


@given(st.integers(1, 4), st.integers(1, 8), st.floats(1.0, 8.0), st.floats(1e8, 1e11))
def test_cluster_round_trip(nodes: int, gpus: int, over: float, nic: float) -> None:
    c = Cluster(name="c", nodes=tuple(Node(name=f"n{i}", device=FAST, gpus=gpus, fabric_bandwidth_Bps=1e10,
                                           nic_bandwidth_Bps=nic) for i in range(nodes)),
                network=Network(oversubscription=over))
    assert Cluster.from_json(c.to_json()) == c
    assert c.num_devices == nodes * gpus


def test_copies_recompute_derived_tables_and_revalidate() -> None:
    node = mixed().nodes[1]
    cluster = Cluster(name="one", nodes=(node,))
    assert cluster.link(0, 3).kind is LinkKind.SMP  # warms the cached pair table
    plain = cluster.model_copy(update={"nodes": (node.model_copy(update={"pair_links": ()}),)})
    assert plain.link(0, 3).kind is LinkKind.PCIE
    bigger = cluster.model_copy(update={"nodes": (node.model_copy(update={"gpus": 6}),)})
    assert bigger.num_devices == 6 and cluster.num_devices == 4
    with pytest.raises(ValidationError, match="gpus"):
        node.model_copy(update={"gpus": -1})


def test_with_device_figures_replaces_figures_of_one_device_type_validated() -> None:
    cluster = Cluster(name="mix", nodes=(
        Node(name="a", device=FAST, gpus=2, fabric=LinkKind.NVSWITCH, fabric_bandwidth_Bps=2e11),
        Node(name="b", device=OLD, gpus=2, fabric_bandwidth_Bps=1e10)))
    _ = cluster.devices, cluster.link(0, 2)  # cached figures must not survive the copy
    slowed = cluster.with_device_figures("FAST", sustained_peak_fraction=0.8)
    assert [d.spec.sustained_peak_fraction for d in slowed.devices] == [0.8, 0.8, 1.0, 1.0]
    assert [d.spec.sustained_peak_fraction for d in cluster.devices] == [1.0] * 4  # the original is untouched
    assert slowed.link(0, 2) == cluster.link(0, 2)  # links stay as they are
    assert all(not d.spec.fused_attention for d in cluster.with_device_figures(fused_attention=False).devices)
    with pytest.raises(ValueError, match="clock_MHz not a DeviceSpec field; accepted: name, "):
        cluster.with_device_figures("FAST", clock_MHz=1500)
    with pytest.raises(ValidationError, match="sustained_peak_fraction"):
        cluster.with_device_figures("FAST", sustained_peak_fraction=1.5)
    # a type the cluster lacks (a typo, a renamed catalog entry) must not change nothing without a word
    with pytest.raises(ValueError, match=r"device=.H100-SXM. is not a device type of this cluster; accepted: FAST"):
        cluster.with_device_figures("H100-SXM", sustained_peak_fraction=0.8)
