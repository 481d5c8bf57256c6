"""Seeds on mixed clusters: the practitioner configurations with their layers split by stage speed.

The Megatron grid (`baselines.megatron_grid`) splits the blocks evenly, as Megatron-LM does; on a
cluster of unequal GPUs its stages on the faster GPUs then wait for those on the slower. The first thing a
practitioner does about that, and what heterogeneity-aware planners do (HetPipe, Metis, Sailor), is to
give each stage a share of the layers proportional to its speed. `rebalance_seeds` does that for the
pipelined plans the grid judged, from each plan's own simulation:

- each stage's speed is its layers per second of task time (forward plus backward of one micro-batch, its
  tensor-parallel traffic included: `StageReport`), so embeddings, heads and slower GPUs all count as
  they cost;
- the new split gives every (virtual) stage a layer count proportional to its speed, at least one, by
  largest remainder (`speed_split`);
- the new plan is simulated and split again from its own stage times, up to `REBALANCE_ROUNDS` rounds,
  while the split moves and the plan gets faster;
- each split recomputes the fewest layers per stage that fit (`recompute.fewest_recomputed`; none where a
  stage fits without), and is dropped when even full recomputation does not fit;
- the `INTERLEAVE_SEEDS` fastest rebalanced 1F1B plans are also tried interleaved (`INTERLEAVE_CHUNKS`
  virtual stages per device group, each group keeping its layers: `interleaved`) and rebalanced again,
  which is how a mixed pipeline with few stages sheds its bubble.

Which plans: the `REBALANCE_SEEDS` fitting pipelined candidates judged so far whose bound is lowest,
the bound being a plan's time scaled by the stage time a perfect split would reach over its slowest
stage's now (every stage as fast as the layers over the stages' summed speeds, none under one layer). One
micro-batch size and memory option per configuration (its stages' devices and degrees) is taken, the one
of lowest bound; none whose slowest stage is already within
`IMBALANCE` of the mean (on one GPU type the embedding and the head still unbalance an even split).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tagplan.cost.report import Report
from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Plan, Schedule
from tagplan.search.recompute import fewest_per_stage
from tagplan.search.result import Candidate

REBALANCE_SEEDS = 24
"""Pipelined plans rebalanced per problem (each costs up to `REBALANCE_ROUNDS` evaluations)."""
REBALANCE_ROUNDS = 3
INTERLEAVE_CHUNKS = (2, 4)
"""Virtual stages per device group tried on the best rebalanced 1F1B plans (`interleaved`)."""
INTERLEAVE_SEEDS = 4
"""Rebalanced 1F1B plans that are also tried interleaved."""
IMBALANCE = 1.05
"""Slowest over mean stage task time below which a plan's split is left alone."""
SOURCE = "baseline+split"

Judge = Callable[[Plan, str], Candidate]


def speed_split(layers: Sequence[int], seconds: Sequence[float]) -> list[int]:
    """Layer counts for stages that now hold `layers` and take `seconds` each: proportional to each stage's
    layers per second, at least one each, summing to sum(layers) (largest remainder; ties to the earlier)."""
    if len(layers) != len(seconds) or not layers:
        raise ValueError("speed_split: one time per stage, at least one stage")
    total = sum(layers)
    if total < len(layers):
        raise ValueError(f"speed_split: {total} layers cannot give {len(layers)} stages one each")
    speeds = [n / max(s, 1e-12) for n, s in zip(layers, seconds, strict=True)]
    spare = total - len(layers)  # one layer each first, the rest by speed
    shares = [spare * v / sum(speeds) for v in speeds]
    counts = [1 + math.floor(x) for x in shares]
    left = total - sum(counts)
    for i in sorted(range(len(shares)), key=lambda i: (-(shares[i] - math.floor(shares[i])), i))[:left]:
        counts[i] += 1
    return counts


def resplit(plan: Plan, counts: Sequence[int]) -> Plan:
    """`plan` with its stages holding `counts` consecutive layers, in order; recompute counts and per-op
    sharding are dropped (a stage's blocks change: `recompute.fewest_per_stage` sets the counts again, the planner's
    refinement the sharding)."""
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    stages = tuple(s.model_copy(update={"layers": (bounds[i], bounds[i + 1]), "recompute_layers": None,
                                        "sharding": None})
                   for i, s in enumerate(plan.stages))
    return plan.model_copy(update={"stages": stages})


