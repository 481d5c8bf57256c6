"""Collective and point-to-point communication time over an actual device group on its actual links.

Alpha-beta (Hockney) model: a step costs the latency `alpha` (s) of the link it uses, and moving
B bytes costs `B / bw` with `bw` the unidirectional bandwidth (bytes/s) of the bottleneck link.
`nbytes` follows the nccl-tests "size" convention (nccl-tests doc/PERFORMANCE.md): all-reduce and
broadcast: the buffer each rank holds; all-gather: the gathered OUTPUT; reduce-scatter: the full
INPUT; all-to-all: each rank's send buffer. n = group size, S = nbytes.

RING, over the group in the given order, wrap-around link included (on a node of point-to-point
NVLinks, the rings NCCL's search finds over them: `mesh_rings`) (Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk and Yuan 2009):
    all-reduce        2(n-1) alpha + 2(n-1)/n S / bw
    all-gather, r-s    (n-1) alpha +  (n-1)/n S / bw
    broadcast          (n-1) alpha +        S / bw      (pipelined chain along the ring)
HIERARCHICAL, m >= 2 nodes and k >= 2 devices on some node (BlueConnect, Cho et al., SysML 2019;
Horovod's hierarchical all-reduce): intra-node reduce-scatter of S over k devices, then each of the
k local ranks runs its own inter-node ring over the m nodes on 1/k of the data, in parallel, each at
the per-GPU network share `Cluster.link` returns, then intra-node all-gather:
    all-reduce        2 [(k-1) alpha_i + (k-1)/k S / bw_i] + 2(m-1) alpha_n + 2(m-1)/m (S/k') / bw_n
    all-gather, r-s      (k-1) alpha_i + (k-1)/k S / bw_i  +  (m-1) alpha_n +  (m-1)/m (S/k') / bw_n
  Uneven groups (nodes contributing different device counts): k is the largest count and bw_i,
  alpha_i those of the slowest node (intra phases), k' the smallest count (the GPUs of the smallest
  node each carry 1/k' of the data over the network). Both choices are upper bounds; k' = k when even.
TREE, all-reduce only, m >= 2 (NCCL's double binary tree: Sanders, Speck and Traeff, "Two-tree
algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing 2009; Jeaugey,
"Massively Scale Your Deep Learning Training with NCCL 2.4", 2019). The intra phases are as above;
between nodes each local rank reduces up and broadcasts down a tree of depth ceil(log2 m), pipelined,
so a node's uplink carries about 2 (S/k') bytes; NCCL's tuning.cc likewise converts a tree's bus
bandwidth to algorithm bandwidth with the ratio 1/2:
    all-reduce        2 [(k-1) alpha_i + (k-1)/k S / bw_i] + 2 ceil(log2 m) alpha_n + 2 (S/k') / bw_n
  It beats the rings for small S on many nodes (log m latency) and loses for large S (2 vs 2(m-1)/m).
DIRECT all-to-all: each device sends S/n to every peer; its intra-node sends (at its node's intra
bottleneck) and inter-node sends (at the per-GPU network share, which already divides the node's NICs
among its GPUs) proceed in parallel, the sends of each class one after another:
    max((k_j - 1)(S/n) / bw_i,j over nodes j, (n - k') (S/n) / bw_n) + (n-1) alpha_max
P2P: alpha + S / bw(src, dst).

Each call returns the cheapest applicable algorithm. `CommMode.BYTES_ONLY` is an ablation that
ignores topology (as the baselines in the TAPS paper do): time = bus bytes / BYTES_ONLY_BANDWIDTH_Bps,
no latency; its times are comparable only with each other, never with topology-mode times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from itertools import pairwise

from tagplan.cost.mesh_rings import MESH_LIMIT, mesh_ring
from tagplan.cost.object_memo import object_memo
from tagplan.ir.cluster import Cluster, Link, LinkKind

BYTES_ONLY_BANDWIDTH_Bps = 1e10
"""The one bandwidth (bytes/s) of the bytes-only ablation; its times only rank plans by volume."""


class Collective(StrEnum):
    """A collective operation (nccl-tests naming)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


class Algorithm(StrEnum):
    """How a transfer is carried out; LOCAL means nothing crosses a link."""

    RING = "ring"
    HIERARCHICAL = "hierarchical"
    TREE = "tree"
    DIRECT = "direct"
    P2P = "p2p"
    LOCAL = "local"
    BYTES_ONLY = "bytes_only"


class CommMode(StrEnum):
    """TOPOLOGY: alpha-beta on the actual links. BYTES_ONLY: volume over one constant bandwidth."""

    TOPOLOGY = "topology"
    BYTES_ONLY = "bytes_only"


