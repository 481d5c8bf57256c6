import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tagplan.cost import comm
from tagplan.cost.comm import Algorithm, BYTES_ONLY_BANDWIDTH_Bps, Collective, CommMode, CommModel
from tagplan.cost.mesh_rings import mesh_ring
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.ir import Cluster, DeviceSpec, LinkKind, Network, Node, PairLink

GPU = DeviceSpec(name="GPU", peak_flops_bf16=300e12, peak_flops_fp16=300e12, peak_flops_fp32=20e12,
                 mem_bytes=80 * 10**9, mem_bandwidth_Bps=2e12)
DGX_NVSWITCH_Bps, DGX_NVSWITCH_S = 240e9, 2e-6  # 12 NVLinks x 20 GB/s (presets.dgx_a100_80gb)
DGX_NIC_Bps, IB_S = 25e9, 5e-6  # one 200 Gb/s HDR NIC per GPU; InfiniBand latency
AR, AG, RS, A2A, BC = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER,
                       Collective.ALL_TO_ALL, Collective.BROADCAST)


def mixed() -> Cluster:
    """Three uneven nodes: 8 on NVSwitch, 4 on PCIe with one slow cross-socket pair, 2 on PCIe."""
    a = Node(name="a", device=GPU, gpus=8, fabric=LinkKind.NVSWITCH, fabric_bandwidth_Bps=240e9,
             nics=8, nic_bandwidth_Bps=25e9)
    b = Node(name="b", device=GPU, gpus=4, fabric=LinkKind.PCIE, fabric_bandwidth_Bps=12e9, nics=1,
             nic_bandwidth_Bps=6.25e9,
             pair_links=(PairLink(a=0, b=3, kind=LinkKind.SMP, bandwidth_Bps=6e9, latency_s=6e-6),))
    c = Node(name="c", device=GPU, gpus=2, fabric=LinkKind.PCIE, fabric_bandwidth_Bps=24e9, nics=1,
             nic_bandwidth_Bps=12.5e9)
    return Cluster(name="mixed", nodes=(a, b, c), network=Network(latency_s=5e-6, oversubscription=2.0))


def slow_pair_nodes() -> Cluster:
    """Two 4-GPU nodes whose local ring must cross a 1 GB/s link (0-3); the network is faster."""
    node = Node(name="n", device=GPU, gpus=4, fabric=LinkKind.NVLINK, fabric_bandwidth_Bps=100e9,
                fabric_latency_s=2e-6, nics=4, nic_bandwidth_Bps=50e9,
                pair_links=(PairLink(a=0, b=3, kind=LinkKind.SMP, bandwidth_Bps=1e9, latency_s=6e-6),))
    return Cluster(name="slow-pair", nodes=(node, node.model_copy(update={"name": "m"})),
                   network=Network(latency_s=5e-6))


def ring_ar(n: int, S: float, bw: float, lat: float) -> float:
    return 2 * (n - 1) * lat + 2 * (n - 1) / n * S / bw


def intra(k: int, S: float, bw: float, lat: float) -> float:
    return (k - 1) * lat + (k - 1) / k * S / bw


def all_reduce_forms(S: float, n: int, ring: tuple[float, float], k: int, m: int,
                     node: tuple[float, float], net: tuple[float, float]) -> dict[Algorithm, float]:
    """Ring, hierarchical and tree all-reduce of an even group, written out from the formulas."""
    return {
        Algorithm.RING: ring_ar(n, S, *ring),
        Algorithm.HIERARCHICAL: 2 * intra(k, S, *node) + ring_ar(m, S / k, *net),
        Algorithm.TREE: 2 * intra(k, S, *node) + 2 * math.ceil(math.log2(m)) * net[1] + 2 * (S / k) / net[0],
    }


def test_ring_all_reduce_over_the_network_matches_the_closed_form() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    link = cluster.link(0, 8)
    assert (link.kind, link.bandwidth_Bps, link.latency_s) == (LinkKind.NETWORK, DGX_NIC_Bps, IB_S)
    S = 256e6
    cost = CommModel(cluster).collective(AR, [0, 8], S)
    assert cost.algorithm is Algorithm.RING  # two nodes: the tree's 2S/bw loses to the ring's S/bw
    assert cost.time_s == pytest.approx(2 * 1 * IB_S + 2 * 1 / 2 * S / DGX_NIC_Bps)
    assert cost.bytes_per_device == pytest.approx(S)


