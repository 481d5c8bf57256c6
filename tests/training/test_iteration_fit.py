"""Iteration calibration: recovers known physical parameters from simulator-made records; refuses a worse one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tagplan.cli import main
from tagplan.cost.baselines import megatron_plan
from tagplan.cost.calibration import DEFAULT_CALIBRATION, LinkScale
from tagplan.cost.simulator import Simulator
from tagplan.datasets.traces.bundle import Fingerprint, IterationRecord, Manifest, now_iso, write_bundle
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.workload import Workload
from tagplan.training.iteration_fit import (
    IterationCase,
    fit_parameters,
    kendall_tau,
    parameters,
    predict_s,
    read_values,
    rebuild_cases,
)

MODEL = "gpt?layers=4&hidden=512&heads=8&vocab=4096"
CLUSTER = "dgx-a100-80gb:nodes=1"
WORKLOAD = Workload(global_batch=16, seq_len=256)
A100 = "A100-SXM-80GB"
TRUTH = DEFAULT_CALIBRATION.model_copy(update={"name": "truth", "compute_scale": {A100: 1.5},
                                               "micro_batch_overhead_s": {A100: 1e-3},
                                               "iteration_overhead_s": {A100: 1e-2}})


def cases(calibration=TRUTH, workload=WORKLOAD) -> list[IterationCase]:  # type: ignore[no-untyped-def]
    model, cluster = load_model(MODEL, seq_len=workload.seq_len), load_cluster(CLUSTER)
    sim = Simulator(model, cluster, workload)
    out = []
    for tp, pp in ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (1, 4), (2, 4)):
        base = megatron_plan(sim, tp=tp, pp=pp).plan
        assert base is not None
        dp = 8 // (tp * pp)
        for m in sorted({1, 2, WORKLOAD.global_batch // dp}):
            plan = base.model_copy(update={"micro_batches": m})
            seconds = Simulator(model, cluster, workload, calibration=calibration).simulate(plan).iteration_time_s
            out.append(IterationCase(model, cluster, workload, plan, seconds))
    return out


@pytest.mark.slow
def test_fit_recovers_the_parameters_that_made_the_records() -> None:
    fitted, values = fit_parameters(cases(), DEFAULT_CALIBRATION)
    assert values["compute_scale/A100-SXM-80GB"] == pytest.approx(1.5, rel=0.1)
    assert fitted.iteration_overhead_s[A100] == pytest.approx(1e-2, rel=0.25, abs=1e-3)
    assert fitted.micro_batch_overhead_s[A100] == pytest.approx(1e-3, rel=0.35, abs=3e-4)
    assert f"bandwidth_scale/{A100}/inter" not in values  # one node: no record sees an inter-node link
    assert fitted.overhead_s("iteration_overhead_s", "V100-SXM2-16GB") == 0.0  # other device types untouched


def test_kendall_tau() -> None:
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1, 1], [1, 1]) is None


def write_records(path: Path, items: list[IterationCase]) -> None:
    records = [IterationRecord(model=MODEL, cluster=CLUSTER, workload=c.workload, plan=c.plan.model_dump(mode="json"),
                               measured_s=c.measured_s) for c in items]
    manifest = Manifest(created=now_iso(), source="test", fingerprint=Fingerprint(device_type="A100-SXM-80GB"))
    write_bundle(path, manifest, records)


@pytest.mark.slow
def test_calibrate_refuses_a_calibration_worse_than_the_one_it_replaces(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_records(tmp_path / "b", cases()[::4])
    out = tmp_path / "calib.json"
    out.write_text(TRUTH.model_dump_json())  # exact on these records: nothing fitted can beat it
    args = ["calibrate", str(tmp_path / "b"), "--out", str(out), "--folds", "2", "--device", "H100-SXM"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not written" in err and "--force" in err and "'H100-SXM'" in err  # and the fingerprint warning
    assert json.loads(out.read_text())["name"] == "truth"
    assert main([*args, "--force", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["held_out"]["replaced"] == pytest.approx(0.0, abs=1e-9)
    assert json.loads(out.read_text())["name"] == "calib"


@pytest.mark.slow
def test_a_fit_never_makes_a_link_more_than_twice_its_rated_speed() -> None:
    """Records made with the network 4x faster than rated: the fit stops at the bound, 2x."""
    model, cluster = load_model(MODEL, seq_len=WORKLOAD.seq_len), load_cluster("p3.8xlarge:nodes=2")
    fast = DEFAULT_CALIBRATION.model_copy(update={"link_scales": {"*/inter": LinkScale(bandwidth_scale=4.0)}})
    sim = Simulator(model, cluster, WORKLOAD)
    records = []
    for tp, pp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
        plan = megatron_plan(sim, tp=tp, pp=pp).plan
        assert plan is not None
        seconds = Simulator(model, cluster, WORKLOAD, calibration=fast).simulate(plan).iteration_time_s
        records.append(IterationCase(model, cluster, WORKLOAD, plan, seconds))
    _, values = fit_parameters(records, DEFAULT_CALIBRATION, max_steps=15)
    assert 1.5 < values["bandwidth_scale/V100-SXM2-16GB/inter"] <= 2.0


def test_a_recomputed_stage_pays_the_checkpoint_overhead_per_layer_and_micro_batch() -> None:
    model, cluster = load_model(MODEL, seq_len=WORKLOAD.seq_len), load_cluster(CLUSTER)
    base = megatron_plan(Simulator(model, cluster, WORKLOAD), tp=1, pp=1).plan
    assert base is not None
    plan = base.model_copy(update={"micro_batches": 2, "stages": tuple(
        s.model_copy(update={"recompute": True}) for s in base.stages)})
    slow = DEFAULT_CALIBRATION.model_copy(update={"recompute_overhead_s": {A100: 1e-3}})
    times = [Simulator(model, cluster, WORKLOAD, calibration=c).simulate(p).iteration_time_s
             for c in (DEFAULT_CALIBRATION, slow) for p in (plan, base.model_copy(update={"micro_batches": 2}))]
    layers = 4  # the transformer blocks; the embedding and head are not checkpointed
    assert times[2] - times[0] == pytest.approx(2 * layers * 1e-3, rel=1e-6)  # 2 micro-batches x layers
    assert times[3] == pytest.approx(times[1])  # a stage that does not recompute is untouched


@pytest.mark.slow
def test_fit_recovers_the_recompute_overhead() -> None:
    truth = TRUTH.model_copy(update={"recompute_overhead_s": {A100: 2e-3}})
    plain = cases(truth)
    recomputed = [IterationCase(c.model, c.cluster, c.workload, plan, Simulator(
        c.model, c.cluster, c.workload, calibration=truth).simulate(plan).iteration_time_s)
        for c in plain[::2] for plan in [c.plan.model_copy(update={"stages": tuple(
            s.model_copy(update={"recompute": True}) for s in c.plan.stages)})]]
    fitted, values = fit_parameters(plain + recomputed, DEFAULT_CALIBRATION)
    assert values[f"recompute_overhead_s/{A100}"] == pytest.approx(fitted.recompute_overhead_s[A100])
    assert fitted.recompute_overhead_s[A100] == pytest.approx(2e-3, rel=0.35)
    assert f"recompute_overhead_s/{A100}" not in fit_parameters(plain, DEFAULT_CALIBRATION)[1]  # unseen: not fitted


def test_collectives_pay_the_collective_overhead_and_pipeline_sends_do_not() -> None:
    model = load_model("llama?layers=4&hidden=512&heads=8&kv_heads=8&vocab=4096", seq_len=WORKLOAD.seq_len)
    cluster = load_cluster(CLUSTER)
    sim = Simulator(model, cluster, WORKLOAD)
    synced = DEFAULT_CALIBRATION.model_copy(update={"collective_overhead_s": {A100: 5e-3}})
    pipeline = megatron_plan(sim, tp=1, pp=2).plan
    tensor = megatron_plan(sim, tp=2, pp=1).plan
    assert pipeline is not None and tensor is not None
    pipeline = pipeline.model_copy(update={"micro_batches": 4, "stages": tuple(  # one device per stage: sends only
        s.model_copy(update={"devices": s.devices[:1], "dp": 1, "zero": 0}) for s in pipeline.stages)})
    tensor = tensor.model_copy(update={"stages": tuple(
        s.model_copy(update={"devices": s.devices[:2], "dp": 1, "zero": 0}) for s in tensor.stages)})
    before, after = (Simulator(model, cluster, WORKLOAD, calibration=c) for c in (DEFAULT_CALIBRATION, synced))
    assert after.simulate(pipeline).iteration_time_s == pytest.approx(before.simulate(pipeline).iteration_time_s)
    calls = 2 * 4  # at least the two all-reduces per block forward (attention and MLP outputs), 4 blocks
    assert after.simulate(tensor).iteration_time_s - before.simulate(tensor).iteration_time_s >= calls * 5e-3
    other = DEFAULT_CALIBRATION.model_copy(update={"collective_overhead_s": {"V100-SXM2-16GB": 5e-3}})
    assert Simulator(model, cluster, WORKLOAD, calibration=other).simulate(tensor).iteration_time_s == pytest.approx(
        before.simulate(tensor).iteration_time_s)  # keyed by device type: another type's overhead changes nothing


@pytest.mark.slow
def test_fit_tells_the_collective_overhead_from_the_link_latency() -> None:
    """Records made with 2 ms per collective call: the fit puts it on the collectives, not on the
    link latency that pipeline sends pay too."""
    fitted, values = fit_parameters(cases(TRUTH.model_copy(update={"collective_overhead_s": {A100: 2e-3}})),
                                    DEFAULT_CALIBRATION)
    assert fitted.collective_overhead_s[A100] == pytest.approx(2e-3, rel=0.35)
    assert values.get(f"latency_s/{A100}/intra", 0.0) < 5e-4


def test_equal_links_with_other_device_types_do_not_share_a_collective_overhead() -> None:
    """Tensor-parallel times are memoised per link class; the overhead of the group's device type is part of it."""
    model = load_model("llama?layers=4&hidden=512&heads=8&kv_heads=8&vocab=4096", seq_len=WORKLOAD.seq_len)
    cluster = load_cluster("dgx-a100-80gb+dgx-a100-80gb:gpu=A100-SXM-40GB")
    sim = Simulator(model, cluster, WORKLOAD)
    plan = megatron_plan(sim, tp=8, pp=1).plan
    assert plan is not None
    on = [plan.model_copy(update={"stages": tuple(s.model_copy(update={"devices": tuple(range(8 * n, 8 * n + 8)),
                                                                     "dp": 1, "zero": 0}) for s in plan.stages)})
          for n in (0, 1)]
    synced = DEFAULT_CALIBRATION.model_copy(update={"collective_overhead_s": {"A100-SXM-40GB": 5e-3}})
    fresh = Simulator(model, cluster, WORKLOAD, calibration=synced).simulate(on[1]).iteration_time_s
    shared = Simulator(model, cluster, WORKLOAD, calibration=synced)
    shared.simulate(on[0])  # the 80 GB node first: its groups have the same link figures, no overhead
    assert shared.simulate(on[1]).iteration_time_s == pytest.approx(fresh)
    assert fresh > Simulator(model, cluster, WORKLOAD).simulate(on[1]).iteration_time_s + 8 * 5e-3


