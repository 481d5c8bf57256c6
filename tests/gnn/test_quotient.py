"""Folding the joint graph by symmetry and the fused forward pass: the same predictions as
PlanGNN's own forward on the full graph, with fewer device nodes and edges."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch_geometric.data import Batch, HeteroData

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.gnn.features import DEVICE, HOSTS, NODE_TYPES, PLACED_ON, featurize
from tagplan.gnn.inference import FastForward
from tagplan.gnn.model import PlanGNN
from tagplan.gnn.quotient import device_classes, fold
from tagplan.gnn.scorer import GNNScorer
from tagplan.ir import Plan, Schedule, Stage, Workload
from tagplan.search.space import PlanSpace, PlanState

WORKLOAD = Workload(global_batch=16, seq_len=16)
MODEL = "gpt?layers=4&hidden=64&heads=4&vocab=100"
CLUSTERS = ("dgx-a100-80gb:nodes=2", "dgx-a100-80gb+p3.8xlarge+g4dn.12xlarge", "p3.8xlarge:nodes=3+g4dn.12xlarge")


def random_net(layers: int = 3, seed: int = 0) -> PlanGNN:
    """A PlanGNN whose every weight is random (the value head too, which starts at zero), so that
    attention, norms and both heads all shape the output."""
    torch.manual_seed(seed)
    net = PlanGNN(hidden=32, layers=layers, heads=2)
    with torch.no_grad():
        for p in net.parameters():
            nn.init.normal_(p, std=0.4)
    return net.eval()


def walked_plans(cluster_spec: str, count: int, seed: int) -> tuple[list[HeteroData], list[Plan]]:
    """Joint graphs of default completions and random walks of the decision process."""
    model, cluster = load_model(MODEL, seq_len=16), load_cluster(cluster_spec)
    sp = PlanSpace(Simulator(model, cluster, WORKLOAD))
    plans = [sp.to_plan(sp.complete(sp.step(PlanState(), a))) for a in sp.actions(PlanState())[:2]]
    rng = random.Random(seed)
    while len(plans) < count:
        state = PlanState()
        while not sp.is_terminal(state):
            state = sp.step(state, rng.choice(sp.actions(state)))
        plans.append(sp.to_plan(state))
    return [featurize(model, cluster, WORKLOAD, p) for p in plans], plans


@pytest.mark.parametrize("cluster_spec", CLUSTERS)
def test_folded_graphs_give_the_full_graphs_predictions(cluster_spec: str) -> None:
    net = random_net()
    graphs, _ = walked_plans(cluster_spec, 6, seed=len(cluster_spec))
    with torch.no_grad():
        full_value, full_fit = net(Batch.from_data_list(graphs))
    fast_value, fast_fit = FastForward(net)([fold(g, rounds=3) for g in graphs])
    assert full_value.std() > 1e-3  # the plans differ, so a wrong fold could not match by accident
    assert torch.allclose(fast_value, full_value, atol=1e-4, rtol=1e-4)
    assert torch.allclose(fast_fit, full_fit, atol=1e-4, rtol=1e-4)


def device_embeddings(net: PlanGNN, data: HeteroData) -> list[torch.Tensor]:
    """The device embeddings after each round of PlanGNN's own message passing on the full graph."""
    with torch.no_grad():
        x = {t: net.encoders[t](data[t].x) for t in NODE_TYPES}
        out = [x[DEVICE]]
        for conv, norms in zip(net.convs, net.norms, strict=True):
            messages = conv(x, data.edge_index_dict, edge_attr_dict=data.edge_attr_dict)
            x = {t: net._update(norms[t], x[t], messages.get(t)) for t in NODE_TYPES}  # type: ignore[index]
            out.append(x[DEVICE])
    return out


def spread_within_classes(embeddings: torch.Tensor, classes: np.ndarray) -> float:
    """The largest difference between the embeddings of two devices of one class."""
    labels = torch.from_numpy(classes)
    return max(float((embeddings[labels == k] - embeddings[labels == k][0]).abs().max())
               for k in range(int(classes.max()) + 1))


