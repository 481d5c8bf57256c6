"""The joint graph: shapes, edges that match the IR, and the invariances the GNN relies on."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tagplan.cost.baselines import megatron
from tagplan.cost.bounds import lower_bound_s
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.gnn.features import (
    DEVICE,
    DEVICE_DIM,
    DEVICE_FEATURES,
    EDGE_DIMS,
    EDGE_TYPES,
    FLOWS,
    GRAPH_DIM,
    HOSTS,
    LAYER,
    LAYER_DIM,
    LAYER_FEATURES,
    LINK,
    PLACED_ON,
    FeatureCache,
    featurize,
)
from tagplan.gnn.model import PlanGNN
from tagplan.ir import Cluster, ModelGraph, Plan, Schedule, Stage, Workload
from tagplan.search.planner import SimulatorEvaluator
from tagplan.search.space import PlanSpace

TINY = "gpt?layers=2&hidden=64&heads=4&vocab=100"
WORKLOAD = Workload(global_batch=8, seq_len=16)


DEVICE_USED = DEVICE_FEATURES.index("used by the plan")
DEVICE_STAGE = DEVICE_FEATURES.index("index of its first stage / stages (-1 when unused)")


def tiny_model() -> ModelGraph:
    return load_model(TINY, seq_len=16)


def space(cluster: Cluster, model: ModelGraph | None = None) -> PlanSpace:
    return PlanSpace(Simulator(model or tiny_model(), cluster, WORKLOAD))


def some_plans(sp: PlanSpace) -> list[Plan]:
    """Default completions of every first decision and of every stage-1 device grouping."""
    root = sp.on_every_node()
    states = [sp.complete(sp.step(root, a)) for a in sp.actions(root)]
    two = sp.step(root, next(a for a in sp.actions(root) if a.value == 2))
    states += [sp.complete(sp.step(two, a)) for a in sp.actions(two)[:4]]
    return [sp.to_plan(s) for s in dict.fromkeys(states)]


def pipeline_plan() -> Plan:
    """By hand: embedding + block on the V100 node (tp 2, dp 2), block + head on the T4 node (tp 4)."""
    return Plan(micro_batches=4, schedule=Schedule.ONE_F_ONE_B, stages=(
        Stage(layers=(0, 2), devices=(0, 1, 2, 3), dp=2, tp=2, zero=1),
        Stage(layers=(2, 4), devices=(4, 5, 6, 7), dp=1, tp=4, recompute=True),
    ))


def test_shapes_dtypes_and_edge_counts() -> None:
    model, cluster = tiny_model(), load_cluster("p3.8xlarge+g4dn.12xlarge")
    data = featurize(model, cluster, WORKLOAD, pipeline_plan())
    assert data[LAYER].x.shape == (4, LAYER_DIM) and data[DEVICE].x.shape == (8, DEVICE_DIM)
    assert data.graph_attr.shape == (1, GRAPH_DIM)
    assert set(data.edge_types) == set(EDGE_TYPES)
    for et in EDGE_TYPES:
        assert data[et].edge_index.dtype == torch.long and data[et].edge_attr.dtype == torch.float32
        assert data[et].edge_attr.shape == (data[et].edge_index.size(1), EDGE_DIMS[et])
    for tensor in (data[LAYER].x, data[DEVICE].x, data.graph_attr):
        assert tensor.dtype == torch.float32 and torch.isfinite(tensor).all()
    assert data[FLOWS].edge_index.tolist() == [[0, 1, 2], [1, 2, 3]]
    assert data[FLOWS].edge_attr[:, 1].tolist() == [0.0, 1.0, 0.0]  # only 1 -> 2 crosses the stage cut
    assert data[LINK].edge_index.size(1) == 12 + 12 + 2 * 4  # pairs inside each node + the ring both ways
    assert data[PLACED_ON].edge_index.size(1) == 2 * 4 + 2 * 4
    assert torch.equal(data[HOSTS].edge_index, data[PLACED_ON].edge_index.flip(0))
    assert data[DEVICE].x[:, DEVICE_USED].tolist() == [1.0] * 8  # every device used
    assert len(LAYER_FEATURES) == LAYER_DIM and len(DEVICE_FEATURES) == DEVICE_DIM


def test_link_attributes_match_the_cluster() -> None:
    cluster = load_cluster("p3.8xlarge:nodes=2+g4dn.12xlarge:nodes=2")
    data = featurize(tiny_model(), cluster, WORKLOAD, some_plans(space(cluster))[0])
    index, attr = data[LINK].edge_index, data[LINK].edge_attr
    assert index.size(1) == 4 * 12 + 2 * 4 * 4  # 4 nodes' pairs, a 4-node ring of 4 lanes both ways
    pairs = {tuple(p) for p in index.t().tolist()}
    assert len(pairs) == index.size(1) and all(a != b for a, b in pairs)
    for (a, b), row in zip(index.t().tolist(), attr.tolist(), strict=True):
        link = cluster.link(a, b)
        assert row[0] == pytest.approx(np.log(link.bandwidth_Bps / 1e10), abs=1e-5)
        assert row[1] == pytest.approx(np.log10(link.latency_s / 1e-6), abs=1e-5)
        assert row[2] == float(cluster.devices[a].node != cluster.devices[b].node)


def test_lower_bound_is_the_planners() -> None:
    cluster = load_cluster("p3.8xlarge+g4dn.12xlarge")
    sp = space(cluster)
    assert lower_bound_s(sp.sim.model, cluster, WORKLOAD) == pytest.approx(SimulatorEvaluator(sp).lower_bound_s)


def test_plan_features_follow_the_stage() -> None:
    data = featurize(tiny_model(), load_cluster("p3.8xlarge+g4dn.12xlarge"), WORKLOAD, pipeline_plan())
    x = data[LAYER].x
    tp, recompute = LAYER_FEATURES.index("log2 tp"), LAYER_FEATURES.index("recompute")
    assert x[:, tp].tolist() == [1.0, 1.0, 2.0, 2.0] and x[:, recompute].tolist() == [0.0, 0.0, 1.0, 1.0]
    cut = [LAYER_FEATURES.index(f"log1p(MB {d} across a stage cut per replica micro-batch)")
           for d in ("received", "sent")]
    received, sent = x[:, cut].t().tolist()
    assert received[2] > 0 and sent[1] > 0 and received[:2] == [0.0, 0.0] and sent[2:] == [0.0, 0.0]
    assert data[DEVICE].x[:, DEVICE_STAGE].tolist() == [0.0] * 4 + [0.5] * 4
    first_replica = data[PLACED_ON].edge_attr[:, 3].view(4, 4)  # 4 layers x 4 devices each
    assert first_replica[0].tolist() == [1.0, 1.0, 0.0, 0.0] and first_replica[3].tolist() == [1.0] * 4


def permuted(cluster: Cluster, order: list[int]) -> tuple[Cluster, dict[int, int]]:
    """The cluster with its nodes in `order`, and the map old device id -> new device id."""
    nodes = [cluster.nodes[n] for n in order]
    new = cluster.model_copy(update={"nodes": tuple(nodes), "name": cluster.name + "-permuted"})
    starts = np.cumsum([0] + [n.gpus for n in nodes])
    mapping = {d.index: int(starts[order.index(d.node)]) + d.local for d in cluster.devices}
    return new, mapping


def remap(plan: Plan, mapping: dict[int, int]) -> Plan:
    stages = tuple(s.model_copy(update={"devices": tuple(mapping[d] for d in s.devices)}) for s in plan.stages)
    return plan.model_copy(update={"stages": stages})


@pytest.mark.parametrize(("spec", "order"), [
    ("p3.8xlarge+g4dn.12xlarge", [1, 0]),
    ("p3.8xlarge:nodes=2+g4dn.12xlarge:nodes=2", [3, 0, 2, 1]),
])
def test_reordering_nodes_changes_no_prediction(spec: str, order: list[int]) -> None:
    torch.manual_seed(0)
    net = PlanGNN().eval()
    cluster = load_cluster(spec)
    other, mapping = permuted(cluster, order)
    model = tiny_model()
    for plan in some_plans(space(cluster, model)):
        a = featurize(model, cluster, WORKLOAD, plan)
        b = featurize(model, other, WORKLOAD, remap(plan, mapping))
        assert torch.equal(a[LAYER].x, b[LAYER].x)
        perm = torch.tensor([mapping[i] for i in range(cluster.num_devices)])
        assert torch.equal(a[DEVICE].x, b[DEVICE].x[perm])
        with torch.no_grad():
            (va, fa), (vb, fb) = net(a), net(b)
        assert abs(float(va - vb)) < 1e-4 and abs(float(fa - fb)) < 1e-4


def test_an_unused_device_or_node_changes_no_layer_feature() -> None:
    cluster = load_cluster("p3.8xlarge+g4dn.12xlarge")
    model = tiny_model()
    wider = cluster.model_copy(update={"nodes": (*cluster.nodes[:-1],
                                                 cluster.nodes[-1].model_copy(update={"gpus": 5}))})
    more = cluster.model_copy(update={"nodes": (*cluster.nodes, cluster.nodes[0])})
    for plan in [*some_plans(space(cluster, model)), pipeline_plan()]:
        base = featurize(model, cluster, WORKLOAD, plan)
        for bigger in (wider, more):
            data = featurize(model, bigger, WORKLOAD, plan)
            assert torch.equal(base[LAYER].x, data[LAYER].x)
            assert data[DEVICE].x[cluster.num_devices:, DEVICE_USED].tolist() == [0.0] * (bigger.num_devices - 8)


def test_cache_gives_the_same_graph_and_plans_are_checked() -> None:
    model, cluster = tiny_model(), load_cluster("p3.8xlarge+g4dn.12xlarge")
    cache = FeatureCache(size=2)
    plan = pipeline_plan()
    a, b = featurize(model, cluster, WORKLOAD, plan, cache=cache), featurize(model, cluster, WORKLOAD, plan)
    for key in (LAYER, DEVICE):
        assert torch.equal(a[key].x, b[key].x)
    assert cache.model(model) is cache.model(model)
    small = load_cluster("p3.8xlarge")
    with pytest.raises(ValueError, match="not in cluster"):
        featurize(model, small, WORKLOAD, plan, cache=cache)


def test_interleaved_plans_reuse_device_groups() -> None:
    cluster = load_cluster("p3.8xlarge+g4dn.12xlarge")
    model = load_model("gpt?layers=6&hidden=64&heads=4&vocab=100", seq_len=16)
    groups = ((0, 1, 2, 3), (4, 5, 6, 7))
    bounds = [(0, 2), (2, 4), (4, 6), (6, 8)]
    plan = Plan(micro_batches=4, schedule=Schedule.INTERLEAVED_1F1B, stages=tuple(
        Stage(layers=b, devices=groups[i % 2], dp=1, tp=4) for i, b in enumerate(bounds)))
    data = featurize(model, cluster, WORKLOAD, plan)
    assert data[PLACED_ON].edge_index.size(1) == 8 * 4
    assert data[DEVICE].x[:, DEVICE_STAGE].tolist() == [0.0] * 4 + [0.25] * 4  # the first stage each serves


def test_featurize_speed_on_gpt3_over_1024_gpus() -> None:
    """Loose measurement only (printed with -s); the budget is ~50 ms, benchmarks live in bench/."""
    model, cluster = load_model("gpt3-175b"), load_cluster("dgx-a100-80gb:nodes=128")
    workload = Workload(global_batch=1536, seq_len=2048)
    plan = megatron(Simulator(model, cluster, workload)).plan
    assert plan is not None
    cache = FeatureCache()
    start = time.perf_counter()
    featurize(model, cluster, workload, plan, cache=cache)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    data = featurize(model, cluster, workload, plan, cache=cache)
    warm = time.perf_counter() - start
    print(f"featurize gpt3-175b on 1024 GPUs: {cold * 1e3:.1f} ms cold, {warm * 1e3:.1f} ms cached")
    assert data[LAYER].x.shape == (98, LAYER_DIM) and data[DEVICE].x.shape == (1024, DEVICE_DIM)
    assert data[LINK].edge_index.size(1) < 16 * 1024  # O(devices), not all pairs