@dataclass(frozen=True, slots=True)
class CommCost:
    """A transfer's time (s), the algorithm used, and the bytes the busiest device sends."""

    time_s: float
    algorithm: Algorithm
    bytes_per_device: float


_NOTHING = CommCost(0.0, Algorithm.LOCAL, 0.0)


@dataclass(frozen=True, slots=True)
class GroupTopology:
    """What the collectives need to know about a device group, computed once (O(n) link queries).

    Bandwidths are unidirectional bytes/s, latencies seconds. A node with one group device has an
    infinite intra bandwidth and zero intra latency; so has the network for a one-node group.
    """

    devices: tuple[int, ...]
    nodes: Mapping[int, tuple[int, ...]]  # node -> its group devices in group order; first-appearance order
    ring_bandwidth_Bps: float  # bottleneck of the ring in group order, wrap-around included (a mesh: `mesh_rings`)
    ring_latency_s: float  # largest latency on that ring
    intra_bandwidth_Bps: Mapping[int, float]  # node -> bottleneck of the ring over its group devices
    intra_latency_s: Mapping[int, float]  # node -> largest latency on that ring
    inter_bandwidth_Bps: float  # slowest per-GPU network share between any two of the group's nodes
    inter_latency_s: float  # network latency
    k: int  # most devices any node contributes
    k_min: int  # fewest devices any node contributes
    uniform: bool  # every node contributes the same number of devices
    slowest_intra_bandwidth_Bps: float  # min of intra_bandwidth_Bps
    slowest_intra_latency_s: float  # max of intra_latency_s
    max_latency_s: float  # largest latency of any link queried (on a node with pair links, of any pair in the group)
    alltoall_intra_s_per_B: float  # max over devices of the sum over their node's other group devices of 1 / link

    @property
    def size(self) -> int:
        """Number of devices n."""
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        """Number of nodes m the group spans."""
        return len(self.nodes)


def _ring_links(cluster: Cluster, order: Sequence[int]) -> tuple[float, float]:
    """(min bandwidth Bps, max latency s) over consecutive pairs of `order`, wrap-around included; on a
    node of point-to-point NVLinks, the rings NCCL finds over them instead (`mesh_rings`)."""
    if len(order) < 2:
        return math.inf, 0.0
    if (mesh := _mesh_links(cluster, order)) is not None:
        return mesh_ring(mesh)
    cycle = [*order, order[0]] if len(order) > 2 else order  # two devices: one link, both directions
    links = [cluster.link(a, b) for a, b in pairwise(cycle)]
    return min(link.bandwidth_Bps for link in links), max(link.latency_s for link in links)


def _mesh_links(cluster: Cluster, order: Sequence[int]) -> tuple[tuple[Link, ...], ...] | None:
    """The pairwise links of `order` (in device order) where NCCL searches them for rings: 3..MESH_LIMIT
    devices of one node that has NVLink pair links; else None."""
    if not 3 <= len(order) <= MESH_LIMIT:
        return None
    node = cluster.device(order[0]).node
    pairs = cluster.nodes[node].pair_links
    if not any(p.kind is LinkKind.NVLINK for p in pairs) or any(cluster.device(d).node != node for d in order):
        return None
    local = sorted(order)
    return tuple(tuple(cluster.link(a, b) for b in local) for a in local)


def _alltoall_s_per_B(cluster: Cluster, local: tuple[int, ...], ring_Bps: float) -> float:
    """Seconds per byte sent to each peer for a device of `local` (one node's group devices) to send to
    all the others, one after another: (k - 1) / bandwidth on a uniform fabric; on a node with pair links
    the sum of 1 / link over the peers, for the device for which it is largest (a mesh's ring bandwidth
    sums several rings and is no pairwise rate)."""
    if len(local) < 2:
        return 0.0
    if not cluster.nodes[cluster.device(local[0]).node].pair_links:
        return (len(local) - 1) / ring_Bps
    return max(sum(1.0 / cluster.link(a, b).bandwidth_Bps for b in local if b != a) for a in local)


def _pair_latency_s(cluster: Cluster, local: tuple[int, ...]) -> float:
    """The largest latency between two of `local` (one node's group devices) where the node has pair links
    (a mesh's rings skip its slow pairs, its all-to-all does not); 0 on a uniform fabric."""
    if len(local) < 2 or not cluster.nodes[cluster.device(local[0]).node].pair_links:
        return 0.0
    return max(cluster.link(a, b).latency_s for i, a in enumerate(local) for b in local[i + 1:])