@pytest.mark.slow
def test_fit_recovers_the_host_dispatch_floor_of_eager_runs_on_gpus() -> None:
    truth = TRUTH.model_copy(update={"host_dispatch_s": {A100: 2e-5}})
    eager = WORKLOAD.model_copy(update={"eager": True})
    made = cases(truth, eager)
    fitted, values = fit_parameters(made, DEFAULT_CALIBRATION)
    assert fitted.host_dispatch_s[A100] == pytest.approx(2e-5, rel=0.3)
    assert values[f"host_dispatch_s/{A100}"] == pytest.approx(fitted.host_dispatch_s[A100])
    no_floor = TRUTH.model_copy(update={"eager_host_dispatch_s": 0.0})  # not even the shipped eager one
    floor_free = Simulator(made[0].model, made[0].cluster, eager, calibration=no_floor).simulate(made[0].plan)
    assert made[0].measured_s > 1.2 * floor_free.iteration_time_s  # the floor shaped these records
    fused = IterationCase(made[0].model, made[0].cluster, WORKLOAD, made[0].plan, made[0].measured_s)
    assert not any(p.name.startswith("host_dispatch") for p in parameters([fused]))  # a fused runtime's run


def _cpu_cases(calibration, workload: Workload) -> list[IterationCase]:  # type: ignore[no-untyped-def]
    from tagplan.frontends.cpu import build_cpu_cluster

    spec = load_cluster(CLUSTER).devices[0].spec.model_copy(update={"name": "cpu-test"})
    cluster = build_cpu_cluster(spec)
    out = []
    # two families: per micro-batch a fixed overhead and the kernels' dispatch differ only by the kernel count
    for spec in ("llama?layers=2&hidden=128&heads=4&kv_heads=2&vocab=512", "gpt?layers=2&hidden=128&heads=4&vocab=512"):
        model = load_model(spec, seq_len=workload.seq_len)
        sim = Simulator(model, cluster, workload, calibration=calibration)
        base = megatron_plan(Simulator(model, cluster, workload), tp=1, pp=1).plan
        assert base is not None
        for m in (1, 2, 4, 8, 16):
            for recompute in (False, True):
                plan = base.model_copy(update={"micro_batches": m, "stages": (
                    base.stages[0].model_copy(update={"recompute": recompute}),)})
                out.append(IterationCase(model, cluster, workload, plan, sim.simulate(plan).iteration_time_s))
    return out