def test_each_class_holds_equal_embeddings_at_every_round_and_fewer_rounds_do_not_suffice() -> None:
    net = random_net(layers=3, seed=3)
    graphs, _ = walked_plans("p3.8xlarge:nodes=3+g4dn.12xlarge", 8, seed=5)
    short, folding = 0.0, 0
    for graph in graphs:
        rounds = device_embeddings(net, graph)
        classes = device_classes(graph, 3)
        assert all(spread_within_classes(h, classes) < 1e-5 for h in rounds)
        folding += len(np.unique(classes)) < graph[DEVICE].num_nodes
        short = max(short, spread_within_classes(rounds[-1], device_classes(graph, 1)))
    assert folding >= 2  # classes with several devices, whose embeddings were compared
    assert short > 1e-4  # one round of refinement merges devices the third round tells apart (rounding: < 1e-6)
    with torch.no_grad():
        full, _ = net(Batch.from_data_list(graphs))
    more, _ = FastForward(net)([fold(g, rounds=6) for g in graphs])  # more rounds than needed change nothing
    assert torch.allclose(more, full, atol=1e-4, rtol=1e-4)


def symmetric_plan() -> tuple[HeteroData, Plan]:
    """Data parallelism over two identical 8-GPU nodes."""
    model, cluster = load_model(MODEL, seq_len=16), load_cluster("dgx-a100-80gb:nodes=2")
    plan = Plan(micro_batches=1, schedule=Schedule.ONE_F_ONE_B,
                stages=(Stage(layers=(0, len(model.layers)), devices=tuple(range(16)), dp=16),))
    return featurize(model, cluster, WORKLOAD, plan), plan


def test_symmetric_devices_fold_into_few_classes_that_keep_their_counts() -> None:
    graph, _ = symmetric_plan()
    folded = fold(graph, rounds=3)
    # the first replica's device is marked, so its node and the ring partner in the other node split off
    assert 2 <= len(folded.device_x) <= 4
    assert folded.device_count.sum() == 16
    for et in (PLACED_ON, HOSTS):
        full = graph[et].edge_index.shape[1]
        assert folded.edges[et].index.shape[1] < full / 2
    hosts = folded.edges[HOSTS]
    assert np.exp(hosts.log_count.astype(np.float64)).sum() == pytest.approx(graph[HOSTS].edge_index.shape[1])
    for cls in range(len(folded.device_x)):  # each class is the devices of one feature row
        rows = graph[DEVICE].x.numpy() == folded.device_x[cls]
        assert rows.all(axis=1).sum() >= folded.device_count[cls]


def test_scorer_predicts_the_same_folded_or_not() -> None:
    net = random_net(seed=4)
    _, plans = walked_plans("dgx-a100-80gb+p3.8xlarge+g4dn.12xlarge", 5, seed=9)
    model, cluster = load_model(MODEL, seq_len=16), load_cluster("dgx-a100-80gb+p3.8xlarge+g4dn.12xlarge")
    fast = GNNScorer(net).predict(model, cluster, WORKLOAD, plans)
    slow = GNNScorer(net, folded=False).predict(model, cluster, WORKLOAD, plans)
    assert np.allclose(fast[0], slow[0], atol=1e-4) and np.allclose(fast[1], slow[1], atol=1e-4)


def test_bad_arguments_are_refused() -> None:
    graph, _ = symmetric_plan()
    with pytest.raises(ValueError, match="rounds"):
        fold(graph, rounds=-1)
    net = random_net()
    conv = net.convs[0].convs[PLACED_ON]  # type: ignore[index]
    conv.concat = False  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="FastForward"):
        FastForward(net)
    meta = random_net().to("meta")  # any device but the CPU
    with pytest.raises(ValueError, match=r"FastForward: runs on the CPU; .*\['meta'\]"):
        FastForward(meta)
    assert GNNScorer(meta)._fast is None  # the default keeps the model's own forward off the CPU