def _group_nodes(cluster: Cluster, devices: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Node -> the group's devices on it; ValueError on an empty group or a repeated device."""
    if not devices:
        raise ValueError("a device group must name at least one device")
    if len(set(devices)) != len(devices):
        repeated = sorted({d for d in devices if devices.count(d) > 1})
        raise ValueError(f"device group repeats devices {repeated}; each device may appear once")
    nodes: dict[int, list[int]] = {}
    for d in devices:
        nodes.setdefault(cluster.device(d).node, []).append(d)
    return {node: tuple(local) for node, local in nodes.items()}


def group_topology(cluster: Cluster, devices: Sequence[int]) -> GroupTopology:
    """Summarise `devices` of `cluster` for the collectives: rings, per-node bottlenecks, network share.

    O(n) link queries: the group's ring, each node's ring over its group devices, and the ring over
    the nodes (any device stands for its node: the per-GPU network share is a property of the node).
    Raises ValueError for an empty group or repeated devices, IndexError for an unknown device.
    """
    nodes = _group_nodes(cluster, devices)
    ring_bw, ring_lat = _ring_links(cluster, devices)
    intra = {node: _ring_links(cluster, local) for node, local in nodes.items()}
    inter_bw, inter_lat = _ring_links(cluster, [local[0] for local in nodes.values()])
    counts = [len(local) for local in nodes.values()]
    return GroupTopology(
        devices=tuple(devices),
        nodes=nodes,
        ring_bandwidth_Bps=ring_bw,
        ring_latency_s=ring_lat,
        intra_bandwidth_Bps={node: bw for node, (bw, _) in intra.items()},
        intra_latency_s={node: lat for node, (_, lat) in intra.items()},
        inter_bandwidth_Bps=inter_bw,
        inter_latency_s=inter_lat,
        k=max(counts),
        k_min=min(counts),
        uniform=min(counts) == max(counts),
        slowest_intra_bandwidth_Bps=min(bw for bw, _ in intra.values()),
        slowest_intra_latency_s=max(lat for _, lat in intra.values()),
        max_latency_s=max(ring_lat, inter_lat, *(lat for _, lat in intra.values()),
                          *(_pair_latency_s(cluster, local) for local in nodes.values())),
        alltoall_intra_s_per_B=max(_alltoall_s_per_B(cluster, nodes[node], bw) for node, (bw, _) in intra.items()),
    )


def _ring(n: int, nbytes: float, bandwidth_Bps: float, latency_s: float, rounds: int) -> tuple[float, float]:
    """A ring reduce-scatter/all-gather (rounds=1) or all-reduce (rounds=2): (time s, bytes sent per rank)."""
    if n < 2:
        return 0.0, 0.0
    sent = rounds * (n - 1) / n * nbytes
    return rounds * (n - 1) * latency_s + sent / bandwidth_Bps, sent


def ring_cost(kind: Collective, topo: GroupTopology, nbytes: float) -> CommCost:
    """Flat ring over the group in its order (all kinds but all-to-all); seconds and bytes sent per device."""
    if kind is Collective.BROADCAST:
        time_s = (topo.size - 1) * topo.ring_latency_s + nbytes / topo.ring_bandwidth_Bps
        return CommCost(time_s, Algorithm.RING, nbytes)
    rounds = 2 if kind is Collective.ALL_REDUCE else 1
    time_s, sent = _ring(topo.size, nbytes, topo.ring_bandwidth_Bps, topo.ring_latency_s, rounds)
    return CommCost(time_s, Algorithm.RING, sent)


def _intra_phase(topo: GroupTopology, nbytes: float) -> tuple[float, float]:
    """One intra-node reduce-scatter or all-gather of `nbytes` on the largest, slowest node."""
    return _ring(topo.k, nbytes, topo.slowest_intra_bandwidth_Bps, topo.slowest_intra_latency_s, 1)


def hierarchical_cost(kind: Collective, topo: GroupTopology, nbytes: float) -> CommCost:
    """Intra reduce-scatter, inter-node ring on 1/k' of the data, intra all-gather (AR, AG, RS only)."""
    intra_s, intra_sent = _intra_phase(topo, nbytes)
    rounds = 2 if kind is Collective.ALL_REDUCE else 1
    share = nbytes / topo.k_min  # each local rank's slice, carried by its own inter-node ring
    inter_s, inter_sent = _ring(topo.num_nodes, share, topo.inter_bandwidth_Bps, topo.inter_latency_s, rounds)
    # all-reduce runs both intra phases (reduce-scatter before, all-gather after); AG and RS one each
    return CommCost(rounds * intra_s + inter_s, Algorithm.HIERARCHICAL, rounds * intra_sent + inter_sent)


def tree_cost(topo: GroupTopology, nbytes: float) -> CommCost:
    """All-reduce: intra phases as hierarchical, double binary tree between nodes (see module docstring)."""
    intra_s, intra_sent = _intra_phase(topo, nbytes)
    inter_sent = 2 * nbytes / topo.k_min
    inter_s = 2 * math.ceil(math.log2(topo.num_nodes)) * topo.inter_latency_s + inter_sent / topo.inter_bandwidth_Bps
    return CommCost(2 * intra_s + inter_s, Algorithm.TREE, 2 * intra_sent + inter_sent)


def all_to_all_cost(topo: GroupTopology, nbytes: float) -> CommCost:
    """Direct all-to-all: intra and inter sends in parallel, plus (n-1) steps of the largest latency."""
    n = topo.size
    per_peer = nbytes / n
    intra_s = per_peer * topo.alltoall_intra_s_per_B
    inter_s = (n - topo.k_min) * per_peer / topo.inter_bandwidth_Bps if topo.num_nodes > 1 else 0.0
    time_s = max(intra_s, inter_s) + (n - 1) * topo.max_latency_s
    return CommCost(time_s, Algorithm.DIRECT, (n - 1) * per_peer)


def bus_bytes(kind: Collective, n: int, nbytes: float) -> float:
    """Bytes each of n ranks sends in the nccl-tests bus-bandwidth convention."""
    if kind is Collective.BROADCAST:
        return nbytes
    factor = 2.0 if kind is Collective.ALL_REDUCE else 1.0
    return factor * (n - 1) / n * nbytes


def bytes_only_cost(kind: Collective, n: int, nbytes: float) -> CommCost:
    """The topology-blind ablation: bus bytes / BYTES_ONLY_BANDWIDTH_Bps seconds, no latency."""
    sent = bus_bytes(kind, n, nbytes)
    return CommCost(sent / BYTES_ONLY_BANDWIDTH_Bps, Algorithm.BYTES_ONLY, sent)


def collective_cost(kind: Collective, topo: GroupTopology, nbytes: float) -> CommCost:
    """The cheapest applicable algorithm for `kind` on `topo`: O(1) arithmetic; seconds and bytes/device."""
    if topo.size == 1 or nbytes == 0:
        return _NOTHING
    if kind is Collective.ALL_TO_ALL:
        return all_to_all_cost(topo, nbytes)
    options = [ring_cost(kind, topo, nbytes)]
    multi_node = topo.num_nodes >= 2
    if multi_node and topo.k >= 2 and kind is not Collective.BROADCAST:
        options.append(hierarchical_cost(kind, topo, nbytes))
    if multi_node and kind is Collective.ALL_REDUCE:
        options.append(tree_cost(topo, nbytes))
    return min(options, key=lambda cost: cost.time_s)  # ties keep the earlier (simpler) algorithm


@dataclass(frozen=True, slots=True)
class PairPlan:
    """Stage-to-stage transfer: `pairs` parallel transfers; the busiest receiver's latency and s/byte."""

    pairs: int
    latency_s: float  # largest latency among the non-local pairs
    s_per_B: float  # max over receivers of the sum of 1/bandwidth over the pairs it receives


def pair_plan(cluster: Cluster, src_group: Sequence[int], dst_group: Sequence[int]) -> PairPlan:
    """Pair src_group[i] -> dst_group[i mod len(dst_group)]; a receiver takes its transfers one by one."""
    if not src_group or not dst_group:
        raise ValueError(f"p2p groups must be non-empty; got {len(src_group)} and {len(dst_group)} devices")
    load: dict[int, float] = {}
    latency_s = 0.0
    for i, src in enumerate(src_group):
        dst = dst_group[i % len(dst_group)]
        if src == dst:
            cluster.device(src)  # validates the index; a device handing data to itself costs nothing
            continue
        link = cluster.link(src, dst)
        load[dst] = load.get(dst, 0.0) + 1.0 / link.bandwidth_Bps
        latency_s = max(latency_s, link.latency_s)
    return PairPlan(len(src_group), latency_s, max(load.values(), default=0.0))


class CommModel:
    """Communication costs on one cluster, with explicit memo tables keyed by the device groups.

    `memo` maps tuple(devices) -> GroupTopology and `pair_memo` (src, dst) -> PairPlan, both shared by
    every model on the same cluster object (`object_memo`: they depend on its links alone); after the
    first call for a group every further call is O(1) arithmetic (plus hashing the key).
    """

    def __init__(self, cluster: Cluster, mode: CommMode = CommMode.TOPOLOGY,
                 collective_overhead_s: Callable[[str], float] | None = None) -> None:
        """`collective_overhead_s(device type)`: seconds every collective call on a group with that
        type pays once, whatever its size (a fitted calibration's; the group pays its largest; not in
        the BYTES_ONLY comparison mode, which costs bytes alone)."""
        self.cluster = cluster
        self.mode = CommMode(mode)
        self._overhead_of = collective_overhead_s
        self._overheads: dict[tuple[int, ...], float] = {}
        self.memo: dict[tuple[int, ...], GroupTopology] = object_memo(cluster, "group_topology")
        self.pair_memo: dict[tuple[tuple[int, ...], tuple[int, ...]], PairPlan] = object_memo(cluster, "pair_plan")

    def topology(self, devices: Sequence[int]) -> GroupTopology:
        """The memoised `group_topology` of `devices` (order matters: it fixes the ring)."""
        key = tuple(devices)
        topo = self.memo.get(key)
        if topo is None:
            topo = self.memo[key] = group_topology(self.cluster, key)
        return topo

    def collective(self, kind: Collective, devices: Sequence[int], nbytes: float) -> CommCost:
        """Time (s) of collective `kind` over `devices` with nccl-tests size `nbytes` (bytes)."""
        _check_bytes(nbytes)
        kind = Collective(kind)
        topo = self.topology(devices)
        if self.mode is CommMode.BYTES_ONLY and topo.size > 1 and nbytes > 0:
            return bytes_only_cost(kind, topo.size, nbytes)
        cost = collective_cost(kind, topo, nbytes)
        if topo.size < 2 or nbytes == 0:
            return cost
        overhead_s = self.collective_overhead_s(tuple(devices))
        return replace(cost, time_s=cost.time_s + overhead_s) if overhead_s else cost

    def collective_overhead_s(self, devices: tuple[int, ...]) -> float:
        """Seconds each collective call on `devices` pays beyond its transfers: the largest overhead
        among the group's device types (0 without a fitted one; memoised per group)."""
        if self._overhead_of is None:
            return 0.0
        hit = self._overheads.get(devices)
        if hit is None:
            names = {self.cluster.devices[d].spec.name for d in devices}
            hit = self._overheads[devices] = max(self._overhead_of(name) for name in names)
        return hit

    def p2p(self, src: int, dst: int, nbytes: float) -> CommCost:
        """Time (s) to send `nbytes` bytes from device `src` to `dst`: latency + nbytes / bandwidth."""
        _check_bytes(nbytes)
        link = self.cluster.link(src, dst)
        if src == dst or nbytes == 0:
            return _NOTHING
        if self.mode is CommMode.BYTES_ONLY:
            return CommCost(nbytes / BYTES_ONLY_BANDWIDTH_Bps, Algorithm.BYTES_ONLY, nbytes)
        return CommCost(link.latency_s + nbytes / link.bandwidth_Bps, Algorithm.P2P, nbytes)

    def p2p_groups(self, src_group: Sequence[int], dst_group: Sequence[int], nbytes: float) -> CommCost:
        """Time (s) to move `nbytes` bytes (in total) of activations from one stage's devices to the next's.

        Rule: src_group[i] sends to dst_group[i mod len(dst_group)], each of the len(src_group) pairs
        carrying nbytes / len(src_group), all pairs at once; a device receiving from several sources
        takes them one after another. Time = largest pair latency + share x the busiest receiver's
        sum of 1/bandwidth (exact when pair latencies are equal, otherwise an upper bound). When the
        destination group is larger, only its first len(src_group) devices receive; spreading the
        data inside the next stage is that stage's own collective. Pairs on one device cost nothing.
        """
        _check_bytes(nbytes)
        key = (tuple(src_group), tuple(dst_group))
        plan = self.pair_memo.get(key)
        if plan is None:
            plan = self.pair_memo[key] = pair_plan(self.cluster, *key)
        share = nbytes / plan.pairs
        if plan.s_per_B == 0 or nbytes == 0:
            return _NOTHING
        if self.mode is CommMode.BYTES_ONLY:
            return CommCost(share / BYTES_ONLY_BANDWIDTH_Bps, Algorithm.BYTES_ONLY, share)
        return CommCost(plan.latency_s + share * plan.s_per_B, Algorithm.P2P, share)


def _check_bytes(nbytes: float) -> None:
    """ValueError unless `nbytes` is a finite, non-negative number of bytes."""
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes must be a finite number of bytes >= 0; got {nbytes!r}")