@pytest.mark.slow
def test_fit_recovers_a_cpus_dispatch_time_per_kernel_added_to_its_ops() -> None:
    eager = WORKLOAD.model_copy(update={"eager": True, "dtype": "fp32"})
    truth = DEFAULT_CALIBRATION.model_copy(update={"host_dispatch_s": {"cpu-test": 2e-5}})
    made = _cpu_cases(truth, eager)
    host = [p for p in parameters(made) if p.name.startswith("host_dispatch")]
    assert [(p.name, p.start) for p in host] == [("host_dispatch_s/cpu-test", 0.0)]  # not the GPU host's default
    assert read_values(DEFAULT_CALIBRATION, host, 1.0).tolist() == [0.0]
    gpu = cases(TRUTH, eager)[0]  # a GPU's eager run among them: the figure is filed under *, from the GPU default
    mixed = [p for p in parameters([made[0], gpu]) if p.name.startswith("host_dispatch")]
    assert [(p.name, p.start) for p in mixed] == [("host_dispatch_s/*", None)]
    assert read_values(DEFAULT_CALIBRATION, mixed, 1.0).tolist() == [DEFAULT_CALIBRATION.eager_host_dispatch_s]
    untouched = Simulator(made[0].model, made[0].cluster, eager).simulate(made[0].plan).iteration_time_s
    assert made[0].measured_s > 1.1 * untouched  # the CPU's dispatch adds to its ops' time (no default there)
    fitted, _ = fit_parameters(made, DEFAULT_CALIBRATION)
    assert fitted.host_dispatch_s["cpu-test"] == pytest.approx(2e-5, rel=0.3)


