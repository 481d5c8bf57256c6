"""The planner: MCTS over the decision process, judged by the simulator, with baselines.

`plan()` searches with an injected prior and evaluator (uniform prior + simulator by default;
the GNN provides another pair), then refines the best plan's tensor-parallel stages with the
intra-stage solver, and reports the Pareto frontier of everything it simulated, the baselines
and, where the space is small enough, the exhaustive optimum.

The value the search maximises is scale-free: T_lb / T, where T_lb is the iteration's model
FLOPs over the sum of the devices' peaks; a plan that does not fit scores 1% of that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tagplan.cost import baselines as base
from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.comm import CommMode
from tagplan.cost.report import Report
from tagplan.cost.simulator import Simulator
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan
from tagplan.ir.workload import Workload
from tagplan.search.exhaustive import exhaustive
from tagplan.search.mcts import Evaluator, Prior, mcts, uniform_prior
from tagplan.search.pareto import frontier
from tagplan.search.refine import refine_sharding
from tagplan.search.result import Baseline, Candidate, Objective, PlanResult, SearchInfo
from tagplan.search.space import PlanSpace, PlanState

INFEASIBLE_FACTOR = 0.01
DEFAULT_TIME_SLACK = 1.25  # memory / GPU objectives accept plans up to 25% slower than the fastest


class SimulatorEvaluator:
    """Evaluator: simulate the plan a terminal state describes; keeps every candidate it saw."""

    def __init__(self, space: PlanSpace) -> None:
        self.space = space
        sim = space.sim
        peak = sum(d.spec.peak_flops(sim.workload.dtype) for d in sim.cluster.devices)
        self.lower_bound_s = 3.0 * sim.workload.global_batch * sim.model.flops_per_sample / peak
        self.candidates: dict[str, Candidate] = {}  # keyed by the plan's JSON (plans with sharding are unhashable)

    def __call__(self, state: PlanState) -> float:
        """T_lb / T for a plan that fits, 1% of it otherwise."""
        plan = self.space.to_plan(state)
        return self.value(self.candidate(plan).report)

    def candidate(self, plan: Plan, source: str = "search") -> Candidate:
        """The simulated candidate for `plan` (each distinct plan simulated once)."""
        key = plan.to_json()
        hit = self.candidates.get(key)
        if hit is None:
            hit = self.candidates[key] = Candidate(plan, self.space.sim.simulate(plan), source)
        return hit

    def value(self, report: Report) -> float:
        """The scale-free value of a report."""
        v = self.lower_bound_s / report.iteration_time_s
        return v if report.fits else v * INFEASIBLE_FACTOR


def plan(model: ModelGraph, cluster: Cluster, workload: Workload, *, objective: Objective = Objective.TIME,
         budget_s: float = 30.0, max_evaluations: int = 400, seed: int = 0, prior: Prior | None = None,
         evaluator: Evaluator | None = None, time_bound_s: float | None = None,
         calibration: Calibration = DEFAULT_CALIBRATION, comm_mode: CommMode = CommMode.TOPOLOGY,
         exhaustive_limit: int = 0, progress: Callable[[int, int], None] | None = None,
         fold: bool = True, prior_factory: Callable[[PlanSpace], Prior] | None = None) -> PlanResult:
    """Search plans of `model` on `cluster` for `workload` and return the best, frontier and baselines.

    `fold=False` disables block folding (every layer costed on its own, no memo between plans):
    an ablation for the benchmark. `prior_factory(space)` builds the search prior (the GNN's);
    whatever guides the search, the returned plans are ranked by the simulator.
    """
    start = time.perf_counter()
    sim = Simulator(model, cluster, workload, calibration=calibration, comm_mode=comm_mode, fold=fold)
    space = PlanSpace(sim, subsets=objective is Objective.GPUS)
    judge = SimulatorEvaluator(space)
    if prior is None and prior_factory is not None:
        prior = prior_factory(space)
    found = mcts(space, PlanState(), prior=prior or uniform_prior, evaluator=evaluator or judge,
                 max_evaluations=max_evaluations, max_wall_s=budget_s, seed=seed, progress=progress)
    for state, _ in found.evaluated:
        judge.candidate(space.to_plan(state))
    baselines = _baselines(sim, judge, exhaustive_limit, space)
    pool = [c for c in judge.candidates.values() if c.report.fits]
    pool += [b.candidate for b in baselines.values() if b.candidate is not None]
    best, notes = _choose(pool, objective, time_bound_s, judge)
    refined, solves, hits = refine_sharding(sim, best.plan)
    if refined is not None:
        better = judge.candidate(refined, "search+intra")
        if better.report.fits and better.report.iteration_time_s < best.report.iteration_time_s:
            best = better
            pool.append(better)
    stats = found.stats
    info = SearchInfo(wall_s=time.perf_counter() - start, evaluations=stats.evaluations, cache_hits=stats.cache_hits,
                      simulations=stats.simulations, stopped_by=stats.stopped_by, intra_solves=solves,
                      intra_cache_hits=hits)
    return PlanResult(best=best, pareto=tuple(frontier(pool)), baselines=baselines, search=info, objective=objective,
                      notes=tuple(notes))


def _baselines(sim: Simulator, judge: SimulatorEvaluator, limit: int, space: PlanSpace) -> dict[str, Baseline]:
    out: dict[str, Baseline] = {}
    for name, build in (("data_parallel", base.data_parallel), ("megatron", base.megatron)):
        b = build(sim)
        cand = judge.candidate(b.plan, name) if b.plan is not None else None
        out[name] = Baseline(name, cand if cand is None or cand.report.fits else None, b.reason or
                             ("" if cand is None or cand.report.fits else "does not fit in memory"))
    if limit > 0:
        found = exhaustive(space, judge, limit=limit)
        if found is None:
            out["exhaustive"] = Baseline("exhaustive", None, f"the space has more than {limit} plans")
        else:
            cand = judge.candidate(space.to_plan(found[0]), "exhaustive")
            out["exhaustive"] = Baseline("exhaustive", cand if cand.report.fits else None,
                                         "" if cand.report.fits else "no plan fits in memory")
    else:
        out["exhaustive"] = Baseline("exhaustive", None, "not requested (exhaustive_limit=0)")
    return out


def _choose(pool: list[Candidate], objective: Objective, bound_s: float | None,
            judge: SimulatorEvaluator) -> tuple[Candidate, list[str]]:
    if not pool:
        fallback = max(judge.candidates.values(), key=lambda c: judge.value(c.report))
        return fallback, ["no plan fits in memory; the best infeasible plan is returned"]
    fastest = min(pool, key=lambda c: c.report.iteration_time_s)
    if objective is Objective.TIME:
        return fastest, []
    bound = bound_s if bound_s is not None else DEFAULT_TIME_SLACK * fastest.report.iteration_time_s
    within = [c for c in pool if c.report.iteration_time_s <= bound] or [fastest]
    if objective is Objective.MEMORY:
        return min(within, key=lambda c: (c.report.peak_memory_bytes, c.report.iteration_time_s)), []
    return min(within, key=lambda c: (c.report.devices_used, c.report.iteration_time_s)), []
