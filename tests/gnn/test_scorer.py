"""The scorer and the MCTS callables built on it: batching, caching, the value's definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor
from torch_geometric.data import Batch, HeteroData

from tagplan.cost.bounds import lower_bound_s
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.gnn.model import PlanGNN
from tagplan.gnn.scorer import GUIDED_DECISIONS, GNNEvaluator, GNNPrior, GNNScorer
from tagplan.ir import Workload
from tagplan.search.mcts import mcts
from tagplan.search.space import PlanSpace, PlanState

WORKLOAD = Workload(global_batch=8, seq_len=16)




class Counting(PlanGNN):
    """A PlanGNN that counts its forward calls and the graphs each call saw."""

    def __init__(self) -> None:
        super().__init__(hidden=16, layers=1, heads=2)
        self.calls: list[int] = []

    def forward(self, data: HeteroData | Batch) -> tuple[Tensor, Tensor]:
        self.calls.append(int(data.graph_attr.size(0)))
        return super().forward(data)


class Constant(PlanGNN):
    """Predicts log(T / T_lb) = 0.5 and a fit logit of -3 (fit probability 0.047) for every graph."""

    def forward(self, data: HeteroData | Batch) -> tuple[Tensor, Tensor]:
        graphs = data.graph_attr.size(0)
        return torch.full((graphs,), 0.5), torch.full((graphs,), -3.0)


def space() -> PlanSpace:
    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=100", seq_len=16)
    return PlanSpace(Simulator(model, load_cluster("p3.8xlarge+g4dn.12xlarge"), WORKLOAD))


def test_predict_scores_many_plans_in_one_forward() -> None:
    torch.manual_seed(0)
    sp = space()
    net = Counting()
    scorer = GNNScorer(net, folded=False)  # the model's own forward pass, whose calls `Counting` sees
    root = sp.on_every_node()
    plans = [sp.to_plan(sp.complete(sp.step(root, a))) for a in sp.actions(root)]
    log_ratio, fit = scorer.predict(sp.sim.model, sp.sim.cluster, WORKLOAD, plans)
    assert net.calls == [len(plans)] and not net.training
    assert log_ratio.shape == fit.shape == (len(plans),) and log_ratio.dtype == np.float64
    assert ((fit > 0) & (fit < 1)).all()
    times = scorer.predicted_time_s(sp.sim.model, sp.sim.cluster, WORKLOAD, plans)
    assert np.allclose(times, lower_bound_s(sp.sim.model, sp.sim.cluster, WORKLOAD) * np.exp(log_ratio))
    empty = scorer.predict(sp.sim.model, sp.sim.cluster, WORKLOAD, [])
    assert empty[0].shape == (0,) and len(net.calls) == 2  # predicted_time_s: one more call; empty: none
    assert scorer.forward_calls == 2 and scorer.plans_scored == 2 * len(plans) and scorer.predict_s > 0.0


def test_prior_scores_every_action_in_one_batch_and_caches() -> None:
    torch.manual_seed(1)
    sp = space()
    net = Counting()
    prior = GNNPrior(sp, GNNScorer(net, folded=False), fields=None)
    root = sp.on_every_node()
    actions = sp.actions(root)
    scores = prior(root, actions)
    assert len(scores) == len(actions) and all(s >= 0 and math.isfinite(s) for s in scores)
    assert len(net.calls) == 1
    assert prior(root, actions) == scores and len(net.calls) == 1  # every completion is cached
    state = sp.step(root, actions[0])
    prior(state, sp.actions(state))
    assert len(net.calls) <= 2  # at most one more forward for the new completions


def test_prior_and_evaluator_follow_the_definitions() -> None:
    sp = space()
    scorer = GNNScorer(Constant(hidden=8, layers=1, heads=1), folded=False)
    root = sp.on_every_node()
    actions = sp.actions(root)
    fit = 1 / (1 + math.exp(3.0))
    pure = GNNPrior(sp, scorer, uniform_mix=0.0, fields=None)
    assert pure(root, actions) == pytest.approx([fit] * len(actions))  # all equal: all best
    assert GNNEvaluator(sp, scorer)(sp.complete(root)) == pytest.approx(math.exp(-0.5) * 0.01)


def test_the_search_runs_on_the_gnn_callables() -> None:
    torch.manual_seed(2)
    sp = space()
    scorer = GNNScorer(PlanGNN(hidden=16, layers=1, heads=2))
    found = mcts(sp, PlanState(), prior=GNNPrior(sp, scorer), evaluator=GNNEvaluator(sp, scorer),
                 max_evaluations=6, seed=0)
    assert sp.is_terminal(found.best_state) and found.best_value > 0
    sp.to_plan(found.best_state)


class ByStages:
    """A scorer whose predicted log(T / T_lb) is 0.01 per pipeline stage, every plan fitting."""

    def predict(self, model, cluster, workload, plans, *, calibration=None):  # type: ignore[no-untyped-def]
        return np.array([0.01 * len(p.stages) for p in plans]), np.ones(len(plans))


def test_prior_weights_actions_by_their_predicted_slowdown_over_the_temperature() -> None:
    sp = space()
    root = sp.on_every_node()
    actions = sp.actions(root)
    stages = [len(sp.to_plan(sp.complete(sp.step(root, a))).stages) for a in actions]
    assert len(set(stages)) > 1
    for temperature in (0.01, 0.05):
        scores = GNNPrior(sp, ByStages(), temperature=temperature, uniform_mix=0.0)(root, actions)  # type: ignore[arg-type]
        expected = [math.exp(-0.01 * (n - min(stages)) / temperature) for n in stages]
        assert scores == pytest.approx(expected)
    with pytest.raises(ValueError, match="temperature"):
        GNNPrior(sp, ByStages(), temperature=0.0)  # type: ignore[arg-type]


def test_the_prior_keeps_a_uniform_share_and_scores_only_the_pipeline_shape() -> None:
    sp = space()
    root = sp.on_every_node()
    actions = sp.actions(root)
    assert actions[0].field == "stages"
    stages = [len(sp.to_plan(sp.complete(sp.step(root, a))).stages) for a in actions]
    raw = [math.exp(-0.01 * (n - min(stages)) / 0.05) for n in stages]
    mixed = GNNPrior(sp, ByStages(), uniform_mix=0.5)(root, actions)  # type: ignore[arg-type]
    assert mixed == pytest.approx([0.5 * r / sum(raw) + 0.5 / len(raw) for r in raw])
    assert min(mixed) >= 0.5 / len(raw)  # no shape is starved, however slow its default completion
    later = root
    while not sp.is_terminal(later) and sp.actions(later)[0].field in GUIDED_DECISIONS:
        later = sp.step(later, sp.actions(later)[0])
    if sp.is_terminal(later):
        pytest.fail("the decision process ended before any decision the prior leaves alone")
    net = Counting()
    rest = sp.actions(later)
    prior = GNNPrior(sp, GNNScorer(net, folded=False))
    assert prior(later, rest) == [1.0] * len(rest) and net.calls == []  # no forward pass
    with pytest.raises(ValueError, match="uniform_mix"):
        GNNPrior(sp, ByStages(), uniform_mix=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="after_visits"):
        GNNPrior(sp, ByStages(), after_visits=-1)  # type: ignore[arg-type]