def interleaved(plan: Plan, chunks: int) -> Plan | None:
    """A 1F1B `plan` as interleaved 1F1B with `chunks` virtual stages per device group, each group's layers
    split evenly over its chunks in Megatron's round-robin order (chunk c of group s is virtual stage
    c * pp + s); None where a group holds fewer layers than chunks or the micro-batches do not divide over
    the groups (Megatron's condition)."""
    pp = len(plan.stages)
    if plan.schedule is not Schedule.ONE_F_ONE_B or pp < 2 or chunks < 2 or plan.micro_batches % pp:
        return None
    held = [s.layers[1] - s.layers[0] for s in plan.stages]
    if min(held) < chunks:
        return None
    parts = [[n // chunks + (1 if c < n % chunks else 0) for c in range(chunks)] for n in held]
    stages, start = [], 0
    for c in range(chunks):
        for g, stage in enumerate(plan.stages):
            end = start + parts[g][c]
            stages.append(stage.model_copy(update={"layers": (start, end), "recompute_layers": None}))
            start = end
    return plan.model_copy(update={"schedule": Schedule.INTERLEAVED_1F1B, "stages": tuple(stages)})


def _task_s(report: Report) -> list[float]:
    return [s.forward_s + s.backward_s for s in report.stages]


def _bound_s(report: Report) -> float:
    """The plan's time scaled by the stage time a speed-proportional split would reach over its slowest
    stage's now (see the module); a ranking only. At best every stage takes the same time, the layers over
    the stages' summed speeds, but no less than one layer takes on its slowest stage."""
    times = _task_s(report)
    layers = [s.layers[1] - s.layers[0] for s in report.stages]
    speeds = [n / max(t, 1e-12) for n, t in zip(layers, times, strict=True)]
    balanced_s = max(sum(layers) / sum(speeds), max(1.0 / v for v in speeds))
    return report.iteration_time_s * balanced_s / max(times)


def _worth(report: Report) -> bool:
    times = _task_s(report)
    return len(times) > 1 and max(times) > IMBALANCE * sum(times) / len(times)


def rebalance(sim: Simulator, judge: Judge, start: Candidate) -> Candidate:
    """The fastest of `start` and its speed-proportional splits (module docstring)."""
    best = current = start
    for _ in range(REBALANCE_ROUNDS):
        if not _worth(current.report):
            break
        layers = [s.layers[1] - s.layers[0] for s in current.plan.stages]
        counts = speed_split(layers, _task_s(current.report))
        if counts == layers:
            break
        plan = fewest_per_stage(sim, resplit(current.plan, counts))
        if plan is None:
            break
        current = judge(plan, SOURCE)
        if not current.report.fits:
            break
        if current.report.iteration_time_s >= best.report.iteration_time_s:
            break
        best = current
    return best


def _layout(plan: Plan) -> tuple[object, ...]:
    """A configuration apart from its micro-batch size and memory options: its stages' device groups and
    degrees (the sizes of one configuration rebalance alike; the one with the lowest bound is taken)."""
    return (plan.schedule, tuple((s.devices, s.dp, s.tp, s.cp) for s in plan.stages))


def rebalance_seeds(sim: Simulator, judge: Judge, candidates: Sequence[Candidate],
                    limit: int = REBALANCE_SEEDS) -> list[Candidate]:
    """Rebalance the `limit` most promising pipelined, fitting `candidates` (module docstring); the
    candidates faster than the plan they came from (each also judged, so the caller's pool has them). At
    most `limit * REBALANCE_ROUNDS + INTERLEAVE_SEEDS * len(INTERLEAVE_CHUNKS) * (1 + REBALANCE_ROUNDS)`
    evaluations, outside the search's budget; which plans they are depends only on `candidates`."""
    seen: set[tuple[object, ...]] = set()
    starts: list[tuple[float, Candidate]] = []
    for cand in candidates:
        if len(cand.plan.stages) < 2 or not cand.report.fits or not _worth(cand.report):
            continue
        starts.append((_bound_s(cand.report), cand))
    starts.sort(key=lambda item: item[0])
    chosen: list[tuple[float, Candidate]] = []
    for bound_s, cand in starts:
        key = _layout(cand.plan)
        if key not in seen:
            seen.add(key)
            chosen.append((bound_s, cand))
    improved = []
    for _, cand in chosen[:limit]:
        best = rebalance(sim, judge, cand)
        if best is not cand:
            improved.append(best)
    one_f_one_b = sorted((c for c in improved if c.plan.schedule is Schedule.ONE_F_ONE_B),
                         key=lambda c: c.report.iteration_time_s)
    for cand in one_f_one_b[:INTERLEAVE_SEEDS]:
        for chunks in INTERLEAVE_CHUNKS:
            plan = interleaved(cand.plan.model_copy(update={"stages": tuple(
                s.model_copy(update={"recompute": False, "recompute_layers": None}) for s in cand.plan.stages)}),
                chunks)
            fitted = fewest_per_stage(sim, plan) if plan is not None else None
            if fitted is None:
                continue
            start = judge(fitted, SOURCE)
            if start.report.fits:
                best = rebalance(sim, judge, start)
                if best.report.iteration_time_s < cand.report.iteration_time_s:
                    improved.append(best)
    return improved
