"""Device groups for pipeline stages: whole nodes or equal parts of nodes, never splitting a
tensor-parallel group across nodes.

A partition is a tuple of stages' device tuples, each node-major, so that a stage's replicas
(`tp` consecutive devices) stay inside one node whenever `tp` divides the node's share.
"""

from __future__ import annotations

from itertools import accumulate

from tagplan.ir.cluster import Cluster
from tagplan.ir.workload import DType

Partition = tuple[tuple[int, ...], ...]


def node_parts(cluster: Cluster, parts_per_node: int) -> list[tuple[int, ...]] | None:
    """Each node's devices cut into `parts_per_node` equal parts (None if some node does not divide)."""
    out: list[tuple[int, ...]] = []
    for n, node in enumerate(cluster.nodes):
        if node.gpus % parts_per_node:
            return None
        devices = cluster.node_devices(n)
        size = node.gpus // parts_per_node
        out.extend(devices[i * size:(i + 1) * size] for i in range(parts_per_node))
    return out


def stage_counts(cluster: Cluster, max_stages: int) -> list[int]:
    """Pipeline depths worth trying: divisors of the node count, and node splits for deep pipelines."""
    n = len(cluster.nodes)
    counts = {s for s in range(1, n + 1) if n % s == 0}
    counts |= {n * k for k in (2, 4, 8) if node_parts(cluster, k) is not None}
    counts |= {s for s in range(2, n) if _has_type_boundary_split(cluster, s)}
    return sorted(c for c in counts if c <= max_stages)


def _has_type_boundary_split(cluster: Cluster, stages: int) -> bool:
    types = [node.device.name for node in cluster.nodes]
    runs = sum(1 for i, t in enumerate(types) if i == 0 or t != types[i - 1])
    return runs == stages


def partitions(cluster: Cluster, stages: int, dtype: DType) -> list[Partition]:
    """Candidate assignments of device groups to `stages` stages, most natural first.

    With at least as many nodes as stages: contiguous runs of nodes split evenly by count, by
    compute (so that unequal nodes balance), and along GPU-type boundaries; each also in reverse
    order (which end of the pipeline the fast nodes take matters). With more stages than nodes:
    every node cut into equal parts.
    """
    n = len(cluster.nodes)
    if stages > n:
        parts = node_parts(cluster, stages // n) if stages % n == 0 else None
        return [tuple(parts)] if parts else []
    units = [cluster.node_devices(i) for i in range(n)]
    weights = [node.gpus * node.device.sustained_peak_flops(dtype) for node in cluster.nodes]
    cuts = {_even_cuts(n, stages), _weighted_cuts(weights, stages), _type_cuts(cluster, stages)}
    out: list[Partition] = []
    for order in (list(range(n)), list(reversed(range(n)))):
        for c in sorted(x for x in cuts if x is not None):
            part = _apply(order, c, units)
            if part not in out:
                out.append(part)
    return out


def _apply(order: list[int], cuts: tuple[int, ...], units: list[tuple[int, ...]]) -> Partition:
    bounds = [0, *cuts, len(order)]
    return tuple(tuple(d for i in order[bounds[k]:bounds[k + 1]] for d in units[i]) for k in range(len(bounds) - 1))


def _even_cuts(n: int, stages: int) -> tuple[int, ...]:
    return tuple(n * k // stages for k in range(1, stages))


def _weighted_cuts(weights: list[float], stages: int) -> tuple[int, ...] | None:
    total, cum = sum(weights), list(accumulate(weights))
    cuts: list[int] = []
    for k in range(1, stages):
        target = total * k / stages
        cut = min(range(1, len(weights)), key=lambda i: abs(cum[i - 1] - target))
        cuts.append(max(cut, cuts[-1] + 1 if cuts else 1))
    if cuts and (cuts[-1] >= len(weights) or len(set(cuts)) != len(cuts)):
        return None
    return tuple(cuts)


def _type_cuts(cluster: Cluster, stages: int) -> tuple[int, ...] | None:
    types = [node.device.name for node in cluster.nodes]
    cuts = tuple(i for i in range(1, len(types)) if types[i] != types[i - 1])
    return cuts if len(cuts) == stages - 1 else None


def tp_options(cluster: Cluster, devices: tuple[int, ...]) -> list[int]:
    """Tensor-parallel degrees for a group: powers of two up to 8 that divide every node's share."""
    shares: dict[int, int] = {}
    for d in devices:
        node = cluster.devices[d].node
        shares[node] = shares.get(node, 0) + 1
    return [t for t in (1, 2, 4, 8) if all(s % t == 0 for s in shares.values())]