@pytest.mark.parametrize("S", [1e3, 1e6, 1e8, 4e9])
def test_hierarchical_wins_on_nvswitch_nodes_with_a_slow_network(S: float) -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2,nics=1")  # one 25 GB/s NIC shared by 8 GPUs
    net = (DGX_NIC_Bps / 8, IB_S)
    assert cluster.link(0, 8).bandwidth_Bps == net[0]
    forms = all_reduce_forms(S, 16, net, 8, 2, (DGX_NVSWITCH_Bps, DGX_NVSWITCH_S), net)
    cost = CommModel(cluster).collective(AR, range(16), S)
    assert cost.algorithm is min(forms, key=forms.__getitem__) is Algorithm.HIERARCHICAL
    assert cost.time_s == pytest.approx(forms[Algorithm.HIERARCHICAL])


def test_ring_wins_when_the_local_ring_crosses_a_link_slower_than_the_network() -> None:
    cluster = slow_pair_nodes()
    model = CommModel(cluster)
    # the flat ring 0..7 avoids the 0-3 link (its slowest hops are the two network hops, 50 GB/s);
    # each node's ring 0-1-2-3-0 must cross it: 1 GB/s, 6 us
    ring, node, net = (50e9, 5e-6), (1e9, 6e-6), (50e9, 5e-6)
    chosen = set()
    for S in (1e2, 1e4, 1e6, 1e8):
        forms = all_reduce_forms(S, 8, ring, 4, 2, node, net)
        cost = model.collective(AR, range(8), S)
        assert cost.algorithm is min(forms, key=forms.__getitem__)
        assert cost.time_s == pytest.approx(min(forms.values()))
        chosen.add(cost.algorithm)
    # hierarchical's fewer steps win tiny messages; the slow intra link loses large ones
    assert chosen == {Algorithm.HIERARCHICAL, Algorithm.RING}


def test_tree_beats_ring_for_tiny_messages_on_many_nodes_only() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=16")
    group = [8 * i for i in range(16)]  # one GPU per node: only ring and tree apply
    model = CommModel(cluster)
    tiny, large = model.collective(AR, group, 1e3), model.collective(AR, group, 1e9)
    assert tiny.algorithm is Algorithm.TREE
    assert tiny.time_s == pytest.approx(2 * 4 * IB_S + 2 * 1e3 / DGX_NIC_Bps)
    assert tiny.time_s < ring_ar(16, 1e3, DGX_NIC_Bps, IB_S)
    assert large.algorithm is Algorithm.RING
    assert large.time_s == pytest.approx(ring_ar(16, 1e9, DGX_NIC_Bps, IB_S))


@pytest.mark.parametrize(("spec", "group"), [("p3.8xlarge", [0, 1, 2, 3]), ("dgx-a100-80gb", range(8)),
                                             ("g4dn.12xlarge:nodes=2", [0, 4])])
def test_ring_all_gather_plus_reduce_scatter_is_all_reduce(spec: str, group: list[int]) -> None:
    model = CommModel(load_cluster(spec))
    ar, ag, rs = (model.collective(kind, group, 64e6) for kind in (AR, AG, RS))
    assert ar.algorithm is ag.algorithm is rs.algorithm is Algorithm.RING
    assert ag.time_s + rs.time_s == pytest.approx(ar.time_s)
    assert ag.bytes_per_device == pytest.approx((len(group) - 1) / len(group) * 64e6)


NVLINK_V100_Bps = 20e9  # one NVLink's one-way rate (presets.NVLINK_SM80_BPS)


