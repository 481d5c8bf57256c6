"""The joint graph folded by symmetry: devices that no k-round message passing can tell apart
become one node that stands for all of them.

A plan's joint graph is dominated by its device side: every layer has a `placed_on` edge to
every device of its stage, so a 64-GPU data-parallel stage of an 80-layer model brings 5,120
edges each way, while its devices mostly come in a few kinds (same hardware, same place in the
plan, same neighbourhood). `fold(data, rounds)` runs `rounds` rounds of colour refinement
(1-WL over the devices' features and their incoming edges with their attributes) and keeps one
representative device per colour class. What a representative receives is grouped by (sender's
class, edge attribute) into one edge with `log_count` = log(number of such neighbours); what a
layer receives from devices likewise. Layers, which differ by their position, stay as they are.

A `PlanGNN` with at most `rounds` rounds of message passing gives the folded graph the outputs of
the full one (up to float rounding; `gnn.inference`), with no retraining:

- after t rounds a device's embedding depends only on its colour after t refinement rounds, so
  the classes after `rounds` rounds hold equal embeddings at every round the network runs, and a
  representative's actual neighbours, grouped by those classes, give its exact messages;
- an attention softmax over a multiset of neighbours is the softmax over their distinct
  (class, attribute) pairs with log(multiplicity) added to the logits, and the weighted sum of
  messages is then the same sum;
- the readout's mean over devices weights each class by its size (`device_count`); its max is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch_geometric.data import HeteroData

from tagplan.gnn.features import DEVICE, EDGE_TYPES, LAYER

EdgeType = tuple[str, str, str]


@dataclass(frozen=True)
class FoldedEdges:
    """One relation of a folded graph."""

    index: np.ndarray
    """[2, E] int64: sender, receiver (device ids are class ids)."""
    attr: np.ndarray
    """[E, D] float32."""
    log_count: np.ndarray
    """[E] float32: log of how many parallel edges of the full graph this one stands for."""


@dataclass(frozen=True)
class FoldedGraph:
    """The joint graph of one plan with its equivalent devices folded (see the module docstring)."""

    layer_x: np.ndarray
    """[L, F_l] float32, as in the full graph."""
    device_x: np.ndarray
    """[K, F_d] float32: one row per device class (its representative's)."""
    device_count: np.ndarray
    """[K] float32: how many devices each class holds."""
    edges: dict[EdgeType, FoldedEdges]
    graph_attr: np.ndarray
    """[G] float32."""


_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_SALTS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03))


def fold(data: HeteroData, rounds: int) -> FoldedGraph:
    """`data` (one graph of `gnn.features.featurize`) with equivalent devices folded.

    `rounds` must be at least the network's rounds of message passing for its outputs to be exact.
    """
    edges = _edges(data)
    colour = _classes(data, edges, rounds)
    _, rep, count = np.unique(colour, return_index=True, return_counts=True)  # colours are 0..K-1
    is_rep = np.zeros(len(colour), dtype=bool)
    is_rep[rep] = True
    folded: dict[EdgeType, FoldedEdges] = {}
    for et, (index, attr, attr_id) in edges.items():
        src, dst = index
        if et[0] == et[2] == LAYER:
            folded[et] = FoldedEdges(index, attr, np.zeros(index.shape[1], dtype=np.float32))
            continue
        if et[2] == DEVICE:  # a class receives what its representative receives
            keep = is_rep[dst]
            src, dst, attr, attr_id = src[keep], colour[dst[keep]], attr[keep], attr_id[keep]
        if et[0] == DEVICE:
            src = colour[src]
        folded[et] = _merge(src, dst, attr, attr_id)
    return FoldedGraph(data[LAYER].x.numpy(), data[DEVICE].x.numpy()[rep], count.astype(np.float32), folded,
                       data.graph_attr.numpy()[0])


def device_classes(data: HeteroData, rounds: int) -> np.ndarray:
    """The class of each device of `data` after `rounds` rounds of refinement (int64 [N], 0..K-1):
    devices of one class have equal embeddings after each of the first `rounds` message-passing rounds."""
    return _classes(data, _edges(data), rounds)


def _classes(data: HeteroData, edges: dict[EdgeType, tuple[np.ndarray, np.ndarray, np.ndarray]],
             rounds: int) -> np.ndarray:
    if rounds < 0:
        raise ValueError(f"fold: rounds must be an integer >= 0, got {rounds}")
    return _refine(data[DEVICE].x.numpy(), edges, int(data[DEVICE].num_nodes), rounds)


