"""Memory-bound layer cuts (`search.capacity`): a model that fits a mixed cluster only with a split far from
the compute-balanced one."""

from itertools import combinations

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.search.capacity import Capacity, SampleSplits
from tagplan.search.planner import plan
from tagplan.search.problem import PlanProblem
from tagplan.search.space import PlanSpace, PlanState

TIGHT = ("gpt3-13b", "rtx4090x4:nodes=2+g4dn.12xlarge")  # 8 x 24 GB + 4 x 16 GB for 13B under Adam: 82% full


def tight_sim() -> Simulator:
    model, cluster = TIGHT
    return Simulator(load_model(model, seq_len=2048), load_cluster(cluster), Workload(global_batch=32, seq_len=2048))


GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))  # a stage per node: two RTX 4090 nodes, then the T4 node


def frugal_plan(sim: Simulator, cuts: tuple[int, ...], groups: tuple[tuple[int, ...], ...] = GROUPS, cp: int = 1,
                micro_batches: int = 8) -> Plan:
    """Every group a data-parallel (and context-parallel) stage under ZeRO-3 and full recomputation, split at
    `cuts`; `micro_batches` the most the search may choose (one sample per replica)."""
    bounds = [0, *cuts, len(sim.model.layers)]
    return Plan(micro_batches=micro_batches, schedule=Schedule.ONE_F_ONE_B, stages=tuple(
        Stage(layers=(bounds[k], bounds[k + 1]), devices=group, dp=len(group) // cp, cp=cp, tp=1, recompute=True,
              zero=3) for k, group in enumerate(groups)))


def stage_peak_fits(sim: Simulator, plan: Plan, k: int) -> bool:
    """Whether stage k's devices hold their memory, by the whole plan's memory count (not the per-stage check)."""
    held = sim.memory_bytes(plan)
    return all(held[d] <= sim.cluster.devices[d].spec.mem_bytes for d in plan.stages[k].devices)


def test_the_limits_are_exactly_the_cuts_that_fit() -> None:
    """Every split of the three stages checked by the plan's own memory count: the first stage's feasible ends
    are exactly [floor(0), cap(0, 0)], and from each start the second stage's ends that fit are those up to
    cap(1, start)."""
    sim = tight_sim()
    layers = len(sim.model.layers)
    capacity = PlanSpace(sim)._capacity(PlanState(nodes=(0, 1, 2), stages=3, groups=GROUPS, tps=(1, 1, 1), cp=1))
    assert capacity is not None  # the balanced split (19, 38) does not fit even under ZeRO-3 and full recompute
    feasible = [cuts for cuts in combinations(range(1, layers), 2)
                if all(stage_peak_fits(sim, frugal_plan(sim, cuts), k) for k in range(3))]
    assert feasible  # a split that fits exists
    firsts = {c for c, _ in feasible}
    assert min(firsts) == capacity.floor(0) and max(firsts) == capacity.cap(0, 0)
    for start in sorted(firsts):
        fit_second = [end for end in range(start + 1, layers)
                      if stage_peak_fits(sim, frugal_plan(sim, (start, end)), 1)]
        assert max(fit_second) == capacity.cap(1, start)
    assert min(c for _, c in feasible) == capacity.floor(1)


def test_the_limits_with_context_parallelism_count_samples_per_replica() -> None:
    """With context parallelism a replica's samples are split by sequence over its ranks, so the search may take
    as many micro-batches as there are samples per data-parallel replica (4 here, not 2): the limits are the cuts
    that fit at that count."""
    sim = Simulator(load_model("gpt?layers=6&hidden=8192&heads=64&vocab=8000", seq_len=8192),
                    load_cluster("rtx4090x4+g4dn.12xlarge"), Workload(global_batch=8, seq_len=8192))
    groups = GROUPS[:2]
    capacity = PlanSpace(sim)._capacity(PlanState(nodes=(0, 1), stages=2, groups=groups, tps=(1, 1), cp=2))
    assert capacity is not None
    fitting = [c for c in range(1, len(sim.model.layers))
               if all(stage_peak_fits(sim, frugal_plan(sim, (c,), groups, cp=2, micro_batches=4), k) for k in (0, 1))]
    assert fitting == list(range(capacity.floor(0), capacity.cap(0, 0) + 1))