@pytest.mark.parametrize(("spec", "group", "links"), [
    ("p3.16xlarge", range(8), 6),  # the hybrid cube mesh: six NVLinks a GPU, three cycles run both ways
    ("p3.8xlarge", [0, 1, 2, 3], 4),  # the quad: GPU 0 has four NVLinks to the others
    ("p3.16xlarge", [0, 1, 5, 4], 2),  # one NVLink cycle 0-1-5-4 whose thinnest links are single
])
def test_a_mesh_rings_over_its_nvlinks_as_nccl_channels(spec: str, group: list[int], links: int) -> None:
    cost = CommModel(load_cluster(spec)).collective(AG, list(group), 1e8)
    n = len(group)
    assert cost.algorithm is Algorithm.RING
    assert cost.time_s == pytest.approx((n - 1) * 2e-6 + (n - 1) / n * 1e8 / (links * NVLINK_V100_Bps))


def test_a_mesh_ring_does_not_depend_on_rank_order() -> None:
    """In rank order 0..7 the DGX-1V ring would cross the CPU sockets (3-4 and 7-0 have no NVLink);
    NCCL's search does not follow rank order, and neither does the model."""
    cluster = load_cluster("p3.16xlarge")
    assert cluster.link(3, 4).kind is LinkKind.SMP
    model = CommModel(cluster)
    times = {model.collective(AR, order, 1e9).time_s for order in ([0, 1, 2, 3, 4, 5, 6, 7], [7, 0, 3, 4, 1, 6, 2, 5])}
    assert len(times) == 1
    assert times.pop() == pytest.approx(ring_ar(8, 1e9, 6 * NVLINK_V100_Bps, 2e-6))


def test_a_group_nvlinks_cannot_close_rings_over_its_best_other_cycle() -> None:
    """NVLink-bridged pairs (0-1, 2-3) on PCIe: no NVLink cycle covers the four GPUs, so one ring, as
    fast as its slowest hop over PCIe allows; the bridges are used where a cycle can use them."""
    pcie = 12e9
    node = Node(name="bridged", device=GPU, gpus=4, fabric=LinkKind.PCIE, fabric_bandwidth_Bps=pcie,
                fabric_latency_s=3e-6, pair_links=(
                    PairLink(a=0, b=1, kind=LinkKind.NVLINK, bandwidth_Bps=100e9, latency_s=2e-6),
                    PairLink(a=2, b=3, kind=LinkKind.NVLINK, bandwidth_Bps=100e9, latency_s=2e-6)))
    cluster = Cluster(name="bridged", nodes=(node,), network=Network(latency_s=5e-6))
    cost = CommModel(cluster).collective(AG, [0, 2, 1, 3], 1e8)
    assert cost.time_s == pytest.approx(3 * 3e-6 + 3 / 4 * 1e8 / pcie)


def test_mesh_ring_is_searched_for_three_to_eight_gpus_only() -> None:
    links = load_cluster("p3.16xlarge")
    two = tuple(tuple(links.link(a, b) for b in range(2)) for a in range(2))
    with pytest.raises(ValueError, match=r"2 GPUs; searched for groups of 3\.\.8"):
        mesh_ring(two)


def test_a_mesh_all_to_all_sends_over_each_pair_link_not_the_rings() -> None:
    """All-to-all sends to every peer directly: on the DGX-1V the three peers across the sockets (SMP) are
    reached at their own rate, so the eight GPUs take longer than the NVLinked quad, not less."""
    cluster = load_cluster("p3.16xlarge")
    model = CommModel(cluster)
    S = 1e9
    quad, full = model.collective(A2A, [0, 1, 2, 3], S), model.collective(A2A, list(range(8)), S)
    per_B = max(sum(1 / cluster.link(a, b).bandwidth_Bps for b in range(8) if b != a) for a in range(8))
    assert full.time_s == pytest.approx((S / 8) * per_B + 7 * cluster.bottleneck(list(range(8))).latency_s)
    assert full.time_s > quad.time_s


