"""Memos kept per cluster object: shared by a fit's simulators, never stale, dropped with the cluster."""

import gc
import weakref

from tagplan.cost.calibration import (
    CALIBRATED_VARIANTS,
    INTER,
    Calibration,
    LinkFit,
    LinkScale,
    calibrated_cluster,
    link_key,
)
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
    key = ("t", id(owner))
    assert key in object_memo_tables()
    del owner
    gc.collect()
    assert key not in object_memo_tables()
    assert object_memo(Owner(), "t") == {}  # a new object, possibly at the same id, starts empty


def object_memo_tables() -> dict[tuple[str, int], dict[object, object]]:
    from tagplan.cost import object_memo as module

    return module._TABLES


def test_a_calibration_that_changes_nothing_does_not_keep_the_cluster_alive() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    # a fit of a device type this cluster does not have: the calibrated cluster is the cluster itself
    other = Calibration(link_scales={"H100-SXM-80GB/inter": LinkScale(bandwidth_scale=0.5)})
    assert calibrated_cluster(cluster, other) is cluster
    assert calibrated_cluster(cluster, other) is cluster  # from the memo
    Simulator(*_case()[:1], cluster, Workload(global_batch=16, seq_len=128), calibration=other)
    alive = weakref.ref(cluster)
    key = ("calibrated_cluster", id(cluster))
    del cluster
    gc.collect()
    assert alive() is None and key not in object_memo_tables()


def test_measured_links_and_latencies_are_part_of_the_key() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    fits = [Calibration(links={link_key("A100-SXM-80GB", INTER): LinkFit(bandwidth_Bps=bw, latency_s=lat)})
            for bw, lat in ((10e9, 1e-5), (20e9, 1e-5), (10e9, 2e-5))]
    copies = [calibrated_cluster(cluster, f) for f in fits]
    assert len({id(c) for c in copies}) == 3
    assert copies[0].link(0, 8).bandwidth_Bps != copies[1].link(0, 8).bandwidth_Bps
    assert copies[0].network.latency_s != copies[2].network.latency_s
    assert [calibrated_cluster(cluster, f) for f in fits] == copies


def test_the_least_recently_used_copy_is_dropped_past_the_limit() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    scales = [Calibration(link_scales={"*/inter": LinkScale(bandwidth_scale=0.1 * (k + 1))})
              for k in range(CALIBRATED_VARIANTS + 1)]
    first = calibrated_cluster(cluster, scales[0])
    for c in scales[1:CALIBRATED_VARIANTS]:
        calibrated_cluster(cluster, c)
    assert calibrated_cluster(cluster, scales[0]) is first  # used again: now the most recent
    calibrated_cluster(cluster, scales[CALIBRATED_VARIANTS])  # evicts scales[1], the least recently used
    assert calibrated_cluster(cluster, scales[0]) is first
    assert len(object_memo(cluster, "calibrated_cluster")) == CALIBRATED_VARIANTS


def test_simulators_of_one_runtime_share_the_attention_kernels_copy() -> None:
    model, cluster, workload, _ = _case()
    unfused = workload.model_copy(update={"fused_attention": False})
    a, b = Simulator(model, cluster, unfused), Simulator(model, cluster, unfused)
    assert a.cluster is b.cluster and a.cluster is not cluster
    assert a.comm.memo is b.comm.memo
    assert not any(d.spec.fused_attention for d in a.cluster.devices)


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
