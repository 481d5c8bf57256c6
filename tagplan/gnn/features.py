"""The joint graph: (ModelGraph, Cluster, Workload, Plan) -> a PyG `HeteroData` the GNN reads.

Node types and edge types (TAG's op/device graph at layer granularity):

- ``layer``: one node per layer instance (folded blocks keep one node per instance), `LAYER_DIM`
  features: the layer's share of the model and its shape, then how the plan places it.
- ``device``: one node per device of the cluster, used or not, `DEVICE_DIM` features.
- ``('layer', 'flows', 'layer')``: `model.layer_inputs(i)` -> i, `FLOW_DIM` attributes.
- ``('device', 'link', 'device')``: every ordered pair inside a node, plus a ring across nodes
  (local device i of node n <-> local device i of the next node, wrapping around), so the edge
  count grows with the devices, not their square; `LINK_DIM` attributes.
- ``('layer', 'placed_on', 'device')`` and its reverse ``('device', 'hosts', 'layer')``: each
  layer to every device of its stage, `PLACE_DIM` attributes.
- ``data.graph_attr`` of shape [1, GRAPH_DIM]: plan-wide scalars, among them the closed-form
  estimate of `cost.estimate` (the cost model's per-stage figures composed by formula), which
  the value head corrects.

`LAYER_FEATURES`, `DEVICE_FEATURES`, ... name the columns in order. Every feature is a ratio or
the log of a quantity over a fixed reference (MB, 1e14 FLOP/s, 10 GB/s), so models and clusters
of any size share one scale, and none is a raw device, node or layer index: reordering a
cluster's nodes (with the plan's device ids mapped to match) gives an isomorphic graph, and an
unused device changes no layer feature.
The ring's node order and each node's local order are canonical for the same reason: nodes in
order of first use by the plan, then unused nodes by hardware; devices within a node likewise.

The parts that depend on the model or cluster alone are computed once per object and kept in
an explicit `FeatureCache`; what depends on the plan is vectorised with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch_geometric.data import HeteroData

from tagplan.cost.bounds import lower_bound_s
from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.estimate import Estimate, estimate
from tagplan.cost.memory import FRAMEWORK_OVERHEAD_BYTES, model_state_bytes
from tagplan.cost.simulator import Simulator
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Schedule, check_plan
from tagplan.ir.workload import Workload

LAYER = "layer"
DEVICE = "device"
FLOWS = (LAYER, "flows", LAYER)
LINK = (DEVICE, "link", DEVICE)
PLACED_ON = (LAYER, "placed_on", DEVICE)
HOSTS = (DEVICE, "hosts", LAYER)
NODE_TYPES = (LAYER, DEVICE)
EDGE_TYPES = (FLOWS, LINK, PLACED_ON, HOSTS)

LAYER_FEATURES = (
    # the model alone
    "log1p(1000 * layer forward FLOPs / model forward FLOPs)",
    "log1p(1000 * layer params / model params)",
    "log1p(saved activation bytes / output bytes)",
    "log1p(output bytes / the model's mean layer output bytes)",
    "log1p(output MB per sample)",
    "kind is embedding", "kind is block (any other kind)", "kind is head", "kind is other",
    "relative position i / L",
    "log1p(arithmetic intensity, forward FLOPs per byte read and written)",
    # the plan, from the layer's stage
    "stage index / stages",
    "log2 tp",
    "log2 dp",
    "recompute",
    "ZeRO stage / 3",
    "log1p(samples per replica per micro-batch)",
    "stage layers / L",
    "stage forward FLOPs / model forward FLOPs",
    "log(stage group's FLOP share / its share of the used devices' peak)",
    "log1p(TFLOP per device per micro-batch of the largest replica)",
    # what crosses pipeline cuts (flows edge attributes, summed per layer)
    "log1p(MB received across a stage cut per replica micro-batch)",
    "log1p(MB sent across a stage cut per replica micro-batch)",
    # the cost model's figures of the layer's stage (cost.estimate)
    "log(M * stage forward + backward per micro-batch / estimate)",
    "stage TP communication / stage forward + backward",
    "log1p(stage gradient sync per iteration / estimate)",
)
DEVICE_FEATURES = (
    "log(peak FLOP/s in the workload's dtype / 1e14)",
    "log(memory bytes / 1e10)",
    "log(memory bandwidth B/s / 1e12)",
    "used by the plan",
    "log1p(model-state bytes / memory bytes)  (weights, gradients, optimizer; ZeRO applied)",
    "log1p(state + activations + framework overhead bytes / memory bytes)  (0 when unused)",
    "index of its first stage / stages (-1 when unused)",
    "log(FLOP share per device / peak share among used devices)  (0 when unused)",
    "log2(GPUs in its node)",
    "log(NIC bandwidth per GPU B/s / 1e10)",
    "log(mean bandwidth to the other GPUs of its node B/s / 1e10)",
)
FLOW_FEATURES = ("log1p(MB one replica's micro-batch carries)", "crosses a stage cut")
LINK_FEATURES = ("log(bandwidth B/s / 1e10)", "log10(latency s / 1e-6)", "is network")
PLACE_FEATURES = ("log2 tp", "replica batch share * dp", "replica batch share", "in the first replica",
                  "stage index / stages")
GRAPH_FEATURES = (
    "log2 stages", "log2 micro-batches", "schedule is gpipe", "schedule is 1f1b", "schedule is interleaved_1f1b",
    "log global batch", "log devices used", "log(used devices' peak / all devices' peak)",
    "log(3 * batch * forward FLOPs / used peak, in s)", "log(model params / 1e9)", "log(model seq_len / 1024)",
    # the closed-form estimate of cost.estimate and its parts
    "log(estimate / T_lb)", "log(pipeline / estimate)", "log(M * busiest lane / pipeline)",
    "log1p(p2p per micro-batch / estimate)", "log1p(gradient sync / estimate)",
    "log1p(exposed gradient sync / estimate)", "log1p(optimizer step / estimate)",
)
PRIOR_FEATURE = GRAPH_FEATURES.index("log(estimate / T_lb)")
"""The graph column the value head adds its correction to."""
LAYER_STATIC_DIM = 11
LAYER_STAGE_DIM = 10
LAYER_COST_DIM = 3
LAYER_DIM = len(LAYER_FEATURES)
DEVICE_DIM = len(DEVICE_FEATURES)
FLOW_DIM = len(FLOW_FEATURES)
LINK_DIM = len(LINK_FEATURES)
PLACE_DIM = len(PLACE_FEATURES)
GRAPH_DIM = len(GRAPH_FEATURES)
NODE_DIMS = {LAYER: LAYER_DIM, DEVICE: DEVICE_DIM}
EDGE_DIMS = {FLOWS: FLOW_DIM, LINK: LINK_DIM, PLACED_ON: PLACE_DIM, HOSTS: PLACE_DIM}

KINDS = {"embedding": 0, "head": 2, "other": 3}  # any other block kind (block, encoder, ...) is 1
SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B)
MIN_LATENCY_S = 1e-9  # a device's link to itself has latency 0; the log needs a floor


@dataclass(frozen=True)
class ModelTables:
    """Per-layer arrays of one model (per sample, forward), and its static layer features."""

    static: np.ndarray  # [L, LAYER_STATIC_DIM] float32
    cum_flops: np.ndarray  # [L + 1] prefix sums of forward FLOPs per sample
    cum_params: np.ndarray  # [L + 1] prefix sums of parameters
    cum_saved: np.ndarray  # [L + 1] prefix sums of saved activation bytes per sample
    cum_inputs: np.ndarray  # [L + 1] prefix sums of input bytes per sample (what recomputation keeps)
    flops: np.ndarray  # [L]
    saved: np.ndarray  # [L]
    output: np.ndarray  # [L] output bytes per sample
    flow_src: np.ndarray  # [E] int64
    flow_dst: np.ndarray  # [E] int64


@dataclass(frozen=True)
class ClusterTables:
    """Per-device arrays of one cluster in one dtype, and the intra-node link edges."""

    static: np.ndarray  # [N, 6] float32: log peak, log mem, log mem bw, log2 gpus, log NIC bw, log fabric bw
    peak: np.ndarray  # [N] FLOP/s
    mem: np.ndarray  # [N] bytes
    node: np.ndarray  # [N] node of each device
    local: np.ndarray  # [N] local index inside its node
    nic_per_gpu: np.ndarray  # [N] bytes/s
    node_start: np.ndarray  # [nodes] first device of each node
    node_keys: tuple[tuple[object, ...], ...]  # hardware key of each node (canonical ring order)
    intra_index: np.ndarray  # [2, E] int64
    intra_attr: np.ndarray  # [E, LINK_DIM] float32


class FeatureCache:
    """An explicit memo of the model- and cluster-only parts, keyed by object identity.

    Each entry keeps its object alive and is checked with `is`, so a recycled id never hits.
    At most `size` models and `size` (cluster, dtype) pairs are kept, oldest dropped first.
    """

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise ValueError(f"FeatureCache: size must be >= 1, got {size}")
        self.size = size
        self._models: dict[int, tuple[ModelGraph, ModelTables]] = {}
        self._clusters: dict[tuple[int, str], tuple[Cluster, ClusterTables]] = {}
        self._sims: dict[tuple[int, ...], tuple[tuple[object, ...], Simulator]] = {}

    def model(self, model: ModelGraph) -> ModelTables:
        """The tables of `model`, computed on first use."""
        hit = self._models.get(id(model))
        if hit is None or hit[0] is not model:
            hit = (model, _model_tables(model))
            _put(self._models, id(model), hit, self.size)
        return hit[1]

    def cluster(self, cluster: Cluster, workload: Workload) -> ClusterTables:
        """The tables of `cluster` in the workload's dtype, computed on first use."""
        key = (id(cluster), workload.dtype.value)
        hit = self._clusters.get(key)
        if hit is None or hit[0] is not cluster:
            hit = (cluster, _cluster_tables(cluster, workload))
            _put(self._clusters, key, hit, self.size)
        return hit[1]


    def simulator(self, model: ModelGraph, cluster: Cluster, workload: Workload,
                  calibration: Calibration) -> Simulator:
        """A `Simulator` of the instance (its memo tables shared by every plan featurized with it)."""
        objects = (model, cluster, workload, calibration)
        key = tuple(id(o) for o in objects)
        hit = self._sims.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], objects, strict=True)):
            hit = (objects, Simulator(model, cluster, workload, calibration=calibration))
            _put(self._sims, key, hit, self.size)
        return hit[1]


