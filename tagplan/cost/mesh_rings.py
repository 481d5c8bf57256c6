"""Ring bandwidth inside a node whose GPUs meet over point-to-point NVLinks of unequal count (a mesh).

On an NVSwitch node every GPU reaches every other over the same share of the switch, so a ring in rank
order is as good as any. On a mesh (the DGX-1's hybrid cube mesh: AWS p3.16xlarge, and its quad on
p3.8xlarge; NVLink-bridged pairs) NCCL does not follow rank order: its topology search (NCCL's
`graph/search.cc`) looks for rings over the NVLinks and opens one channel per ring it finds, each
channel a ring in one direction of the links it uses, and splits every collective over the channels.
A GPU with L NVLinks can therefore carry up to L rings (each takes one outgoing and one incoming link
direction), which is where the DGX-1V's all-reduce bus bandwidth of about six links comes from; a ring
in rank order over the hybrid cube mesh would cross the CPU sockets twice.

The model, for a group of 3..`MESH_LIMIT` GPUs of one node:
- if the group's NVLinks close a Hamiltonian cycle, pack such cycles greedily (the widest remaining
  cycle first, its residual bottleneck taken off each of its links; a link of c NVLinks carries c times
  the one-link rate in each direction) and run every packed cycle in both directions: the group's ring
  bandwidth is twice the packed widths' sum;
- else, or where that packing is thinner, one ring: the cycle (over every link, NVLink or not) whose
  slowest link is fastest.
The latency is the largest latency on the links of the cycles used. Larger groups, and two GPUs, keep
the ring in group order (`comm._ring_links`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from itertools import pairwise

from tagplan.ir.cluster import Link, LinkKind

MESH_LIMIT = 8
"""Most GPUs of one group searched for rings: 8 GPUs have 2,520 Hamiltonian cycles, the most a
point-to-point NVLink node has. NVSwitch nodes carry no NVLink pair links (the presets' and the topology
importer's, which reads a matrix whose every pair is NVLinked beyond a GPU's own link count as a switch),
so they are never searched."""

Edge = tuple[int, int]
Cycle = tuple[Edge, ...]


def _cycles(n: int, allowed: Callable[[int, int], bool]) -> list[Cycle]:
    """Every Hamiltonian cycle of the n vertices over `allowed` edges, each once (either direction), as
    its edges (a, b) with a < b."""
    found: list[Cycle] = []
    path = [0]
    seen = [False] * n
    seen[0] = True

    def extend() -> None:
        last = path[-1]
        if len(path) == n:
            if allowed(last, 0) and path[1] < path[-1]:
                ring = [*path, 0]
                found.append(tuple((min(a, b), max(a, b)) for a, b in pairwise(ring)))
            return
        for nxt in range(1, n):
            if not seen[nxt] and allowed(last, nxt):
                seen[nxt] = True
                path.append(nxt)
                extend()
                path.pop()
                seen[nxt] = False

    extend()
    return found


@lru_cache(maxsize=4096)
def mesh_ring(links: tuple[tuple[Link, ...], ...]) -> tuple[float, float]:
    """(ring bandwidth bytes/s, latency s) of a collective's rings over a group whose pairwise links are
    `links` (a symmetric n x n matrix, 3 <= n <= MESH_LIMIT; the diagonal is ignored); see the module."""
    n = len(links)
    if not 3 <= n <= MESH_LIMIT:
        raise ValueError(f"mesh_ring: {n} GPUs; searched for groups of 3..{MESH_LIMIT}")
    nvlink = [[a != b and links[a][b].kind is LinkKind.NVLINK for b in range(n)] for a in range(n)]
    packed = _cycles(n, lambda a, b: nvlink[a][b])
    if packed:
        residual = {edge: links[edge[0]][edge[1]].bandwidth_Bps for cycle in packed for edge in cycle}
        total_Bps, latency_s = 0.0, 0.0
        while True:
            best = max(packed, key=lambda cycle: min(residual[e] for e in cycle))
            width_Bps = min(residual[e] for e in best)
            if width_Bps <= 0.0:
                break
            for edge in best:
                residual[edge] -= width_Bps
            total_Bps += 2.0 * width_Bps
            latency_s = max(latency_s, *(links[a][b].latency_s for a, b in best))
        single = _widest(n, links)  # a ring over slower links too can beat a thin packing
        return (total_Bps, latency_s) if total_Bps >= single[0] else single
    return _widest(n, links)


def _widest(n: int, links: tuple[tuple[Link, ...], ...]) -> tuple[float, float]:
    """(bandwidth, latency) of the one cycle over every link whose slowest link is fastest."""
    best = max(_cycles(n, lambda a, b: a != b), key=lambda cycle: min(links[a][b].bandwidth_Bps for a, b in cycle))
    return min(links[a][b].bandwidth_Bps for a, b in best), max(links[a][b].latency_s for a, b in best)
