"""Partial recomputation: recompute only as many layers as memory needs.

Full recomputation replays every transformer block's forward in the backward pass (a third more compute);
a practitioner whose plan fits with a few blocks recomputed sets Megatron's `--recompute-method block
--recompute-num-layers N` and pays for those only. `fewest_recomputed` gives a plan that recomputes the
fewest such layers: one count N for every recomputing stage (Megatron's flag is one number, per pipeline
stage or virtual stage), each stage recomputing its first min(N, its blocks) blocks, the least N whose plan
still fits by the memory terms alone (`Simulator.fits`, no timing). Memory falls as N grows (each layer
recomputed keeps its input instead of every activation it saves), so a binary search finds it.

The search's terminals (`PlanSpace.to_plan`) and the practitioner baselines (`baselines`) both take their
recomputing plans through it, so neither side is judged with more recomputation than it needs.
"""

from __future__ import annotations

from collections.abc import Callable

from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Plan


def fewest_recomputed(sim: Simulator, plan: Plan, fits: Callable[[Plan], bool] | None = None) -> Plan:
    """`plan` with its recomputing stages trimmed to the fewest recomputed layers that fit (see the module);
    `plan` itself when no stage recomputes, when a stage already names its count, or when only full
    recomputation fits (or not even that). `fits`: the memory check (`sim.fits` by default)."""
    stages = [s for s in plan.stages if s.recompute]
    if not stages or any(s.recompute_layers is not None for s in stages):
        return plan
    fits = fits or sim.fits
    most = max(len(sim.model.checkpointable(*s.layers)) for s in stages)
    if most <= 1 or not fits(plan):
        return plan
    low, high = 1, most  # the least count that fits lies in [low, high]; `most` is full recomputation
    while low < high:
        mid = (low + high) // 2
        if fits(with_recomputed(sim, plan, mid)):
            high = mid
        else:
            low = mid + 1
    return with_recomputed(sim, plan, low)


def with_recomputed(sim: Simulator, plan: Plan, count: int) -> Plan:
    """`plan` with every recomputing stage recomputing its first `count` checkpointable layers (all of them,
    `recompute_layers` None, where it holds no more than `count`)."""
    stages = tuple(
        s.model_copy(update={"recompute_layers": count if count < len(sim.model.checkpointable(*s.layers)) else None})
        if s.recompute else s for s in plan.stages)
    return plan.model_copy(update={"stages": stages})