def _put(table: dict, key: object, value: object, size: int) -> None:
    table.pop(key, None)
    while len(table) >= size:
        table.pop(next(iter(table)))
    table[key] = value


def featurize(model: ModelGraph, cluster: Cluster, workload: Workload, plan: Plan, *,
              cache: FeatureCache | None = None, calibration: Calibration = DEFAULT_CALIBRATION) -> HeteroData:
    """The joint graph of `plan` for `model` on `cluster` (see the module docstring for its parts).

    Raises ValueError when the plan does not cover the model or names devices the cluster lacks.
    Pass a `FeatureCache` to reuse the model and cluster parts across plans. `calibration` is
    the cost model's, whose per-stage figures the analytic features (`cost.estimate`) are made of.
    """
    check_plan(plan, model, cluster)
    cache = cache or FeatureCache(size=1)
    mt, ct = cache.model(model), cache.cluster(cluster, workload)
    placed = _place(plan, model, workload, mt, ct)
    flow = _flow_attr(plan, workload, mt, placed.stage_of_layer)
    est = estimate(cache.simulator(model, cluster, workload, calibration), plan)
    data = HeteroData()
    data[LAYER].x = _tensor(np.concatenate(
        [mt.static, placed.layer, _cut_bytes(mt, flow), _stage_costs(plan, est)[placed.stage_of_layer]], axis=1))
    data[DEVICE].x = _tensor(np.concatenate([ct.static[:, :3], placed.device, ct.static[:, 3:]], axis=1))
    data[FLOWS].edge_index = torch.from_numpy(np.stack([mt.flow_src, mt.flow_dst]))
    data[FLOWS].edge_attr = _tensor(flow)
    ring_index, ring_attr = _ring(cluster, ct, placed.order)
    data[LINK].edge_index = torch.from_numpy(np.concatenate([ct.intra_index, ring_index], axis=1))
    data[LINK].edge_attr = _tensor(np.concatenate([ct.intra_attr, ring_attr]))
    data[PLACED_ON].edge_index = torch.from_numpy(placed.index)
    data[PLACED_ON].edge_attr = _tensor(placed.attr)
    data[HOSTS].edge_index = torch.from_numpy(placed.index[::-1].copy())
    data[HOSTS].edge_attr = data[PLACED_ON].edge_attr
    graph = np.concatenate([_graph_attr(model, workload, plan, ct, placed.used),
                            _estimate_attr(est, lower_bound_s(model, cluster, workload))])
    data.graph_attr = _tensor(graph[None, :])
    return data