def _edges(data: HeteroData) -> dict[EdgeType, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per relation: edge index, attributes and an id per distinct attribute row (none between layers)."""
    edges = {}
    ids: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}  # attribute ids per tensor (hosts shares placed_on's)
    for et in EDGE_TYPES:
        index = data[et].edge_index.numpy()
        attr = data[et].edge_attr.numpy()
        if et[0] == et[2] == LAYER:  # layers are not folded: their edges among themselves stay as they are
            edges[et] = (index, attr, np.zeros(0, dtype=np.int64))
            continue
        key = (data[et].edge_attr.data_ptr(), tuple(attr.shape))
        if key not in ids:
            ids[key] = _rows(attr)
        edges[et] = (index, attr, ids[key])
    return edges


def _refine(x: np.ndarray, edges: dict[EdgeType, tuple[np.ndarray, np.ndarray, np.ndarray]], n_dev: int,
            rounds: int) -> np.ndarray:
    """Each device's colour after `rounds` rounds of refinement (int64 [N], ids 0..K-1).

    Round 0 colours a device by its features and the multiset of (sender, attribute) of its
    incoming edges from layers (each layer is its own class); each further round adds the
    multiset of (sender's colour, attribute) of its incoming edges from devices.
    """
    colour = _rows(x)
    for et, (index, _, attr_id) in edges.items():
        if et[0] == LAYER and et[2] == DEVICE:
            colour = _combine(colour, _multiset(index[0], attr_id, index[1], n_dev))
    device_edges = [(index, attr_id) for et, (index, _, attr_id) in edges.items() if et[0] == et[2] == DEVICE]
    for _ in range(rounds):
        classes = int(colour.max(initial=-1))
        for index, attr_id in device_edges:
            colour = _combine(colour, _multiset(colour[index[0]], attr_id, index[1], n_dev))
        if int(colour.max(initial=-1)) == classes:  # stable: no class split
            break
    return colour


def _rows(array: np.ndarray) -> np.ndarray:
    """An id per row of a 2-D array, equal ids for equal rows (int64 [R], ids 0..distinct-1)."""
    if len(array) == 0:
        return np.zeros(0, dtype=np.int64)
    flat = np.ascontiguousarray(array).view(np.dtype((np.void, array.dtype.itemsize * array.shape[1]))).ravel()
    return np.unique(flat, return_inverse=True)[1].astype(np.int64).ravel()


def _mix(key: np.ndarray, salt: np.uint64) -> np.ndarray:
    """SplitMix64's finaliser of key + salt: a well-spread 64-bit hash of each (uint64) key."""
    with np.errstate(over="ignore"):
        z = (key + salt) & _MASK
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return z ^ (z >> np.uint64(31))


def _multiset(sender: np.ndarray, attr_id: np.ndarray, receiver: np.ndarray, n: int) -> np.ndarray:
    """Per receiver, a 128-bit hash of the multiset of (sender, attribute) pairs it receives ([n, 2] uint64)."""
    key = sender.astype(np.uint64) * np.uint64(int(attr_id.max(initial=0)) + 1) + attr_id.astype(np.uint64)
    out = np.zeros((n, 2), dtype=np.uint64)
    for column, salt in enumerate(_SALTS):
        np.add.at(out[:, column], receiver, _mix(key, salt))  # wraps modulo 2**64: a sum that ignores order
    return out


def _combine(colour: np.ndarray, signature: np.ndarray) -> np.ndarray:
    """New colours: devices equal in old colour and in signature."""
    return _rows(np.column_stack([colour.astype(np.uint64), signature]))


def _merge(src: np.ndarray, dst: np.ndarray, attr: np.ndarray, attr_id: np.ndarray) -> FoldedEdges:
    """Parallel edges (equal endpoints and attributes) as one, with log of their count."""
    if len(src) == 0:
        return FoldedEdges(np.zeros((2, 0), dtype=np.int64), attr, np.zeros(0, dtype=np.float32))
    n_attr = int(attr_id.max()) + 1
    n_dst = int(dst.max()) + 1
    key = (src * n_dst + dst) * n_attr + attr_id
    _, at, counts = np.unique(key, return_index=True, return_counts=True)
    return FoldedEdges(np.stack([src[at], dst[at]]).astype(np.int64), attr[at], np.log(counts).astype(np.float32))