def test_uniform_and_multi_node_groups_keep_their_ring_order() -> None:
    """NVSwitch nodes (no pair links) and groups over several nodes are not searched: a ring over two
    p3.16xlarge nodes is bounded by the network, in any order."""
    dgx = CommModel(load_cluster("dgx-a100-80gb")).collective(AG, list(range(8)), 1e8)
    assert dgx.time_s == pytest.approx(7 * DGX_NVSWITCH_S + 7 / 8 * 1e8 / DGX_NVSWITCH_Bps)
    two = load_cluster("p3.16xlarge:nodes=2")
    topo = comm.group_topology(two, [0, 1, 2, 8, 9, 10])
    assert topo.ring_bandwidth_Bps == pytest.approx(two.link(0, 8).bandwidth_Bps)
    assert topo.intra_bandwidth_Bps[0] == pytest.approx(2 * NVLINK_V100_Bps)  # 0-1-2: single links 0-1, 0-2


def test_all_to_all_across_nodes_is_limited_by_the_network_share() -> None:
    S = 1e9
    cost = CommModel(load_cluster("dgx-a100-80gb:nodes=2")).collective(A2A, range(16), S)
    intra_s, inter_s = 7 * (S / 16) / DGX_NVSWITCH_Bps, 8 * (S / 16) / DGX_NIC_Bps
    assert inter_s > intra_s
    assert cost.algorithm is Algorithm.DIRECT
    assert cost.time_s == pytest.approx(inter_s + 15 * IB_S)
    faster_nics = CommModel(load_cluster("dgx-a100-80gb:nodes=2,nic_speed_Gbps=400")).collective(A2A, range(16), S)
    assert faster_nics.time_s == pytest.approx(inter_s / 2 + 15 * IB_S)


def test_p2p_uses_the_pair_link() -> None:
    cluster = mixed()
    model = CommModel(cluster)
    net = cluster.link(0, 8)
    assert model.p2p(0, 8, 1e6).time_s == pytest.approx(net.latency_s + 1e6 / net.bandwidth_Bps)
    assert model.p2p(0, 7, 1e6).time_s == pytest.approx(2e-6 + 1e6 / 240e9)
    assert model.p2p(11, 8, 1e6).time_s == pytest.approx(6e-6 + 1e6 / 6e9)  # the SMP pair override
    assert model.p2p(3, 3, 1e6) == comm.CommCost(0.0, Algorithm.LOCAL, 0.0)


def test_p2p_groups_pairs_devices_and_serialises_a_shared_receiver() -> None:
    cluster = mixed()
    net = cluster.link(0, 8)
    cost = CommModel(cluster).p2p_groups([0, 1, 2, 3], [8, 9], 4e6)  # 0->8, 1->9, 2->8, 3->9
    assert cost.algorithm is Algorithm.P2P and cost.bytes_per_device == 1e6
    assert cost.time_s == pytest.approx(net.latency_s + 2 * 1e6 / net.bandwidth_Bps)
    one_to_one = CommModel(cluster).p2p_groups([0, 1], [8, 9], 4e6)
    assert one_to_one.time_s == pytest.approx(net.latency_s + 2e6 / net.bandwidth_Bps)


@pytest.mark.parametrize("group", [[0, 1, 2, 3], [0, 1, 4, 5]])
def test_bytes_only_counts_volume_and_ignores_topology(group: list[int]) -> None:
    S, n = 1e8, len(group)
    fast = CommModel(load_cluster("dgx-a100-80gb:nodes=2"), CommMode.BYTES_ONLY)
    slow = CommModel(load_cluster("g4dn.12xlarge:nodes=2"), CommMode.BYTES_ONLY)
    expected = {AR: 2 * (n - 1) / n * S, AG: (n - 1) / n * S, RS: (n - 1) / n * S, A2A: (n - 1) / n * S, BC: S}
    for kind, volume in expected.items():
        on_fast, on_slow = fast.collective(kind, group, S), slow.collective(kind, group, S)
        assert on_fast == on_slow
        assert on_fast.algorithm is Algorithm.BYTES_ONLY
        assert on_fast.time_s == pytest.approx(volume / BYTES_ONLY_BANDWIDTH_Bps)
        assert on_fast.bytes_per_device == pytest.approx(volume)
    assert fast.p2p(0, 4, S).time_s == slow.p2p(0, 4, S).time_s == S / BYTES_ONLY_BANDWIDTH_Bps