def _stage_costs(plan: Plan, est: Estimate) -> np.ndarray:
    """[S, LAYER_COST_DIM]: each stage's share of the estimate, its TP share, its gradient sync."""
    total = max(est.iteration_s, 1e-12)
    stage = np.maximum(est.stage_s, 1e-12)
    return np.column_stack([np.log(plan.micro_batches * stage / total), est.stage_tp_s / stage,
                            np.log1p(est.stage_dp_s / total)])


def _estimate_attr(est: Estimate, lower_bound: float) -> np.ndarray:
    """The graph columns of the closed-form estimate (GRAPH_FEATURES' last seven)."""
    total = max(est.iteration_s, 1e-12)
    return np.array([
        math.log(total / lower_bound), math.log(max(est.pipeline_s, 1e-12) / total),
        math.log(max(est.busy_s, 1e-12) / max(est.pipeline_s, 1e-12)), math.log1p(est.p2p_s / total),
        math.log1p(est.dp_s / total), math.log1p(est.exposed_dp_s / total), math.log1p(est.optimizer_s / total),
    ])


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _model_tables(model: ModelGraph) -> ModelTables:
    """Static layer features: shares of the model's FLOPs and parameters, activation shape, kind, position."""
    n = len(model.layers)
    blocks = [model.block_of(i) for i in range(n)]
    flops = np.array([b.flops for b in blocks])
    params = np.array([b.params for b in blocks], dtype=np.float64)
    saved = np.array([b.saved_bytes for b in blocks])
    output = np.array([b.output_bytes for b in blocks])
    traffic = np.array([sum(op.bytes_read + op.bytes_written for op in b.ops) for b in blocks])
    inputs = [model.layer_inputs(i) for i in range(n)]
    in_bytes = np.array([sum(output[j] for j in ins) for ins in inputs])
    out_floor = np.maximum(output, max(output.max() * 1e-3, 1.0))  # a scalar head output must not explode ratios
    kinds = np.zeros((n, 4))
    kinds[np.arange(n), [KINDS.get(b.kind, 1) for b in blocks]] = 1.0
    static = np.column_stack([
        np.log1p(1000.0 * flops / max(flops.sum(), 1.0)),  # share of the model's forward FLOPs
        np.log1p(1000.0 * params / max(params.sum(), 1.0)),  # share of its parameters
        np.log1p(saved / out_floor),  # activations kept for backward, in outputs
        np.log1p(output / max(output.mean(), 1.0)),  # output size relative to the model's mean
        np.log1p(output / 1e6),  # output MB per sample
        kinds,
        np.arange(n) / n,  # relative depth
        np.log1p(flops / np.maximum(traffic, 1.0)),  # arithmetic intensity, FLOPs per byte
    ])
    src = np.array([j for i in range(n) for j in inputs[i]], dtype=np.int64)
    dst = np.array([i for i in range(n) for _ in inputs[i]], dtype=np.int64)
    return ModelTables(static.astype(np.float32), _prefix(flops), _prefix(params), _prefix(saved), _prefix(in_bytes),
                       flops, saved, output, src, dst)


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values)])