def test_one_simulator_per_problem_predicts_as_a_fresh_one_per_record() -> None:
    """`predict_s` shares a simulator between the cases of one model, cluster and workload: the same seconds as a
    new simulator for each, and nothing carried from one calibration to the next call's."""
    made = cases()
    fresh = [Simulator(c.model, c.cluster, c.workload, calibration=TRUTH).simulate(c.plan).iteration_time_s
             for c in made]
    assert predict_s(made, TRUTH).tolist() == fresh
    assert predict_s(made, DEFAULT_CALIBRATION).tolist() != fresh  # the calibration does count
    assert predict_s(made, TRUTH).tolist() == fresh


def test_records_naming_one_problem_share_its_objects() -> None:
    made = cases()[:3]
    longer = WORKLOAD.model_copy(update={"seq_len": 2 * WORKLOAD.seq_len})
    workloads = (WORKLOAD, WORKLOAD, longer)
    records = [IterationRecord(model=MODEL, cluster=CLUSTER, workload=w, plan=c.plan.model_dump(mode="json"),
                               measured_s=c.measured_s) for c, w in zip(made, workloads, strict=True)]
    rebuilt = rebuild_cases(records)
    assert rebuilt[0].model is rebuilt[1].model and rebuilt[0].workload is rebuilt[1].workload
    assert rebuilt[0].cluster is rebuilt[1].cluster is rebuilt[2].cluster
    assert rebuilt[2].model is not rebuilt[0].model and rebuilt[2].model.seq_len == 2 * WORKLOAD.seq_len


