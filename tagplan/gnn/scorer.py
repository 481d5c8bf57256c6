"""The GNN as the search's callables: a batched scorer, an MCTS `Prior` and an `Evaluator`.

`GNNScorer` featurizes many candidate plans, folds each graph's equivalent devices
(`gnn.quotient`, exact) and predicts them in one fused forward pass (`gnn.inference`). `GNNPrior`
scores each action by the plan its default-policy completion reaches; `GNNEvaluator` values a
terminal state by the predicted T_lb / T. Both memoise per terminal state (an explicit table).
The planner keeps the simulator for the final ranking; these make the search cheaper to guide.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch_geometric.data import Batch

from tagplan.cost.bounds import INFEASIBLE_FACTOR, lower_bound_s
from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.gnn.features import FeatureCache, featurize
from tagplan.gnn.inference import FastForward
from tagplan.gnn.model import PlanGNN
from tagplan.gnn.quotient import fold
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan
from tagplan.ir.workload import Workload
from tagplan.search.space import Action, PlanSpace, PlanState

FIT_THRESHOLD = 0.5
"""A plan whose predicted fit probability is below this is treated as not fitting."""


class GNNScorer:
    """Predicts log(T / T_lb) and the fit probability of candidate plans with a `PlanGNN`.

    With `folded` each plan's graph is folded by symmetry (`gnn.quotient`) and run through
    `gnn.inference.FastForward`, on the CPU: the same predictions as the model's own forward pass
    (`folded=False`, on the model's device), several times faster on small batches. The default
    folds a plain `PlanGNN` on the CPU (a subclass may override `forward`). FastForward stacks the
    message-passing weights when the scorer is built: build a new scorer after changing them.
    """

    def __init__(self, model: PlanGNN, *, cache: FeatureCache | None = None, folded: bool | None = None) -> None:
        self.model = model
        self.cache = cache or FeatureCache()
        self.forward_calls = 0
        self.plans_scored = 0
        """Plans predicted so far, over every call."""
        self.predict_s = 0.0
        """Seconds spent in `predict` so far (featurizing, folding, the forward pass)."""
        if folded is None:  # FastForward computes PlanGNN's own forward, on the CPU
            folded = type(model).forward is PlanGNN.forward and all(p.device.type == "cpu" for p in model.parameters())
        self._fast = FastForward(model) if folded else None

    def predict(self, model_graph: ModelGraph, cluster: Cluster, workload: Workload, plans: Sequence[Plan], *,
                calibration: Calibration = DEFAULT_CALIBRATION) -> tuple[np.ndarray, np.ndarray]:
        """(log_ratio [B], fit_prob [B]) as float64 arrays, from one batched forward pass.

        log_ratio estimates log(T / T_lb) (T_lb from `cost.bounds.lower_bound_s`); fit_prob is the
        probability that the plan fits in every device's memory. `calibration` is the cost
        model's, whose per-stage figures the features include.
        """
        if not plans:
            return np.zeros(0), np.zeros(0)
        start = time.perf_counter()
        graphs = [featurize(model_graph, cluster, workload, p, cache=self.cache, calibration=calibration)
                  for p in plans]
        if self._fast is not None:
            rounds = len(self._fast.rounds)
            value, fit_logit = self._fast([fold(g, rounds) for g in graphs])
        else:
            batch = Batch.from_data_list(graphs)
            device = next(self.model.parameters()).device
            self.model.eval()
            with torch.no_grad():
                value, fit_logit = self.model(batch.to(device))
        self.forward_calls += 1
        self.plans_scored += len(plans)
        out = value.double().cpu().numpy(), torch.sigmoid(fit_logit).double().cpu().numpy()
        self.predict_s += time.perf_counter() - start
        return out

    def predicted_time_s(self, model_graph: ModelGraph, cluster: Cluster, workload: Workload, plans: Sequence[Plan],
                         *, calibration: Calibration = DEFAULT_CALIBRATION) -> np.ndarray:
        """Predicted iteration time of each plan, in seconds: T_lb * exp(log_ratio)."""
        log_ratio, _ = self.predict(model_graph, cluster, workload, plans, calibration=calibration)
        return lower_bound_s(model_graph, cluster, workload) * np.exp(log_ratio)


class _Scored:
    """Predictions for terminal states of one space, memoised per state."""

    def __init__(self, space: PlanSpace, scorer: GNNScorer) -> None:
        self.space, self.scorer = space, scorer
        self.table: dict[PlanState, tuple[float, float]] = {}

    def predict(self, terminals: Sequence[PlanState]) -> list[tuple[float, float]]:
        """(log_ratio, fit_prob) of each terminal state; the unseen ones in one batch."""
        missing = list(dict.fromkeys(s for s in terminals if s not in self.table))
        if missing:
            sim = self.space.sim
            plans = [self.space.to_plan(s) for s in missing]
            log_ratio, fit = self.scorer.predict(sim.model, sim.cluster, sim.workload, plans,
                                                 calibration=sim.calibration)
            self.table.update(zip(missing, zip(log_ratio.tolist(), fit.tolist(), strict=True), strict=True))
        return [self.table[s] for s in terminals]


PRIOR_TEMPERATURE = 0.05
"""Width of the prior in log-time: an action whose completion is predicted 5% slower than another's
gets about 1/e of its weight. Plans of one search mostly differ by percents, so the plain T_lb / T
(temperature 1) would leave the prior nearly uniform."""

GUIDED_DECISIONS: frozenset[str] = frozenset({"nodes", "stages", "groups"})
"""The decisions the learned prior scores: the pipeline's shape (which nodes, how many stages, which
devices each stage gets). A prior call over two or three candidates (featurizing, folding, the fused
forward pass) costs 5-15 ms on a CPU core, several simulations' worth (bench/planner.py, guidance),
so the prior is spent where one choice settles a whole region of plans and a handful of calls serve
a search; the later decisions (tensor-parallel degrees, layer boundaries, micro-batches, memory) are
left to the evaluations, which compare their plans exactly. Scoring the tensor-parallel degrees too
cut the evaluations of the first five guidance cases (e.g. 195 to 99, 687 to 469) but not their
wall-clock (geometric mean 0.97x against 1.42x without, in one run of each)."""

PRIOR_AFTER_VISITS = 3
"""The search asks the GNN prior about a node once the node has this many visits (`mcts.DeferredPrior`).
Most shape nodes are visited once or twice; they cost no forward pass. Chosen on the first five
guidance cases of bench/planner.py with the folded, fused forward pass: 1, 2, 3, 4 and 6 tried;
from 3 up the searches reach the best known plan in the same evaluations (507, 80, 687, 195, 460),
and at 2 the RTX 4090 case needs 545 instead of 195."""

UNIFORM_MIX = 0.5
"""The share of every scored prior that is uniform: P = (1 - mix) P_gnn + mix / n. The prior rates
an action by one default completion, which may be far from the best plan below it (a node set whose
balanced completion is poor can hold the best plan); without a floor, PUCT would then almost never
revisit it (AlphaZero mixes noise into its root prior for the same reason). Chosen on five guidance
cases of bench/planner.py (0, 0.25 and 0.5 tried) and reported on ten."""


class GNNPrior:
    """MCTS Prior: each action scored by the predicted time of its default completion.

    score = exp(-(log_ratio - best log_ratio) / temperature), times fit_prob when the plan is
    predicted not to fit; then normalised and mixed with a uniform share `uniform_mix` (see
    `UNIFORM_MIX`). Only decisions in `fields` are scored (None: every decision); the others get a
    uniform prior without a forward pass. `after_visits` tells the search to ask only about nodes it
    has visited that often (`PRIOR_AFTER_VISITS`). All of a call's unseen completions go through one
    forward pass.
    """

    def __init__(self, space: PlanSpace, scorer: GNNScorer, *, temperature: float = PRIOR_TEMPERATURE,
                 fields: frozenset[str] | None = GUIDED_DECISIONS, uniform_mix: float = UNIFORM_MIX,
                 after_visits: int = PRIOR_AFTER_VISITS) -> None:
        if not temperature > 0.0:
            raise ValueError(f"GNNPrior: temperature must be > 0, got {temperature}")
        if not 0.0 <= uniform_mix <= 1.0:
            raise ValueError(f"GNNPrior: uniform_mix must be in [0, 1], got {uniform_mix}")
        if after_visits < 0:
            raise ValueError(f"GNNPrior: after_visits must be an integer >= 0, got {after_visits}")
        self.space, self.temperature, self.fields, self.uniform_mix = space, temperature, fields, uniform_mix
        self.after_visits = after_visits
        self.scorer = scorer
        self._scored = _Scored(space, scorer)

    def __call__(self, state: PlanState, actions: Sequence[Action], /) -> list[float]:
        """One non-negative score per action, in the order of `actions`."""
        if not actions:
            return []
        if self.fields is not None and actions[0].field not in self.fields:
            return [1.0] * len(actions)
        terminals = [self.space.complete(self.space.step(state, a)) for a in actions]
        scored = self._scored.predict(terminals)
        best = min(log_ratio for log_ratio, _ in scored)
        scores = [_value((log_ratio - best) / self.temperature) * (fit if fit < FIT_THRESHOLD else 1.0)
                  for log_ratio, fit in scored]
        total = sum(scores)
        if self.uniform_mix == 0.0 or not total > 0.0:
            return scores
        return [(1.0 - self.uniform_mix) * s / total + self.uniform_mix / len(scores) for s in scores]


class GNNEvaluator:
    """MCTS Evaluator: predicted T_lb / T of a terminal state, 1% of it when predicted not to fit."""

    def __init__(self, space: PlanSpace, scorer: GNNScorer) -> None:
        self.space = space
        self._scored = _Scored(space, scorer)

    def __call__(self, state: PlanState, /) -> float:
        """The scale-free value of the terminal `state`, higher is better."""
        (log_ratio, fit), = self._scored.predict([state])
        return _value(log_ratio) * (1.0 if fit >= FIT_THRESHOLD else INFEASIBLE_FACTOR)


def _value(log_ratio: float) -> float:
    """exp(-log_ratio), clipped so an untrained or extrapolating model cannot overflow."""
    return float(np.exp(-np.clip(log_ratio, -50.0, 50.0)))