def _cluster_tables(cluster: Cluster, workload: Workload) -> ClusterTables:
    """Per-device hardware features and the links inside each node."""
    nodes = cluster.nodes
    gpus = np.array([node.gpus for node in nodes])
    node = np.repeat(np.arange(len(nodes)), gpus)
    start = np.concatenate([[0], np.cumsum(gpus)[:-1]])
    spec_peak = np.array([nd.device.peak_flops(workload.dtype) for nd in nodes])
    spec_mem = np.array([nd.device.mem_bytes for nd in nodes], dtype=np.float64)
    spec_bw = np.array([nd.device.mem_bandwidth_Bps for nd in nodes])
    nic = np.array([nd.nic_bandwidth_per_gpu_Bps for nd in nodes])
    static = np.column_stack([
        np.log(spec_peak / 1e14), np.log(spec_mem / 1e10), np.log(spec_bw / 1e12), np.log2(gpus), np.log(nic / 1e10),
    ])[node]
    index, attr, fabric = _intra_links(cluster, start)
    static = np.column_stack([static, np.log(fabric / 1e10)])
    keys = tuple((nd.device.name, nd.gpus, nd.fabric.value, nd.fabric_bandwidth_Bps, nd.nics, nd.nic_bandwidth_Bps)
                 for nd in nodes)
    return ClusterTables(static.astype(np.float32), spec_peak[node], spec_mem[node], node,
                         np.arange(len(node)) - start[node], nic[node], start, keys, index, attr)


