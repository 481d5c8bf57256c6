"""Memos kept per cluster object: shared by a fit's simulators, never stale, dropped with the cluster."""

import gc

from tagplan.cost.calibration import Calibration, LinkScale, calibrated_cluster
from tagplan.cost.object_memo import object_memo
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.ir.workload import Workload


def _case() -> tuple[object, object, Workload, Plan]:
    model = load_model("gpt?layers=4&hidden=256&heads=4&vocab=1000", seq_len=128)
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    n = len(model.layers)
    plan = Plan(micro_batches=4, schedule=Schedule.ONE_F_ONE_B,
                stages=(Stage(layers=(0, n // 2), dp=4, tp=2, devices=tuple(range(8))),
                        Stage(layers=(n // 2, n), dp=4, tp=2, devices=tuple(range(8, 16)))))
    return model, cluster, Workload(global_batch=16, seq_len=128), plan


def test_memo_is_dropped_with_its_owner() -> None:
    class Owner:
        pass

    owner = Owner()
    object_memo(owner, "t")["x"] = 1
    assert object_memo(owner, "t") == {"x": 1}
    assert object_memo(owner, "other") == {}
    del owner
    gc.collect()
    assert object_memo(Owner(), "t") == {}  # a new object, possibly at the same id, starts empty


def test_calibrated_cluster_is_shared_while_the_link_figures_are_equal() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    slow = {"*/inter": LinkScale(bandwidth_scale=0.5)}
    first = calibrated_cluster(cluster, Calibration(link_scales=slow))
    # another fit try that moves only the compute scale gets the same calibrated cluster (and its memos)
    assert calibrated_cluster(cluster, Calibration(link_scales=slow, compute_scale={"*": 1.3})) is first
    other = calibrated_cluster(cluster, Calibration(link_scales={"*/inter": LinkScale(bandwidth_scale=0.25)}))
    assert other is not first
    assert other.link(0, 8).bandwidth_Bps == first.link(0, 8).bandwidth_Bps / 2


def test_simulators_sharing_a_cluster_give_what_fresh_ones_give() -> None:
    model, cluster, workload, plan = _case()
    slow = {"*/inter": LinkScale(bandwidth_scale=0.5, latency_s=1e-4)}
    times = []
    for scale in (1.0, 1.5):
        calibration = Calibration(link_scales=slow, compute_scale={"*": scale})
        shared = Simulator(model, cluster, workload, calibration=calibration).simulate(plan)
        fresh = Simulator(model, load_cluster("dgx-a100-80gb:nodes=2"), workload,
                          calibration=calibration).simulate(plan)
        assert shared.iteration_time_s == fresh.iteration_time_s
        times.append(shared.iteration_time_s)
    assert times[1] > times[0]
    a = Simulator(model, cluster, workload, calibration=Calibration(link_scales=slow))
    b = Simulator(model, cluster, workload, calibration=Calibration(link_scales=slow, compute_scale={"*": 2.0}))
    assert a.comm.memo is b.comm.memo  # the group topologies are computed once per cluster
    # a link scale that changes gives other topologies, and a slower iteration
    thin = {"*/inter": LinkScale(bandwidth_scale=0.05, latency_s=1e-4)}
    slower = Simulator(model, cluster, workload, calibration=Calibration(link_scales=thin))
    assert slower.comm.memo is not a.comm.memo
    assert slower.simulate(plan).iteration_time_s > a.simulate(plan).iteration_time_s