def zero3_cases(truth, micro_batches=(1, 2, 4, 8), nodes=(2, 4), seq=256,  # type: ignore[no-untyped-def]
                hidden=2048):
    """ZeRO-3 data parallelism over DGX nodes, the gathers crossing the network, timed under `truth` (at `seq` 256
    the fetches outlast the compute, at 2048 the compute outlasts them; the fetches grow with `hidden` squared)."""
    from tagplan.ir.plan import Plan, Stage

    model = load_model(f"gpt?layers=4&hidden={hidden}&heads=16&vocab=4096", seq_len=seq)
    out = []
    for n in nodes:
        cluster = load_cluster(f"dgx-a100-80gb:nodes={n}")
        workload = Workload(global_batch=8 * n * 8, seq_len=seq)
        stage = Stage(layers=(0, len(model.layers)), devices=tuple(range(8 * n)), dp=8 * n, zero=3)
        for m in micro_batches:
            plan = Plan(micro_batches=m, stages=(stage,))
            seconds = Simulator(model, cluster, workload, calibration=truth).simulate(plan).iteration_time_s
            out.append(IterationCase(model, cluster, workload, plan, seconds))
    return out


def test_zero3_collectives_take_the_calibrated_seconds_and_hidden_fraction() -> None:
    """`zero3_comm_scale` multiplies a ZeRO-3 stage's per-micro-batch gathers and reduce-scatters;
    `zero3_hidden_fraction` is how much of the shorter of a task's compute and fetches runs under the other: 1 (the
    default) the task takes the longer of the two, 0 their sum, and the task time is linear in between."""
    (case,) = zero3_cases(DEFAULT_CALIBRATION, micro_batches=(4,), nodes=(4,))

    def timing(**update):  # type: ignore[no-untyped-def]
        calibration = DEFAULT_CALIBRATION.model_copy(update=update)
        (cost,), (task,) = Simulator(case.model, case.cluster, case.workload,
                                     calibration=calibration).stage_costs(case.plan)
        return cost, task

    cost, hidden = timing()
    gather, reduce = cost.zero3_s
    assert gather > 0 and reduce > gather  # the backward gathers again and reduce-scatters
    assert hidden.forward_s == max(cost.critical.forward_s, gather)
    slow_cost, exposed = timing(zero3_comm_scale={A100: 3.0}, zero3_hidden_fraction={A100: 0.0})
    assert slow_cost.zero3_s == pytest.approx((3 * gather, 3 * reduce))
    assert exposed.forward_s == pytest.approx(cost.critical.forward_s + 3 * gather)
    assert exposed.backward_s == pytest.approx(cost.critical.backward_s + 3 * reduce)
    _, none = timing(zero3_hidden_fraction={"*": 0.0})
    _, half = timing(zero3_hidden_fraction={"*": 0.5})
    assert none.forward_s > hidden.forward_s
    assert half.forward_s == pytest.approx((hidden.forward_s + none.forward_s) / 2)
    # a plan without ZeRO-3 is untouched, and so is another device type
    sim = Simulator(case.model, case.cluster, case.workload)
    slow = DEFAULT_CALIBRATION.model_copy(update={"zero3_comm_scale": {A100: 3.0}, "zero3_hidden_fraction": {A100: 0}})
    zero1 = case.plan.model_copy(update={"stages": (case.plan.stages[0].model_copy(update={"zero": 1}),)})
    assert (Simulator(case.model, case.cluster, case.workload, calibration=slow).simulate(zero1).iteration_time_s
            == sim.simulate(zero1).iteration_time_s)
    other = DEFAULT_CALIBRATION.model_copy(update={"zero3_comm_scale": {"V100-SXM2-16GB": 3.0}})
    assert (Simulator(case.model, case.cluster, case.workload, calibration=other).simulate(case.plan).iteration_time_s
            == sim.simulate(case.plan).iteration_time_s)