def _intra_links(cluster: Cluster, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every ordered device pair inside each node, with [log bandwidth, log latency, is_network=0],
    and each device's mean bandwidth to the others of its node (the fabric's, alone in a node).

    GATv2 reads edge attributes only in its attention weights, so a device whose links are all
    alike could not see their bandwidth from the edges: the mean is also a device feature.
    """
    index, attr, fabric = [], [], []
    for n, node in enumerate(cluster.nodes):
        g = node.gpus
        bw = np.full((g, g), node.fabric_bandwidth_Bps)
        lat = np.full((g, g), node.fabric_latency_s)
        for p in node.pair_links:
            bw[p.a, p.b] = bw[p.b, p.a] = p.bandwidth_Bps
            lat[p.a, p.b] = lat[p.b, p.a] = p.latency_s
        a, b = np.nonzero(~np.eye(g, dtype=bool))
        index.append(np.stack([a, b]) + start[n])
        attr.append(_link_attr(bw[a, b], lat[a, b], 0.0))
        fabric.append((bw.sum(axis=1) - bw.diagonal()) / (g - 1) if g > 1 else bw[0])
    return (np.concatenate(index, axis=1).astype(np.int64), np.concatenate(attr).astype(np.float32),
            np.concatenate(fabric))


def _link_attr(bandwidth_Bps: np.ndarray, latency_s: np.ndarray | float, network: float) -> np.ndarray:
    bw = np.asarray(bandwidth_Bps, dtype=np.float64)
    lat = np.broadcast_to(np.maximum(latency_s, MIN_LATENCY_S), bw.shape)
    return np.column_stack([np.log(bw / 1e10), np.log10(lat / 1e-6), np.full(bw.shape, network)])


@dataclass(frozen=True)
class Placement:
    """The plan-dependent parts of the graph."""

    layer: np.ndarray  # [L, LAYER_STAGE_DIM]
    device: np.ndarray  # [N, 5]: used, log1p state / mem, log1p total / mem, stage / S, log load
    index: np.ndarray  # [2, P] placed_on edges
    attr: np.ndarray  # [P, PLACE_DIM]
    stage_of_layer: np.ndarray  # [L]
    order: np.ndarray  # [N] first position of each device in the plan's stage lists; inf if unused
    used: np.ndarray  # [N] bool


def _place(plan: Plan, model: ModelGraph, workload: Workload, mt: ModelTables, ct: ClusterTables) -> Placement:
    """Per stage: the layers' plan features, the devices' memory and load, and the placement edges."""
    n_layers, n_dev, stages = len(model.layers), len(ct.peak), len(plan.stages)
    per_micro = workload.global_batch / plan.micro_batches
    layer = np.zeros((n_layers, LAYER_STAGE_DIM))
    state, total, load = np.zeros(n_dev), np.zeros(n_dev), np.zeros(n_dev)
    stage_feature, order = np.full(n_dev, -1.0), np.full(n_dev, np.inf)
    stage_of_layer = np.zeros(n_layers, dtype=np.int64)
    index, attr = [], []
    groups = _group_loads(plan, mt, ct)
    for s, stage in enumerate(plan.stages):
        start, end = stage.layers
        devs = np.asarray(stage.devices, dtype=np.int64)
        width = stage.tp * stage.cp  # a replica's devices: context parallelism splits its tokens like tp its work
        shares = np.repeat(np.asarray(stage.shares()), width)  # per device, tp-fastest, then cp
        layer[start:end] = _layer_rows(plan, s, workload, mt, groups[stage.devices])
        stage_of_layer[start:end] = s
        new = order[devs] == np.inf
        stage_feature[devs[new]] = s / stages
        order[devs[new]] = np.count_nonzero(order < np.inf) + np.arange(np.count_nonzero(new))
        stage_state, act_per_sample = _memory(plan, s, mt, workload)
        state[devs] += stage_state
        total[devs] += stage_state + act_per_sample * per_micro * shares
        load[devs] += (mt.cum_flops[end] - mt.cum_flops[start]) / max(mt.cum_flops[-1], 1.0) * shares / width
        rows = np.repeat(np.arange(start, end), len(devs))
        index.append(np.stack([rows, np.tile(devs, end - start)]))
        edge = np.column_stack([np.full(len(devs), math.log2(stage.tp)), shares * stage.dp, shares,
                                np.arange(len(devs)) < width, np.full(len(devs), s / stages)])
        attr.append(np.tile(edge, (end - start, 1)))
    used = order < np.inf
    total[used] += FRAMEWORK_OVERHEAD_BYTES
    relative_load = np.log(np.maximum(load, 1e-12) * ct.peak[used].sum() / ct.peak)
    device = np.column_stack([used, np.log1p(state / ct.mem), np.log1p(total / ct.mem), stage_feature,
                              np.where(used, relative_load, 0.0)])
    return Placement(layer.astype(np.float32), device.astype(np.float32), np.concatenate(index, axis=1),
                     np.concatenate(attr).astype(np.float32), stage_of_layer, order, used)


def _layer_rows(plan: Plan, s: int, workload: Workload, mt: ModelTables, group: tuple[float, float]) -> np.ndarray:
    """Plan features of stage `s`'s layers: where it sits, its mesh, memory options, batch and load."""
    stage = plan.stages[s]
    start, end = stage.layers
    per_micro = workload.global_batch / plan.micro_batches
    frac = (mt.cum_flops[end] - mt.cum_flops[start]) / max(mt.cum_flops[-1], 1.0)
    load, speed = group
    recomputed = 0.0 if not stage.recompute else 1.0 if stage.recompute_layers is None else min(
        1.0, stage.recompute_layers / stage.num_layers)  # the share of the stage's layers that recompute
    row = [s / len(plan.stages), math.log2(stage.tp), math.log2(stage.dp), recomputed, stage.zero / 3,
           math.log1p(per_micro / stage.dp), stage.num_layers / len(mt.flops), frac,
           math.log(max(load, 1e-12) / speed)]  # the stage group's share of the FLOPs over its share of the peak
    critical = per_micro * max(stage.shares())  # samples of the largest replica's micro-batch
    work = np.log1p(mt.flops[start:end] * critical / (stage.tp * stage.cp) / 1e12)  # TFLOP per device per micro-batch
    return np.column_stack([np.tile(row, (end - start, 1)), work])


