"""Apply the intra-stage solver to a plan's tensor-parallel stages, memoised by explicit keys.

For each stage with tp > 1 and each distinct block in it, the solver runs once per
(block hash, tp, device type, link class, samples per micro-batch, micro-batches); the fastest
sharding is written into the stage's `sharding` (ops whose names are not unique across the
stage's blocks keep the default). Past a `deadline` the refinement stops and changes nothing (an abandoned solve
is not memoised).
"""

from __future__ import annotations

from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Plan, ShardStrategy, Stage
from tagplan.search.intra import IntraSolution, OutOfTimeError, solve_block

_SOLUTIONS: str = "intra_memo"


def refine_sharding(sim: Simulator, plan: Plan, *,
                    deadline: float | None = None) -> tuple[Plan | None, int, int, bool]:
    """(plan with solved sharding or None if nothing changed or `deadline` (`time.perf_counter()`) passed, solves
    run, memo hits, whether the deadline cut a solve)."""
    memo: dict[tuple[object, ...], IntraSolution | None] = getattr(sim, _SOLUTIONS, None) or {}
    setattr(sim, _SOLUTIONS, memo)
    solves = hits = 0
    stages: list[Stage] = []
    changed = False
    for stage in plan.stages:
        if stage.tp < 2:
            stages.append(stage)
            continue
        samples = sim.workload.global_batch / plan.micro_batches / stage.dp_cp  # a group's share of its tokens
        group = stage.tp_group(0)
        spec = sim.coster.slowest(group)
        overrides: dict[str, ShardStrategy] = {}
        names_seen: dict[str, int] = {}
        for block_hash in sim.coster.block_counts(stage):
            key = (block_hash, stage.tp, spec.name, sim.coster.link_class(group), samples, plan.micro_batches)
            if key in memo:
                hits += 1
            else:
                solves += 1
                try:
                    memo[key] = _solve(sim, block_hash, stage, samples, plan.micro_batches, deadline)
                except OutOfTimeError:
                    return None, solves, hits, True
            solution = memo[key]
            for name in sim.model.block_by_hash[block_hash].ops:
                names_seen[name.name] = names_seen.get(name.name, 0) + 1
            if solution is not None:
                overrides.update(solution.strategies)
        unique = {k: v for k, v in overrides.items() if names_seen.get(k) == 1}
        if unique:
            changed = True
            stages.append(stage.model_copy(update={"sharding": unique}))
        else:
            stages.append(stage)
    if not changed:
        return None, solves, hits, False
    return plan.model_copy(update={"stages": tuple(stages)}), solves, hits, False


def _solve(sim: Simulator, block_hash: str, stage: Stage, samples: float, micro_batches: int,
           deadline: float | None) -> IntraSolution | None:
    group = stage.tp_group(0)
    block = sim.model.block_by_hash[block_hash]

    def comm(collective: object, nbytes: float) -> float:
        return sim.comm.collective(collective, group, nbytes).time_s  # type: ignore[arg-type]

    solutions = solve_block(block, tp=stage.tp, samples=samples, spec=sim.coster.slowest(group),
                            dtype=sim.workload.dtype, calibration=sim.calibration, comm=comm,
                            micro_batches=micro_batches, deadline=deadline)
    return solutions[0] if solutions else None
