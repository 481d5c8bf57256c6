"""The closed-form estimate: exact where the schedule has nothing to overlap, close elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from tagplan.cost.estimate import estimate
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Plan, Schedule, Stage, Workload
from tagplan.search.space import PlanSpace

WORKLOAD = Workload(global_batch=16, seq_len=128)


def sim(cluster_spec: str = "p3.8xlarge+g4dn.12xlarge") -> Simulator:
    return Simulator(load_model("gpt?layers=8&hidden=512&heads=8&vocab=1000", seq_len=128),
                     load_cluster(cluster_spec), WORKLOAD)


def test_one_stage_one_device_is_exact() -> None:
    s = sim()
    plan = Plan(stages=(Stage(layers=(0, len(s.model.layers)), devices=(0,)),), micro_batches=4)
    est = estimate(s, plan)
    report = s.simulate(plan)
    assert est.iteration_s == pytest.approx(report.iteration_time_s, rel=1e-9)
    assert est.p2p_s == 0.0 and est.dp_s == 0.0 and est.exposed_dp_s == 0.0
    assert est.busy_s == pytest.approx(4 * est.stage_s[0])


def test_a_pipeline_adds_its_fill_and_drain() -> None:
    s = sim()
    n = len(s.model.layers)
    one = Plan(stages=(Stage(layers=(0, n // 2), devices=(0,)), Stage(layers=(n // 2, n), devices=(1,))),
               micro_batches=8)
    est = estimate(s, one)
    slow = est.stage_s.max()
    period = max(slow, (est.stage_s.sum() + est.p2p_s) / 2)  # 1F1B: two micro-batches in flight
    assert est.pipeline_s == pytest.approx(8 * period + est.stage_s.sum() + est.p2p_s - period)
    gpipe = estimate(s, one.model_copy(update={"schedule": Schedule.GPIPE}))
    assert gpipe.pipeline_s == pytest.approx(8 * slow + est.stage_s.min() + est.p2p_s)
    assert est.iteration_s == pytest.approx(s.simulate(one).iteration_time_s, rel=0.05)


def test_gradient_sync_counts_only_where_the_backward_cannot_hide_it() -> None:
    s = sim("p3.8xlarge:nodes=2")
    n = len(s.model.layers)
    plan = Plan(stages=(Stage(layers=(0, n), devices=(0, 4), dp=2),), micro_batches=2)
    est = estimate(s, plan)
    assert est.dp_s > 0.0
    assert est.dp_s / n <= est.exposed_dp_s <= est.dp_s
    assert est.iteration_s >= est.pipeline_s + est.exposed_dp_s


def test_close_to_the_simulator_on_the_plans_a_search_meets() -> None:
    s = sim("p3.8xlarge:nodes=2+g4dn.12xlarge")
    space = PlanSpace(s)
    root = space.on_every_node()
    plans = {space.to_plan(space.complete(space.step(root, a))) for a in space.actions(root)}
    ratios = np.array([estimate(s, p).iteration_s / s.simulate(p).iteration_time_s for p in plans])
    assert len(ratios) >= 3
    assert np.median(np.abs(ratios - 1.0)) < 0.1, ratios