def _group_loads(plan: Plan, mt: ModelTables, ct: ClusterTables) -> dict[tuple[int, ...], tuple[float, float]]:
    """Per device group: (share of the model's FLOPs it runs, share of the used devices' peak it has)."""
    total = max(mt.cum_flops[-1], 1.0)
    loads: dict[tuple[int, ...], float] = {}
    for stage in plan.stages:
        start, end = stage.layers
        loads[stage.devices] = loads.get(stage.devices, 0.0) + (mt.cum_flops[end] - mt.cum_flops[start]) / total
    peaks = {g: float(ct.peak[list(g)].sum()) for g in loads}
    used = sum(peaks.values())
    return {g: (loads[g], peaks[g] / used) for g in loads}


def _memory(plan: Plan, s: int, mt: ModelTables, workload: Workload) -> tuple[float, float]:
    """(model-state bytes per device, activation bytes per device per sample of its micro-batch).

    A cheap proxy of cost.memory: ZeRO divides the state; 1F1B stage s of S holds min(S - s, M)
    micro-batches (GPipe all M); recomputation keeps layer inputs plus one layer's activations.
    """
    stage = plan.stages[s]
    start, end = stage.layers
    params = (mt.cum_params[end] - mt.cum_params[start]) / stage.tp
    state = sum(model_state_bytes(params, workload, zero=stage.zero, dp=stage.dp_cp))
    if stage.recompute:  # a partial recompute: its first layers (after an embedding) keep inputs, the rest all
        cut = end if stage.recompute_layers is None else min(end, start + stage.recompute_layers + (start == 0))
        saved = (mt.cum_inputs[cut] - mt.cum_inputs[start] + mt.cum_saved[end] - mt.cum_saved[cut]
                 + mt.saved[start:cut].max())
    else:
        saved = mt.cum_saved[end] - mt.cum_saved[start]
    stages = len(plan.stages)
    in_flight = plan.micro_batches if plan.schedule is Schedule.GPIPE else min(stages - s, plan.micro_batches)
    return state, saved / (stage.tp * stage.cp) * in_flight