def test_single_devices_and_empty_messages_cost_nothing() -> None:
    model = CommModel(mixed())
    for kind in Collective:
        assert model.collective(kind, [5], 1e9) == comm.CommCost(0.0, Algorithm.LOCAL, 0.0)
        assert model.collective(kind, [0, 8, 12], 0).time_s == 0.0


def test_bad_groups_and_sizes_are_rejected_with_the_value() -> None:
    model = CommModel(mixed())
    with pytest.raises(ValueError, match=r"repeats devices \[1\]"):
        model.collective(AR, [0, 1, 1], 1e6)
    with pytest.raises(ValueError, match="at least one device"):
        model.collective(AR, [], 1e6)
    with pytest.raises(ValueError, match="got -1"):
        model.collective(AR, [0, 1], -1)
    with pytest.raises(IndexError, match=r"device 14 is not in cluster 'mixed' \(0..13\)"):
        model.collective(AR, [0, 14], 1e6)


def test_group_topology_summarises_an_uneven_group() -> None:
    topo = comm.group_topology(mixed(), [8, 9, 10, 11, 0, 1, 12])
    assert dict(topo.nodes) == {1: (8, 9, 10, 11), 0: (0, 1), 2: (12,)}
    assert (topo.k, topo.k_min, topo.uniform, topo.num_nodes) == (4, 1, False, 3)
    assert topo.intra_bandwidth_Bps == {1: 6e9, 0: 240e9, 2: math.inf}  # node 1's ring wraps over 11-8
    assert topo.inter_bandwidth_Bps == pytest.approx(6.25e9 / 4 / 2)  # slowest per-GPU share, oversubscribed
    assert topo.ring_bandwidth_Bps == pytest.approx(6.25e9 / 4 / 2)


def test_memo_computes_each_group_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = comm.group_topology

    def counting(cluster: Cluster, devices: tuple[int, ...]) -> comm.GroupTopology:
        calls.append(tuple(devices))
        return real(cluster, devices)

    monkeypatch.setattr(comm, "group_topology", counting)
    model = CommModel(mixed())
    first = model.collective(AR, [0, 1, 8], 1e6)
    topo = model.memo[(0, 1, 8)]
    assert model.collective(AR, (0, 1, 8), 1e6) == first
    model.collective(AG, [0, 1, 8], 2e6)
    assert calls == [(0, 1, 8)] and len(model.memo) == 1 and model.memo[(0, 1, 8)] is topo
    model.collective(AR, [8, 0, 1], 1e6)  # another order is another ring
    assert len(calls) == len(model.memo) == 2


def scaled(cluster: Cluster, f: float) -> Cluster:
    """`cluster` with every link bandwidth multiplied by f."""
    nodes = tuple(node.model_copy(update={
        "fabric_bandwidth_Bps": node.fabric_bandwidth_Bps * f,
        "nic_bandwidth_Bps": node.nic_bandwidth_Bps * f,
        "pair_links": tuple(p.model_copy(update={"bandwidth_Bps": p.bandwidth_Bps * f}) for p in node.pair_links),
    }) for node in cluster.nodes)
    return cluster.model_copy(update={"nodes": nodes})


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(list(Collective)), st.floats(0, 1e10), st.floats(1, 1e3))
def test_faster_links_never_slow_a_collective(data: st.DataObject, kind: Collective, S: float, f: float) -> None:
    cluster = mixed()
    order = data.draw(st.permutations(range(cluster.num_devices)))
    group = order[: data.draw(st.integers(1, cluster.num_devices))]
    base, fast = CommModel(cluster), CommModel(scaled(cluster, f))
    assert fast.collective(kind, group, S).time_s <= base.collective(kind, group, S).time_s * (1 + 1e-12)
    assert fast.p2p(group[0], group[-1], S).time_s <= base.p2p(group[0], group[-1], S).time_s * (1 + 1e-12)
    half = max(1, len(group) // 2)
    assert (fast.p2p_groups(group[:half], group[half:] or group, S).time_s
            <= base.p2p_groups(group[:half], group[half:] or group, S).time_s * (1 + 1e-12))
