"""Partial recomputation: recompute only as many layers as memory needs.

Full recomputation replays every transformer block's forward in the backward pass (a third more compute);
a practitioner whose plan fits with a few blocks recomputed sets Megatron's `--recompute-method block
--recompute-num-layers N` and pays for those only. Two trims, both on the memory terms alone
(`Simulator.fits`, no timing), both by binary search (memory falls as more layers recompute):

- `fewest_recomputed(sim, plan)`: one count N for every recomputing stage (Megatron's flag is one number,
  per pipeline stage or virtual stage), each stage recomputing its first min(N, its blocks) blocks, the least
  N whose plan fits. What the practitioner baselines (`baselines`) run.
- `fewest_recomputed(sim, plan, per_stage=True)`: each stage its own count, none where it fits without
  (stage by stage, the others held). Under 1F1B the first stage holds a micro-batch in flight for every
  stage and the last one only one, and on a mixed cluster a stage on a 16 GB GPU needs more than one on an
  80 GB GPU: one count for all recomputes layers the other stages need not. What the search's terminals
  (`PlanSpace.to_plan`) are; the torch program runs it, Megatron-LM only where the counts agree (the planner
  offers such a runtime the common count, then full recomputation: `planner._admitted`). Interleaved plans
  keep one count: a device there holds several virtual stages whose peaks interleave, so each probe would
  count the whole plan (on Llama-2-70B over 16 DGX that tripled the search's time), and Megatron-LM, which
  runs them, takes one count.
"""

from __future__ import annotations

from collections.abc import Callable

from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Plan, Schedule, Stage


def fewest_recomputed(sim: Simulator, plan: Plan, fits: Callable[[Plan], bool] | None = None, *,
                      per_stage: bool = False) -> Plan:
    """`plan` with its recomputing stages trimmed to the fewest recomputed layers that fit (see the module);
    `plan` itself when no stage recomputes, when a stage already names its count, or when only full
    recomputation fits (or not even that). `fits`: the memory check (`sim.fits` by default)."""
    stages = [s for s in plan.stages if s.recompute]
    if not stages or any(s.recompute_layers is not None for s in stages):
        return plan
    fits = fits or sim.fits
    if not fits(plan):
        return plan
    if per_stage and plan.schedule is not Schedule.INTERLEAVED_1F1B:
        return _per_stage(sim, plan, fits)
    most = max(len(sim.model.checkpointable(*s.layers)) for s in stages)
    if most <= 1:
        return plan
    low, high = 1, most  # the least count that fits lies in [low, high]; `most` is full recomputation
    while low < high:
        mid = (low + high) // 2
        if fits(with_recomputed(sim, plan, mid)):
            high = mid
        else:
            low = mid + 1
    return with_recomputed(sim, plan, low)


def fully_recomputed(plan: Plan, *, everywhere: bool = True) -> Plan:
    """`plan` with every stage (`everywhere`), or every stage that recomputes, recomputing all its layers
    (`recompute_layers` None): where the trims start, and what a runtime without partial recomputation runs."""
    return plan.model_copy(update={"stages": tuple(
        s.model_copy(update={"recompute": True, "recompute_layers": None}) if everywhere or s.recompute else s
        for s in plan.stages)})


def fewest_per_stage(sim: Simulator, plan: Plan) -> Plan | None:
    """`plan` with each stage recomputing the fewest of its layers that fit, none where it fits without
    (`fewest_recomputed(per_stage=True)` from full recomputation everywhere; one count for an interleaved
    plan); `plan` itself where no stage recomputes and it fits; None where not even full recomputation fits."""
    if not any(s.recompute for s in plan.stages) and sim.fits(plan):
        return plan
    full = fully_recomputed(plan)
    if not sim.fits(full):
        return None
    return fewest_recomputed(sim, full, per_stage=True)


def with_recomputed(sim: Simulator, plan: Plan, count: int) -> Plan:
    """`plan` with every recomputing stage recomputing its first `count` checkpointable layers (all of them,
    `recompute_layers` None, where it holds no more than `count`)."""
    stages = tuple(
        s.model_copy(update={"recompute_layers": count if count < len(sim.model.checkpointable(*s.layers)) else None})
        if s.recompute else s for s in plan.stages)
    return plan.model_copy(update={"stages": stages})


def _per_stage(sim: Simulator, plan: Plan, fits: Callable[[Plan], bool]) -> Plan:
    """Stage by stage in order, the least count of its own that keeps `plan` fitting, the others held: none
    (recompute off) where the stage fits without, else the least of 1..its blocks (memory falls from 1 up;
    recomputing one block can take more than none, where a single micro-batch is in flight). No two stages
    share a device (not interleaved): a stage's fit is its own devices' (`Simulator.stage_fits`)."""
    alone = fits == sim.fits
    stages = list(plan.stages)
    for i, stage in enumerate(plan.stages):
        if not stage.recompute:
            continue
        most = len(sim.model.checkpointable(*stage.layers))

        def ok(count: int, i: int = i, stage: Stage = stage, most: int = most) -> bool:
            candidate = _with_count(stage, count, most)
            if alone:
                return sim.stage_fits(plan, i, candidate)
            return fits(plan.model_copy(update={"stages": (*stages[:i], candidate, *stages[i + 1:])}))

        if ok(0):
            stages[i] = _with_count(stage, 0, most)
            continue
        low, high = 1, most
        while low < high:
            mid = (low + high) // 2
            if ok(mid):
                high = mid
            else:
                low = mid + 1
        stages[i] = _with_count(stage, low, most)
    return plan.model_copy(update={"stages": tuple(stages)})


def _with_count(stage: Stage, count: int, most: int) -> Stage:
    """`stage` recomputing its first `count` of `most` checkpointable layers (0: none, `most`: all)."""
    return stage.model_copy(update={"recompute": False, "recompute_layers": None} if count == 0 else
                            {"recompute": True, "recompute_layers": count if count < most else None})
