import pytest

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.search import planner
from tagplan.search import rebalance as rb
from tagplan.search.planner import SimulatorEvaluator, plan
from tagplan.search.problem import PlanProblem
from tagplan.search.recompute import fewest_per_stage, fully_recomputed
from tagplan.search.space import PlanSpace

MODEL = "llama?layers=16&hidden=1024&heads=8&vocab=4000"  # 18 layers: embedding, 16 blocks, head
MIXED = "dgx-h100+dgx-a100-80gb"


def test_speed_split_gives_layers_in_proportion_to_speed_at_least_one_each() -> None:
    assert rb.speed_split([10, 10], [1.0, 3.0]) == [15, 5]  # speeds 10 and 3.3: one each, 13.5 and 4.5 by remainder
    assert rb.speed_split([1, 17], [1.0, 17.0]) == [9, 9]  # a stage as fast per layer gets as many
    assert rb.speed_split([2, 2, 2], [1.0, 100.0, 100.0]) == [4, 1, 1]  # never below one layer
    with pytest.raises(ValueError, match="one time per stage"):
        rb.speed_split([2, 2], [1.0])


def test_interleaved_keeps_each_groups_layers_round_robin() -> None:
    g0, g1 = (0, 1), (2, 3)
    base = Plan(micro_batches=4, schedule=Schedule.ONE_F_ONE_B,
                stages=(Stage(layers=(0, 7), devices=g0, dp=2), Stage(layers=(7, 10), devices=g1, dp=2)))
    two = rb.interleaved(base, 2)
    assert two is not None and two.schedule is Schedule.INTERLEAVED_1F1B
    assert [(s.layers, s.devices) for s in two.stages] == [((0, 4), g0), ((4, 6), g1), ((6, 9), g0), ((9, 10), g1)]
    assert rb.interleaved(base, 4) is None  # group 1 holds 3 layers: not 4 chunks
    assert rb.interleaved(base.model_copy(update={"micro_batches": 3}), 2) is None  # Megatron: pp divides them


def _grid_plan(sim: Simulator, split: int) -> Plan:
    """Two stages, the H100 node first: `split` layers there, the rest on the A100 node; tp 8."""
    layers = len(sim.model.layers)
    return Plan(micro_batches=8, schedule=Schedule.ONE_F_ONE_B, stages=(
        Stage(layers=(0, split), devices=tuple(range(8)), tp=8),
        Stage(layers=(split, layers), devices=tuple(range(8, 16)), tp=8)))


def test_rebalancing_an_even_split_moves_layers_to_the_faster_gpus_and_is_faster() -> None:
    model = load_model(MODEL, seq_len=2048)
    sim = Simulator(model, load_cluster(MIXED), Workload(global_batch=32, seq_len=2048))
    judge = SimulatorEvaluator(PlanSpace(sim))
    even = judge.candidate(_grid_plan(sim, 9))
    best = rb.rebalance(sim, judge.candidate, even)
    assert best.source == rb.SOURCE
    assert best.report.iteration_time_s < even.report.iteration_time_s
    h100, a100 = (s.layers[1] - s.layers[0] for s in best.plan.stages)
    assert h100 > a100
    times = rb._task_s(best.report)
    assert max(times) / min(times) < max(rb._task_s(even.report)) / min(rb._task_s(even.report))


def test_a_balanced_plan_is_left_as_it_is() -> None:
    model = load_model(MODEL, seq_len=2048)
    sim = Simulator(model, load_cluster("dgx-h100:nodes=2"), Workload(global_batch=32, seq_len=2048))
    judge = SimulatorEvaluator(PlanSpace(sim))
    start = judge.candidate(_grid_plan(sim, 9))
    assert not rb._worth(start.report)  # one GPU type, 8 + 1 and 8 + 1 layers: within IMBALANCE
    assert rb.rebalance(sim, judge.candidate, start) is start
    assert rb.rebalance_seeds(sim, judge.candidate, [start]) == []


def test_the_planner_keeps_the_rebalanced_seeds_as_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a budget too small for the tree search to find a split of its own, the planner's answer is a seed
    split by speed, faster than what the same search returns without the seeds."""
    model, cluster = load_model(MODEL, seq_len=2048), load_cluster(MIXED)
    problem = PlanProblem(model, cluster, Workload(global_batch=32, seq_len=2048), max_evaluations=5)
    seeded = plan(problem)
    assert seeded.best.source == rb.SOURCE
    monkeypatch.setattr(planner, "rebalance_seeds", lambda *args, **kwargs: [])
    unseeded = plan(problem)
    assert all(c.source != rb.SOURCE for c in unseeded.pareto)
    assert seeded.best.report.iteration_time_s < unseeded.best.report.iteration_time_s


def test_a_partly_recomputing_plan_is_resplit_with_the_fewest_layers_recomputed() -> None:
    """A stage that recomputed some blocks before the split recomputes what its new blocks need, none where
    it fits without (`recompute.fewest_per_stage`), not every block."""
    model = load_model(MODEL, seq_len=2048)
    sim = Simulator(model, load_cluster(MIXED), Workload(global_batch=32, seq_len=2048))
    start = _grid_plan(sim, 9)
    start = start.model_copy(update={"stages": tuple(s.model_copy(update={"recompute": True, "recompute_layers": 1})
                                                     for s in start.stages)})
    fitted = fewest_per_stage(sim, rb.resplit(start, [11, 7]))
    assert fitted is not None
    assert not any(s.recompute and s.recompute_layers is None for s in fitted.stages)  # nothing recomputes all
    assert sim.fits(fitted)


def test_fewest_per_stage_is_none_where_even_full_recompute_does_not_fit() -> None:
    model = load_model("llama?layers=16&hidden=4096&heads=32&vocab=4000", seq_len=4096)
    sim = Simulator(model, load_cluster("p3.8xlarge"), Workload(global_batch=64, seq_len=4096))
    one_gpu_each = Plan(micro_batches=1, schedule=Schedule.ONE_F_ONE_B, stages=(
        Stage(layers=(0, 9), devices=(0,)), Stage(layers=(9, 18), devices=(1,))))
    assert not sim.fits(fully_recomputed(one_gpu_each))
    assert fewest_per_stage(sim, one_gpu_each) is None


def test_the_fastest_rebalanced_1f1b_plans_are_also_tried_interleaved() -> None:
    model = load_model(MODEL, seq_len=2048)
    sim = Simulator(model, load_cluster(MIXED), Workload(global_batch=32, seq_len=2048))
    judge = SimulatorEvaluator(PlanSpace(sim))
    rb.rebalance_seeds(sim, judge.candidate, [judge.candidate(_grid_plan(sim, 9))])
    interleaved = [c for c in judge.candidates.values()
                   if c.source == rb.SOURCE and c.plan.schedule is Schedule.INTERLEAVED_1F1B]
    assert interleaved
    assert {len(c.plan.stages) for c in interleaved} <= {2 * n for n in rb.INTERLEAVE_CHUNKS}
