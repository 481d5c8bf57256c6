"""PlanGNN on tiny joint graphs: shapes, batching, gradients, size, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch_geometric.data import Batch, HeteroData

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.gnn.features import featurize
from tagplan.gnn.model import PlanGNN, load_checkpoint, parameter_count, save_checkpoint
from tagplan.ir import Plan, Stage, Workload
from tagplan.search.space import PlanSpace, PlanState

WORKLOAD = Workload(global_batch=8, seq_len=16)




def graphs() -> list[HeteroData]:
    """Joint graphs of different sizes: three models (T5's decoder reads two layers), three clusters."""
    out = []
    for model_spec, cluster_spec in (("gpt?layers=2&hidden=64&heads=4&vocab=100", "p3.8xlarge+g4dn.12xlarge"),
                                     ("t5?layers=2&hidden=64&heads=4&vocab=100", "p3.8xlarge"),
                                     ("gpt?layers=2&hidden=64&heads=4&vocab=100", "dgx-a100-80gb")):
        model, cluster = load_model(model_spec, seq_len=16), load_cluster(cluster_spec)
        sp = PlanSpace(Simulator(model, cluster, WORKLOAD))
        for action in sp.actions(sp.on_every_node())[:2]:
            out.append(featurize(model, cluster, WORKLOAD, sp.to_plan(sp.complete(sp.step(PlanState(), action)))))
    return out


def test_outputs_one_value_and_logit_per_graph() -> None:
    torch.manual_seed(0)
    net = PlanGNN(hidden=32, layers=2, heads=4).eval()
    data = graphs()
    value, fit = net(data[0])
    assert value.shape == (1,) and fit.shape == (1,)
    value, fit = net(Batch.from_data_list(data))
    assert value.shape == (len(data),) and fit.shape == (len(data),)
    assert torch.isfinite(value).all() and torch.isfinite(fit).all()


def test_a_batch_equals_single_forwards() -> None:
    torch.manual_seed(1)
    net = PlanGNN().eval()
    data = graphs()
    with torch.no_grad():
        value, fit = net(Batch.from_data_list(data))
        singles = [net(d) for d in data]
    assert torch.allclose(value, torch.cat([v for v, _ in singles]), atol=1e-5)
    assert torch.allclose(fit, torch.cat([f for _, f in singles]), atol=1e-5)


def test_every_parameter_gets_a_gradient() -> None:
    torch.manual_seed(2)
    net = PlanGNN(dropout=0.1).train()
    value, fit = net(Batch.from_data_list(graphs()))
    (value.square().sum() + fit.sum()).backward()
    missing = [name for name, p in net.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_a_single_device_graph_without_links_runs() -> None:
    model, cluster = load_model("gpt?layers=2&hidden=64&heads=4&vocab=100", seq_len=16), load_cluster("p3.8xlarge")
    one = cluster.model_copy(update={"nodes": (cluster.nodes[0].model_copy(update={"gpus": 1, "pair_links": ()}),)})
    plan = Plan(stages=(Stage(layers=(0, 4), devices=(0,)),))
    data = featurize(model, one, WORKLOAD, plan)
    assert data["device", "link", "device"].edge_index.size(1) == 0
    value, fit = PlanGNN().eval()(data)
    assert torch.isfinite(value).all() and torch.isfinite(fit).all()


def test_the_model_is_small() -> None:
    net = PlanGNN()
    assert parameter_count(net) * 4 < 5e6


def test_reset_parameters_and_arguments() -> None:
    torch.manual_seed(3)
    net = PlanGNN(hidden=16, layers=1, heads=2)
    before = [p.detach().clone() for p in net.parameters()]
    net.reset_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    with pytest.raises(ValueError, match="divisible"):
        PlanGNN(hidden=10, heads=4)
    with pytest.raises(TypeError):
        PlanGNN(64)  # type: ignore[misc]  # keyword-only


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(4)
    net = PlanGNN(hidden=32, layers=2, heads=2).eval()
    card = {"metrics": {"kendall_tau": 0.8, "nan_is_allowed": float("nan")}, "splits": ["a", "b"], "ok": True,
            "config": {"held_out": ("t5", "cnn")}}
    path = tmp_path / "model.pt"
    save_checkpoint(net, path, card)
    loaded, loaded_card = load_checkpoint(path)
    assert loaded.config == net.config and not loaded.training
    assert loaded_card["splits"] == ["a", "b"] and loaded_card["metrics"]["kendall_tau"] == 0.8
    batch = Batch.from_data_list(graphs())
    with torch.no_grad():
        for a, b in zip(net(batch), loaded(batch), strict=True):
            assert torch.equal(a, b)
    assert path.stat().st_size < 5e6


def test_checkpoint_rejects_bad_cards_and_files(tmp_path: Path) -> None:
    net = PlanGNN(hidden=8, layers=1, heads=1)
    with pytest.raises(TypeError, match=r"card\.when"):
        save_checkpoint(net, tmp_path / "x.pt", {"when": object()})
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a PlanGNN checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_an_untrained_model_predicts_the_closed_form_estimate_and_learns_its_correction() -> None:
    from tagplan.gnn.features import PRIOR_FEATURE

    torch.manual_seed(5)
    batch = Batch.from_data_list(graphs())
    estimate = batch.graph_attr[:, PRIOR_FEATURE]
    with torch.no_grad():
        value, _ = PlanGNN(hidden=16, layers=1, heads=2).eval()(batch)
        plain, _ = PlanGNN(hidden=16, layers=1, heads=2, prior=False).eval()(batch)
    assert torch.equal(value, estimate)
    assert not torch.allclose(plain, estimate, atol=1e-3)
    net = PlanGNN(hidden=16, layers=1, heads=2)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    target = estimate + 0.1  # the truth is 10% slower than the estimate everywhere
    for _ in range(60):
        loss = (net(batch)[0] - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 1e-3