def test_a_roomy_shape_is_not_bound() -> None:
    sim = Simulator(load_model("gpt3-1.3b", seq_len=2048), load_cluster(TIGHT[1]),
                    Workload(global_batch=32, seq_len=2048))
    space = PlanSpace(sim)
    state = PlanState(nodes=(0, 1, 2), stages=3, groups=GROUPS, tps=(1, 1, 1), cp=1)
    assert space._capacity(state) is None


def test_the_decision_process_offers_the_cuts_that_fit() -> None:
    """On the tight shape every boundary the decision process offers lies inside the limits, the balanced cut first
    moved to the nearest one that fits; so the default completion of the shape is a plan that fits."""
    sim = tight_sim()
    space = PlanSpace(sim)
    state = PlanState(nodes=(0, 1, 2), stages=3, groups=GROUPS, tps=(1, 1, 1), cp=1)
    capacity = space._capacity(state)
    assert capacity is not None
    first = [a.value for a in space.actions(state)]
    assert all(capacity.floor(0) <= c <= capacity.cap(0, 0) for c in first)
    assert first[0] == capacity.cap(0, 0)  # the 4090s would balance to more layers than they hold
    done = space.complete(state)
    assert sim.fits(space.to_plan(done))


def test_the_planner_finds_a_plan_that_fits_where_the_balanced_split_cannot() -> None:
    """Before the limits the planner searched near the compute-balanced split only and answered that no plan fits."""
    model, cluster = TIGHT
    result = plan(PlanProblem(load_model(model, seq_len=2048), load_cluster(cluster),
                              Workload(global_batch=32, seq_len=2048), max_evaluations=200))
    assert result.best.report.fits
    assert set(result.best.plan.devices) == set(range(12))  # the T4 node holds a share: the 4090s cannot hold it all


def test_a_cut_fits_where_the_by_speed_split_fits() -> None:
    """A stage of two RTX 4090s and two T4s given four samples a micro-batch: split by speed (3, 3, 1, 1) the T4s
    hold less than split evenly, so the stage can take more layers. The limit is the by-speed one, and the whole
    plan's memory count confirms that cut."""
    sim = Simulator(load_model("gpt?layers=8&hidden=6144&heads=48&vocab=8000", seq_len=2048),
                    load_cluster("rtx4090x4+g4dn.12xlarge"), Workload(global_batch=32, seq_len=2048))
    space = PlanSpace(sim)
    groups = ((0, 1, 4, 5), (2, 3, 6, 7))

    def even(group: tuple[int, ...], width: int, micro: int) -> set[tuple[int, ...] | None]:
        return {space._samples(group, width, micro, by_speed=False)}

    def limits(splits: SampleSplits) -> Capacity:
        return Capacity(sim, groups, (1, 1), 1, balanced_bounds=[5], micro_batches=4, splits=splits)

    by_speed = space._samples(groups[0], 1, 8, by_speed=True)
    assert by_speed is not None and by_speed[2] < by_speed[0]  # the T4 replicas take fewer samples
    cap = limits(space._sample_splits).cap(0, 0)
    assert cap > limits(even).cap(0, 0)
    plan = Plan(micro_batches=4, schedule=Schedule.ONE_F_ONE_B, stages=(
        Stage(layers=(0, cap), devices=groups[0], dp=4, tp=1, batch_samples=by_speed, recompute=True, zero=3),
        Stage(layers=(cap, len(sim.model.layers)), devices=groups[1], dp=4, tp=1, batch_samples=by_speed,
              recompute=True, zero=3)))
    assert stage_peak_fits(sim, plan, 0)