def test_a_calibration_refuses_zero3_figures_out_of_range() -> None:
    from tagplan.cost.calibration import Calibration

    with pytest.raises(ValueError, match=r"zero3_comm_scale must be > 0.*'A100-SXM-80GB': -1"):
        Calibration(zero3_comm_scale={A100: -1.0})
    with pytest.raises(ValueError, match=r"zero3_hidden_fraction must be in \[0, 1\].*7"):
        Calibration(zero3_hidden_fraction={"*": 7.0})


@pytest.mark.slow
def test_fit_recovers_how_slow_and_how_hidden_the_zero3_collectives_are() -> None:
    """Records of a runtime whose ZeRO-3 fetches take 4x the link model's seconds, 0.3 of them hidden, some
    comm-bound and some compute-bound, of two model widths: the fit recovers the fraction and the fetches' seconds
    (as the ratio of its ZeRO-3 scale to its link scale), predicts node counts it never saw (3, and 6
    beyond the 2 and 4 it saw) where the defaults are 1.5x or more too fast; records without ZeRO-3 stages leave
    both figures unset."""
    truth = DEFAULT_CALIBRATION.model_copy(update={"zero3_comm_scale": {A100: 4.0},
                                                   "zero3_hidden_fraction": {A100: 0.3}})
    records = (zero3_cases(truth) + zero3_cases(truth, micro_batches=(1, 4), seq=2048)
               + zero3_cases(truth, micro_batches=(1, 4), hidden=1024))  # a per-micro-batch overhead cannot stand in
    fitted, values = fit_parameters(records, DEFAULT_CALIBRATION)
    # with no other collectives in the records, a slower link and slower fetches are one figure: their ratio
    seconds_scale = values[f"zero3_comm_scale/{A100}"] / values[f"bandwidth_scale/{A100}/inter"]
    assert seconds_scale == pytest.approx(4.0, rel=0.25)
    assert values[f"zero3_hidden_fraction/{A100}"] == pytest.approx(0.3, abs=0.15)
    held_out = zero3_cases(truth, micro_batches=(2, 8), nodes=(3, 6))
    truth_s = np.array([c.measured_s for c in held_out])
    assert np.all(predict_s(held_out, DEFAULT_CALIBRATION) < truth_s / 1.5)
    assert predict_s(held_out, fitted) == pytest.approx(truth_s, rel=0.1)
    plain, _ = fit_parameters(cases(), DEFAULT_CALIBRATION, max_steps=3)
    assert plain.zero3_comm_scale == {} and plain.zero3_hidden_fraction == {}
