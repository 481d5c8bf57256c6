"""The planner: MCTS over the decision process, judged by the simulator, with baselines.

`plan(problem)` runs the baselines, then searches with an injected prior (uniform by default; the
GNN provides another) and the simulator as evaluator, MCTS interleaved with hill climbing from the
best plan of each region (`search.polish`); it refines the tensor-parallel stages of the best plans
(for the time objective, every plan that was the fastest so far) with the intra-stage solver, and
reports the Pareto frontier of everything it simulated, the baselines and, where the space is
small enough, the exhaustive optimum. The best plan is simulated once more with its task times
recorded, so callers draw its timeline without simulating again.

Anytime: the baselines do not depend on the evaluation budget, and the search evaluates a sequence
of plans that does not either (with PUCT at the root, i.e. from `mcts.GUMBEL_DEFAULT_BELOW`
evaluations up), cut at the budget; so, wall-clock limits aside, more evaluations never give a
slower plan.

The value the search maximises is scale-free: T_lb / T, where T_lb is the iteration's model
FLOPs over the sum of the devices' peaks; a plan that does not fit scores 1% of that.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial

from tagplan.cost.bounds import lower_bound_s, plan_value
from tagplan.cost.report import Report
from tagplan.cost.simulator import ReduceOverlap, Simulator
from tagplan.errors import SpecError
from tagplan.ir.cluster import Cluster, TensorFormat
from tagplan.ir.plan import Plan
from tagplan.ir.workload import DType
from tagplan.search.background import Background
from tagplan.search.baselines import BaselineFamily, baseline_families
from tagplan.search.exhaustive import exhaustive
from tagplan.search.mcts import Prior, SearchStats, mcts, uniform_prior
from tagplan.search.pareto import frontier
from tagplan.search.problem import Objective, PlanProblem
from tagplan.search.rebalance import rebalance_seeds
from tagplan.search.recompute import fewest_per_stage, fewest_recomputed, fully_recomputed
from tagplan.search.refine import refine_sharding
from tagplan.search.result import Baseline, Candidate, PlanResult, Predictor, SearchInfo
from tagplan.search.space import PlanSpace, PlanState

DEFAULT_TIME_SLACK = 1.25  # memory / GPU objectives accept plans up to 25% slower than the fastest
BASELINE_BUDGET_SHARE = 0.5  # the baselines' grid may take up to this share of the wall-clock budget
MIN_SEARCH_S = 1.0  # the search runs at least this long after the baselines
REFINE_OVERRUN_SHARE = 0.5  # the sharding refinement after the search may overrun the budget by this share of it
MIN_BASELINE_WAIT_S = 30.0
"""Beside the search, the baselines' processes are waited for until the end of the budget, and at least this
long after the search (their grid stops at half the budget, past the configuration it is walking)."""
PriorFactory = Callable[[PlanSpace], Prior]
Admissible = Callable[[Plan], str | None]
RERANK_TOP_K = 16  # candidates the learned correction re-ranks (the simulator's fastest that fit)


@dataclass(frozen=True)
class Correction:
    """A learned correction of the simulator: predicted seconds of plans, from measured iterations."""

    version: str
    predict_s: Callable[[Sequence[Plan]], Sequence[float]]
Progress = Callable[[int, int], None]


class SimulatorEvaluator:
    """Evaluator: simulate the plan a terminal state describes; keeps every candidate it saw."""

    def __init__(self, space: PlanSpace) -> None:
        self.space = space
        sim = space.sim
        self.lower_bound_s = lower_bound_s(sim.model, sim.cluster, sim.workload)
        self.candidates: dict[str, Candidate] = {}  # keyed by the plan's JSON (plans with sharding are unhashable)
        self.known: dict[str, Candidate] = {}  # judged ahead (`_prefetch_refinements`), not yet asked for

    def __call__(self, state: PlanState) -> float:
        """T_lb / T for a plan that fits, 1% of it otherwise."""
        plan = self.space.to_plan(state)
        return self.value(self.candidate(plan).report)

    def candidate(self, plan: Plan, source: str = "search") -> Candidate:
        """The simulated candidate for `plan` (each distinct plan simulated once)."""
        key = plan.to_json()
        hit = self.candidates.get(key)
        if hit is None:
            known = self.known.pop(key, None)
            hit = self.candidates[key] = known if known is not None else self.judge(plan, source)
        return hit

    def judge(self, plan: Plan, source: str) -> Candidate:
        """`plan` simulated, kept nowhere."""
        return Candidate(plan, self.space.sim.simulate(plan), source)

    def value(self, report: Report) -> float:
        """The scale-free value of a report (`cost.bounds.plan_value`)."""
        return plan_value(self.lower_bound_s, report.iteration_time_s, fits=report.fits)


def plan(problem: PlanProblem, *, prior_factory: PriorFactory | None = None, progress: Progress | None = None,
         admissible: Admissible | None = None, correction: Correction | None = None,
         reduce_overlap: ReduceOverlap | None = None) -> PlanResult:
    """Search plans for `problem`; the best (with its simulation), the frontier and the baselines.

    `prior_factory(space)` builds the search prior (the GNN's; the caller resolves
    `problem.scorer` to it, since the search imports no model); without one the prior is uniform.
    Whatever guides the search, the returned plans are ranked by the simulator. `progress(done,
    total)` is called after each evaluation and may raise to stop the search. `admissible(plan)`
    returns None for a plan the caller can use, else why not (e.g. an exporter's refusal): only
    admissible plans are returned as the best or on the frontier. `correction` (the GNN fine-tuned
    on measured iterations of this cluster's device types) re-ranks the simulator's fastest
    `RERANK_TOP_K` candidates for the time objective: the best is the fastest by its prediction.
    `reduce_overlap`: the target runtime's per-stage rule for the gradient reduction (`Simulator`).
    """
    start = time.perf_counter()
    sim = Simulator(problem.model, problem.cluster, problem.workload, calibration=problem.calibration,
                    comm_mode=problem.comm_mode, fold=problem.fold, reduce_overlap=reduce_overlap)
    space = PlanSpace(sim)
    judge = SimulatorEvaluator(space)
    families = baseline_families(sim, deadline=start + BASELINE_BUDGET_SHARE * problem.budget_s)
    prefetch = problem.objective is Objective.TIME and admissible is None and correction is None
    children = _start_families(sim, space, families, problem) if problem.workers > 1 else []
    if children:  # the baselines in forked processes, the search here beside them
        with ExitStack() as stack:
            for child in children:
                stack.callback(child.cancel)  # the search raised (a progress callback stops it): stop them
            stats = _search(space, problem, prior_factory, progress, searcher := SimulatorEvaluator(space),
                            time.perf_counter() - start)
            if prefetch:  # while the baselines run, this process refines its own incumbents
                _prefetch_refinements(sim, list(searcher.candidates.values()), searcher,
                                      stop=lambda: all(child.ready() for child in children))
            ran = [child.result(timeout_s=max(start + problem.budget_s - time.perf_counter(), MIN_BASELINE_WAIT_S))
                   for child in children]
            baselines = _merged([family for part in ran for family in part], judge)
    else:  # one process: the baselines first, then the search, which finds their plans judged
        baselines = {name: family(judge.candidate) for name, family in families}
        searcher = judge
    _seed(baselines, judge)
    baseline_evaluations = len(judge.candidates)
    judge.known.update(searcher.known)  # after the seeds: a refinement judged ahead is the search's, not a seed's
    if searcher is judge:
        stats = _search(space, problem, prior_factory, progress, judge, time.perf_counter() - start)
    for key, cand in searcher.candidates.items():  # after the baselines' and the seeds', as one process has them
        judge.candidates.setdefault(key, cand)
    notes: list[str] = []
    if not judge.candidates:
        raise SpecError(f"no plan gives every data-parallel replica a whole sample of the global batch "
                        f"{problem.workload.global_batch} on this cluster; raise the batch")
    baselines["exhaustive"] = _exhaustive(space, problem.exhaustive_limit)
    pool = [c for c in judge.candidates.values() if c.report.fits]
    kind = ""  # what the fallback's notes call the plans it chose among
    admissible_notes: list[str] = []
    if admissible is not None:
        kept = [k for c in pool if (k := _admitted(c, admissible, judge)) is not None]
        # after `_admitted`, whose recompute variants are admissible plans too
        others, kind, admissible_notes = (_admissible_fallback(list(judge.candidates.values()), admissible,
                                                               fitting=pool) if not kept else ([], "", []))
        notes += admissible_notes
        pool = kept
    else:
        others = list(judge.candidates.values())
    best, chosen_notes = _choose(pool, problem.objective, problem.time_bound_s, others, kind=kind)
    notes += chosen_notes
    fallback = not pool  # the best is not a fitting, admissible plan: nothing to re-rank; the notes say what it is
    applied = False
    if correction is not None and problem.objective is Objective.TIME and not fallback:
        best, pool = _rerank(pool, correction)
        applied = True
    solves = hits = 0
    if not applied:
        # the time objective refines every plan that was the fastest so far (a set that only grows with
        # the budget, so more evaluations never lose a refinement); the others refine their choice
        starts = _incumbents(pool) if problem.objective is Objective.TIME else [best]
        deadline = start + (1.0 + REFINE_OVERRUN_SHARE) * problem.budget_s
        cut = False
        for incumbent in starts if best.report.fits else [best]:
            refined, more_solves, more_hits, was_cut = refine_sharding(sim, incumbent.plan, deadline=deadline)
            cut = cut or was_cut
            solves, hits = solves + more_solves, hits + more_hits
            if refined is not None and (admissible is None or admissible(refined) is None):
                better = judge.candidate(refined, "search+intra")
                if better.report.fits and (fallback or better.report.iteration_time_s < best.report.iteration_time_s):
                    if fallback:  # a refinement made the fallback fit (and it is admissible): the notes no longer hold
                        notes = [n for n in notes if n not in (*chosen_notes, *admissible_notes)]
                        fallback = False
                    best = better
                    pool.append(better)
        if cut:
            notes.append(f"the sharding refinement stopped at its deadline ({1 + REFINE_OVERRUN_SHARE:g}x budget_s "
                         f"= {(1 + REFINE_OVERRUN_SHARE) * problem.budget_s:g} s): some plans keep the default "
                         "sharding; a larger budget_s refines them all")
    bound = problem.time_bound_s
    if problem.objective is not Objective.TIME and bound is not None and best.report.iteration_time_s > bound:
        notes.append(f"no plan runs within the time bound of {bound:.4g} s; the fastest plan the search found "
                     f"({best.report.iteration_time_s:.4g} s) is returned")
    notes += dtype_notes(problem.cluster, problem.workload.dtype, best.plan.devices)
    simulation = sim.run(best.plan)  # the best plan's task times, for its timeline
    info = SearchInfo(wall_s=time.perf_counter() - start, evaluations=stats.evaluations, cache_hits=stats.cache_hits,
                      simulations=stats.simulations, stopped_by=stats.stopped_by, intra_solves=solves,
                      intra_cache_hits=hits, baseline_evaluations=baseline_evaluations,
                      local_evaluations=stats.local_evaluations)
    return PlanResult(best=best, pareto=tuple(frontier(pool)), baselines=baselines, search=info,
                      objective=problem.objective, notes=tuple(notes), simulation=simulation,
                      cluster_devices=problem.cluster.num_devices, workload=problem.workload,
                      reduce_overlap={i: hidden for i, hidden in enumerate(sim.overlapped(best.plan))
                                      if best.plan.stages[i].dp_cp > 1},
                      predictor=Predictor(problem.calibration.name, correction.version if correction else None,
                                          applied))


def _search(space: PlanSpace, problem: PlanProblem, prior_factory: PriorFactory | None, progress: Progress | None,
            judge: SimulatorEvaluator, elapsed_s: float) -> SearchStats:
    """MCTS over the decision process, every plan it evaluated judged by `judge`, within what is left of the
    budget after `elapsed_s` (at least `MIN_SEARCH_S`)."""
    if not space.actions(PlanState()):
        return SearchStats(evaluations=0, cache_hits=0, simulations=0, wall_s=0.0, stopped_by="no plan in the space")
    prior = prior_factory(space) if prior_factory is not None else uniform_prior
    found = mcts(space, PlanState(), prior=prior, evaluator=judge, max_evaluations=problem.max_evaluations,
                 max_wall_s=max(problem.budget_s - elapsed_s, MIN_SEARCH_S), seed=problem.seed, progress=progress,
                 local=space)
    for state, _ in found.evaluated:
        judge.candidate(space.to_plan(state))
    return found.stats


def _seed(baselines: dict[str, Baseline], judge: SimulatorEvaluator) -> None:
    """Judge the seeds built from what the baselines judged: each baseline's plan with each stage recomputing what
    it needs, and the pipelined plans with their layers split by stage speed (mixed GPUs, embedding, head)."""
    for baseline in baselines.values():
        if baseline.candidate is not None:
            _per_stage_seed(baseline.candidate.plan, judge)
    rebalance_seeds(judge.space.sim, judge.candidate, list(judge.candidates.values()))


Ran = tuple[str, Baseline, list[tuple[str, Candidate]]]
"""A baseline family run in another process: its name, its baseline, and every plan it judged (by its JSON)."""


def _deal(families: list[tuple[str, BaselineFamily]], processes: int) -> list[list[tuple[str, BaselineFamily]]]:
    """The families in `processes` consecutive groups (as many as there are families at most)."""
    n = min(processes, len(families))
    return [families[k * len(families) // n:(k + 1) * len(families) // n] for k in range(n)]


def _start_families(sim: Simulator, space: PlanSpace, families: list[tuple[str, BaselineFamily]],
                    problem: PlanProblem) -> list[Background[list[Ran]]]:
    """The families dealt to `problem.workers` - 1 forked processes (`_deal`); none where this process cannot
    fork (it then runs them itself before the search, as with one worker, so their time limit means the same).
    A process that dies or does not answer has its families run here afresh, their time limit counted anew."""
    children = []
    for group in _deal(families, problem.workers - 1):
        names = {name for name, _ in group}

        def again(names: set[str] = names) -> list[Ran]:
            fresh = baseline_families(sim, deadline=time.perf_counter() + BASELINE_BUDGET_SHARE * problem.budget_s)
            return _run_families(space, [(name, family) for name, family in fresh if name in names])

        children.append(Background(partial(_run_families, space, group), fallback=again))
    if all(child.forked for child in children):
        return children
    for child in children:
        child.cancel()
    return []


def _run_families(space: PlanSpace, families: list[tuple[str, BaselineFamily]]) -> list[Ran]:
    """In a baselines' process: each family with an evaluator of its own."""
    out = []
    for name, family in families:
        judge = SimulatorEvaluator(space)
        out.append((name, family(judge.candidate), list(judge.candidates.items())))
    return out


def _merged(ran: list[Ran], judge: SimulatorEvaluator) -> dict[str, Baseline]:
    """The baselines by name and their plans in `judge`, in the families' order, each plan under the first family
    that judged it: as one process running them in turn has them."""
    out: dict[str, Baseline] = {}
    for name, baseline, judged in ran:
        for key, cand in judged:
            judge.candidates.setdefault(key, cand)
        if baseline.candidate is not None:  # the candidate the judge holds (another family's, judged first)
            baseline = replace(baseline, candidate=judge.candidates[baseline.candidate.plan.to_json()])
        out[name] = baseline
    return out


def _prefetch_refinements(sim: Simulator, judged: list[Candidate], judge: SimulatorEvaluator, *,
                          stop: Callable[[], bool] = lambda: False) -> None:
    """Refine the plans of `judged` (in the order judged) that fit and were faster than each before them, and
    judge the refined plans into `judge.known`, until `stop()`: the time objective's refinements
    (`_incumbents`), done ahead while a process would wait. The incumbents of the whole pool are among those of
    each part of it (the baselines', the search's), so the planner then finds them done."""
    for cand in _incumbents([c for c in judged if c.report.fits]):
        if stop():
            return
        refined, _, _, _ = refine_sharding(sim, cand.plan)
        if refined is None:
            continue
        key = refined.to_json()
        if key not in judge.known and key not in judge.candidates:
            judge.known[key] = judge.judge(refined, "search+intra")


def _per_stage_seed(plan: Plan, judge: SimulatorEvaluator) -> None:
    """Judge `plan` (a baseline's: one recompute count for every stage, as Megatron-LM runs it) with each stage
    recomputing only what its own memory needs (`recompute.fewest_per_stage`), where that differs: a candidate
    of the planner's own, never slower than the baseline's plan."""
    if not any(s.recompute for s in plan.stages):
        return
    own = fewest_per_stage(judge.space.sim, plan)
    if own is not None and own != plan:
        judge.candidate(own, "baseline+recompute")


def _admitted(cand: Candidate, admissible: Admissible, judge: SimulatorEvaluator) -> Candidate | None:
    """`cand` where `admissible` accepts its plan; else, for a plan whose stages recompute different numbers of
    layers (`recompute.fewest_recomputed(per_stage=True)`), the first of the plan with one count for every
    stage (the fewest that fit: Megatron-LM's one flag), full recomputation on the stages that recompute (a
    runtime without partial recomputation, DeepSpeed's) and full recomputation on every stage, that is
    accepted and fits; else None."""
    if admissible(cand.plan) is None:
        return cand
    stages = cand.plan.stages
    if not any(s.recompute for s in stages) or (
            all(s.recompute for s in stages) and all(s.recompute_layers is None for s in stages)):
        return None  # no recompute, or full recompute everywhere: no other recompute to offer
    full, where = fully_recomputed(cand.plan), fully_recomputed(cand.plan, everywhere=False)
    for other in (fewest_recomputed(judge.space.sim, full), where, full):
        if admissible(other) is None:
            judged = judge.candidate(other, cand.source)
            if judged.report.fits:
                return judged
    return None


def _incumbents(pool: list[Candidate]) -> list[Candidate]:
    """The candidates, in the order they were simulated, that were faster than every one before them."""
    out: list[Candidate] = []
    for cand in pool:
        if not out or cand.report.iteration_time_s < out[-1].report.iteration_time_s:
            out.append(cand)
    return out


def _rerank(pool: list[Candidate], correction: Correction) -> tuple[Candidate, list[Candidate]]:
    """The best of the simulator's top candidates by the correction's prediction, and the pool with
    those candidates carrying their corrected times."""
    top = sorted(pool, key=lambda c: c.report.iteration_time_s)[:RERANK_TOP_K]
    times = correction.predict_s([c.plan for c in top])
    corrected = {id(c): replace(c, corrected_time_s=float(t)) for c, t in zip(top, times, strict=True)}
    best = min(corrected.values(), key=lambda c: c.corrected_time_s or math.inf)
    return best, [corrected.get(id(c), c) for c in pool]


def _exhaustive(space: PlanSpace, limit: int) -> Baseline:
    """The exhaustive optimum of the decision process, judged by its own evaluator (so that nothing
    it enumerates joins the search's pool): a yardstick for the search, never one of its answers."""
    if limit <= 0:
        return Baseline("exhaustive", None, "not requested (exhaustive_limit=0)")
    own = SimulatorEvaluator(space)
    found = exhaustive(space, own, limit=limit)
    if found is None:
        return Baseline("exhaustive", None, f"the space has more than {limit} plans")
    cand = own.candidate(space.to_plan(found[0]), "exhaustive")
    if not cand.report.fits:
        return Baseline("exhaustive", None, "no plan of the space fits in memory")
    return Baseline("exhaustive", cand, config=f"best of all {found[2]} plans of the decision process")


def _overcommit(report: Report) -> float:
    """The peak use of the plan's worst device over that device's memory (> 1: does not fit)."""
    worst = report.worst_device_memory
    return worst.memory_bytes / worst.mem_bytes


def _admissible_fallback(candidates: list[Candidate], admissible: Admissible, *,
                         fitting: list[Candidate]) -> tuple[list[Candidate], str, list[str]]:
    """What to fall back on when no plan that fits is admissible: the admissible plans the search simulated
    (none of them fits), or, where none is admissible, the plans that fit (the answer is then not runnable as
    asked, and the notes say so); what the notes call them; and the notes."""
    admitted = [c for c in candidates if admissible(c.plan) is None]
    if admitted:
        why = [f"no plan that fits in memory is admissible ({admissible(fitting[0].plan)})"] if fitting else []
        return admitted, "admissible ", why
    first = fitting[0] if fitting else candidates[0]
    return fitting or candidates, "", [f"no plan the search simulated is admissible ({admissible(first.plan)}); "
                                       "the plan returned is not: it is the best of all, for reference"]


def _choose(pool: list[Candidate], objective: Objective, bound_s: float | None, others: list[Candidate], *,
            kind: str = "") -> tuple[Candidate, list[str]]:
    """The best of `pool` (fitting plans) for `objective`; with an empty pool, the best of `others` by the
    same objective, each of which does not fit or is not admissible (the notes say which was returned, `kind`
    naming the plans they were: "admissible " or "")."""
    if not pool:
        if not others:
            raise ValueError("no candidate to choose from")
        infeasible = [c for c in others if not c.report.fits]
        if not infeasible:  # every fallback fits (none is admissible): the best of them by the objective
            return _choose(others, objective, bound_s, [], kind=kind)
        if objective is Objective.MEMORY:  # the plan nearest to fitting: its worst device least over its memory
            fallback = min(infeasible, key=lambda c: (_overcommit(c.report), c.report.iteration_time_s))
            return fallback, [f"no {kind}plan fits in memory; the {kind}plan nearest to fitting the search "
                              "simulated (its worst device least over its memory) is returned"]
        fallback = min(infeasible, key=lambda c: c.report.iteration_time_s)
        return fallback, [f"no {kind}plan fits in memory; the fastest {kind}plan the search simulated (it does "
                          "not fit) is returned"]
    fastest = min(pool, key=lambda c: c.report.iteration_time_s)
    if objective is Objective.TIME:
        return fastest, []
    bound = bound_s if bound_s is not None else DEFAULT_TIME_SLACK * fastest.report.iteration_time_s
    within = [c for c in pool if c.report.iteration_time_s <= bound] or [fastest]  # none: the fastest, noted by `plan`
    if objective is Objective.MEMORY:
        return min(within, key=lambda c: (c.report.peak_memory_bytes, c.report.iteration_time_s)), []
    return min(within, key=lambda c: (c.report.devices_used, c.report.iteration_time_s)), []


def dtype_notes(cluster: Cluster, dtype: DType, devices: Iterable[int] | None = None) -> list[str]:
    """A note per tensor-core format the plan's GPUs (`devices`; default every GPU) are costed at in place of
    `dtype`, whose tensor cores they lack (`DeviceSpec.has_tensor_cores_for`, `costed_format`): such a plan's time
    is that format's, which a run in `dtype` there does not reach (V100 and T4 have no bf16 tensor cores, A100 no
    fp8 ones, Hopper no block-scaled ones for mxfp8 and nvfp4)."""
    used = range(cluster.num_devices) if devices is None else devices
    lacking: dict[TensorFormat, list[str]] = {}
    for spec in {cluster.devices[d].spec.name: cluster.devices[d].spec for d in used}.values():
        if not spec.has_tensor_cores_for(dtype):
            lacking.setdefault(spec.costed_format(dtype), []).append(spec.name)
    notes = []
    for costed, names in lacking.items():
        run = (f"Transformer Engine refuses {dtype.value} there" if dtype.quantized
               else f"a {dtype.value} run there is slower")
        notes.append(f"{', '.join(sorted(names))}: no {dtype.value} tensor cores; costed at the {costed.value} rate, "
                     f"as a run in {costed.value} there would go ({run})")
    return notes
