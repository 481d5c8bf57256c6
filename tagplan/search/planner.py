"""The planner: MCTS over the decision process, judged by the simulator, with baselines.

`plan(problem)` searches with an injected prior (uniform by default; the GNN provides another)
and the simulator as evaluator, then refines the best plan's tensor-parallel stages with the
intra-stage solver, and reports the Pareto frontier of everything it simulated, the baselines
and, where the space is small enough, the exhaustive optimum. The best plan is simulated once
more with its task times recorded, so callers draw its timeline without simulating again.

The value the search maximises is scale-free: T_lb / T, where T_lb is the iteration's model
FLOPs over the sum of the devices' peaks; a plan that does not fit scores 1% of that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tagplan.cost import baselines as base
from tagplan.cost.bounds import lower_bound_s, plan_value
from tagplan.cost.report import Report
from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Plan
from tagplan.search.exhaustive import exhaustive
from tagplan.search.mcts import Prior, mcts, uniform_prior
from tagplan.search.pareto import frontier
from tagplan.search.problem import Objective, PlanProblem
from tagplan.search.refine import refine_sharding
from tagplan.search.result import Baseline, Candidate, PlanResult, SearchInfo
from tagplan.search.space import PlanSpace, PlanState

DEFAULT_TIME_SLACK = 1.25  # memory / GPU objectives accept plans up to 25% slower than the fastest
PriorFactory = Callable[[PlanSpace], Prior]
Progress = Callable[[int, int], None]


class SimulatorEvaluator:
    """Evaluator: simulate the plan a terminal state describes; keeps every candidate it saw."""

    def __init__(self, space: PlanSpace) -> None:
        self.space = space
        sim = space.sim
        self.lower_bound_s = lower_bound_s(sim.model, sim.cluster, sim.workload)
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
        """The scale-free value of a report (`cost.bounds.plan_value`)."""
        return plan_value(self.lower_bound_s, report.iteration_time_s, fits=report.fits)


def plan(problem: PlanProblem, *, prior_factory: PriorFactory | None = None,
         progress: Progress | None = None) -> PlanResult:
    """Search plans for `problem`; the best (with its simulation), the frontier and the baselines.

    `prior_factory(space)` builds the search prior (the GNN's; the caller resolves
    `problem.scorer` to it, since the search imports no model); without one the prior is uniform.
    Whatever guides the search, the returned plans are ranked by the simulator. `progress(done,
    total)` is called after each evaluation and may raise to stop the search.
    """
    start = time.perf_counter()
    sim = Simulator(problem.model, problem.cluster, problem.workload, calibration=problem.calibration,
                    comm_mode=problem.comm_mode, fold=problem.fold)
    space = PlanSpace(sim, subsets=problem.objective is Objective.GPUS)
    judge = SimulatorEvaluator(space)
    prior = prior_factory(space) if prior_factory is not None else uniform_prior
    found = mcts(space, PlanState(), prior=prior, evaluator=judge, max_evaluations=problem.max_evaluations,
                 max_wall_s=problem.budget_s, seed=problem.seed, progress=progress)
    for state, _ in found.evaluated:
        judge.candidate(space.to_plan(state))
    baselines = _baselines(sim, judge, problem.exhaustive_limit, space)
    pool = [c for c in judge.candidates.values() if c.report.fits]
    pool += [b.candidate for b in baselines.values() if b.candidate is not None]
    best, notes = _choose(pool, problem.objective, problem.time_bound_s, judge)
    refined, solves, hits = refine_sharding(sim, best.plan)
    if refined is not None:
        better = judge.candidate(refined, "search+intra")
        if better.report.fits and better.report.iteration_time_s < best.report.iteration_time_s:
            best = better
            pool.append(better)
    simulation = sim.run(best.plan)  # the best plan's task times, for its timeline
    stats = found.stats
    info = SearchInfo(wall_s=time.perf_counter() - start, evaluations=stats.evaluations, cache_hits=stats.cache_hits,
                      simulations=stats.simulations, stopped_by=stats.stopped_by, intra_solves=solves,
                      intra_cache_hits=hits)
    return PlanResult(best=best, pareto=tuple(frontier(pool)), baselines=baselines, search=info,
                      objective=problem.objective, notes=tuple(notes), simulation=simulation)


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