def _flow_attr(plan: Plan, workload: Workload, mt: ModelTables, stage_of_layer: np.ndarray) -> np.ndarray:
    """[log1p MB one replica's micro-batch carries on the edge, crosses a stage boundary]."""
    dps = np.array([s.dp for s in plan.stages])[stage_of_layer[mt.flow_src]]
    per_replica = workload.global_batch / plan.micro_batches / dps
    crosses = stage_of_layer[mt.flow_src] != stage_of_layer[mt.flow_dst]
    return np.column_stack([np.log1p(mt.output[mt.flow_src] * per_replica / 1e6), crosses])


def _cut_bytes(mt: ModelTables, flow: np.ndarray) -> np.ndarray:
    """Per layer: [log1p MB received across a stage cut, log1p MB sent across one], per replica micro-batch.

    The flow edges' attributes reach a layer only through attention (GATv2), and a layer with one
    input has nothing to attend over, so what crosses a pipeline cut is also a layer feature.
    """
    mb = np.expm1(flow[:, 0]) * flow[:, 1]
    cut = np.zeros((len(mt.flops), 2))
    np.add.at(cut[:, 0], mt.flow_dst, mb)
    np.add.at(cut[:, 1], mt.flow_src, mb)
    return np.log1p(cut)


def _ring(cluster: Cluster, ct: ClusterTables, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ring across nodes in canonical order, both directions, with network link attributes."""
    n_nodes = len(ct.node_start)
    if n_nodes < 2:
        return np.zeros((2, 0), dtype=np.int64), np.zeros((0, LINK_DIM), dtype=np.float32)
    first_use = np.full(n_nodes, np.inf)
    np.minimum.at(first_use, ct.node, order)
    ranked = sorted(range(n_nodes), key=lambda n: (first_use[n], ct.node_keys[n]))
    by_node = np.lexsort((ct.local, order, ct.node))  # devices grouped by node, canonical order inside
    rank = np.empty(len(order), dtype=np.int64)
    rank[by_node] = np.arange(len(order)) - ct.node_start[ct.node[by_node]]
    slots = np.full((n_nodes, int(rank.max()) + 1), -1, dtype=np.int64)
    slots[ct.node, rank] = np.arange(len(order))
    seq = np.asarray(ranked)
    hops = 1 if n_nodes == 2 else n_nodes  # two nodes: one hop, else the wrap-around duplicates it
    a, b = slots[seq[:hops]].ravel(), slots[np.roll(seq, -1)[:hops]].ravel()
    keep = (a >= 0) & (b >= 0)
    a, b = a[keep], b[keep]
    bw = np.minimum(ct.nic_per_gpu[a], ct.nic_per_gpu[b]) / cluster.network.oversubscription
    attr = _link_attr(bw, cluster.network.latency_s, 1.0)
    return np.stack([np.concatenate([a, b]), np.concatenate([b, a])]), np.concatenate([attr, attr]).astype(np.float32)


def _graph_attr(model: ModelGraph, workload: Workload, plan: Plan, ct: ClusterTables, used: np.ndarray) -> np.ndarray:
    """Plan-wide scalars: depth, micro-batches, schedule, batch, devices, compute scale."""
    used_peak = ct.peak[used].sum()
    schedule = [float(plan.schedule is s) for s in SCHEDULES]
    ideal_s = 3.0 * workload.global_batch * max(model.flops_per_sample, 1.0) / used_peak
    return np.array([
        math.log2(len(plan.stages)), math.log2(plan.micro_batches), *schedule, math.log(workload.global_batch),
        math.log(used.sum()), math.log(used_peak / ct.peak.sum()),
        math.log(ideal_s),  # seconds at peak on the used devices: how much latencies matter
        math.log(max(model.params, 1) / 1e9), math.log(model.seq_len / 1024),
    ])
