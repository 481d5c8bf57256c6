"""The practitioner baselines: finding by memory alone what cannot fit changes nothing but the work."""

from __future__ import annotations

import functools

import pytest

from tagplan.cost.memory import model_state_bytes
from tagplan.cost.simulator import Simulator
from tagplan.export.megatron import megatron_arguments
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.search import baselines
from tagplan.search.baselines import _configurations, fastest_type_nodes, run_baselines
from tagplan.search.planner import SimulatorEvaluator
from tagplan.search.recompute import fewest_recomputed
from tagplan.search.result import Baseline, Candidate
from tagplan.search.space import PlanSpace, divisors

# (model, cluster, global batch, sequence): each has configurations that fit and others that do not
CASES = [
    ("gpt3-13b", "dgx-a100-40gb:nodes=2", 64, 1024),
    ("gpt3-2.7b", "p3.8xlarge:nodes=2+g4dn.12xlarge", 48, 512),
    ("gpt3-6.7b", "dgx-a100-80gb+p3.16xlarge", 32, 1024),
]


def simulator(model: str, cluster: str, batch: int, seq: int) -> Simulator:
    return Simulator(load_model(model, seq_len=seq), load_cluster(cluster), Workload(global_batch=batch, seq_len=seq))


def grid_plans(sim: Simulator) -> list[Plan]:
    """Every uniform configuration the grid walks, both node orders, every micro-batch size."""
    nodes = tuple(range(len(sim.cluster.nodes)))
    plans = []
    for order in (nodes, tuple(reversed(nodes))):
        devices = tuple(d for n in order for d in sim.cluster.node_devices(n))
        gpus = {node.gpus for node in sim.cluster.nodes}
        for tp in [t for t in (1, 2, 4, 8) if all(g % t == 0 for g in gpus)]:
            for pp in divisors(len(devices) // tp):
                for by_chunks in _configurations(sim, devices, tp, pp, "order"):
                    plans += [plan for _, series in by_chunks for _, plan in series]
    return plans


@pytest.mark.parametrize("case", CASES)
def test_the_memory_count_alone_agrees_with_the_simulation(case: tuple[str, str, int, int]) -> None:
    """`Simulator.fits` (memory terms only) says what `simulate(...).fits` says, on 1F1B and
    interleaved grid plans of every memory option, plans that fit and plans that do not."""
    sim = simulator(*case)
    plans = grid_plans(sim)
    sample = plans[:: max(len(plans) // 150, 1)]
    verdicts = [sim.fits(p) for p in sample]
    assert any(verdicts) and not all(verdicts)  # both kinds are checked
    assert any(p.schedule.value == "interleaved_1f1b" for p in sample)
    for plan, verdict in zip(sample, verdicts, strict=True):
        report = sim.simulate(plan)
        assert verdict == report.fits, plan
        assert sim.memory_bytes(plan) == dict(zip(report.devices, report.memory_per_device_bytes, strict=True))


def test_the_memory_count_agrees_on_uneven_shares_of_mixed_groups() -> None:
    """Replicas of unequal GPUs with unequal whole-sample shares, every ZeRO stage: the count follows
    each replica's own samples."""
    sim = simulator("gpt3-1.3b", "p3.8xlarge+g4dn.12xlarge", 48, 1024)
    verdicts = set()
    for micro_batches in (1, 2, 3, 6):
        per_group = 48 // micro_batches // 4  # samples per micro-batch for a V100 and a T4 replica together
        for v100 in range(1, per_group):
            for zero in (0, 1, 3):
                stage = Stage(layers=(0, len(sim.model.layers)), devices=tuple(range(8)), dp=8, zero=zero,
                              batch_samples=(v100,) * 4 + (per_group - v100,) * 4)
                plan = Plan(micro_batches=micro_batches, stages=(stage,))
                report = sim.simulate(plan)
                verdicts.add(report.fits)
                assert sim.fits(plan) == report.fits, plan
                assert sim.memory_bytes(plan) == dict(zip(report.devices, report.memory_per_device_bytes, strict=True))
    assert verdicts == {True, False}


def test_the_memory_count_agrees_where_a_stage_mixes_attention_kernels() -> None:
    """A stage over A100s (fused attention) and V100s (none: each keeps its scores) with equal samples per
    replica: the groups hold different memory, so no one figure stands for the stage; `fits` and `stage_fits`
    still say what the simulation says, and a stage of one kind of GPU what its own plan says."""
    sim = simulator("gpt3-1.3b", "dgx-a100-80gb:nodes=1+p3.16xlarge:nodes=1", 64, 2048)
    assert {d.spec.fused_attention for d in sim.cluster.devices} == {True, False}
    layers = len(sim.model.layers)
    verdicts = set()
    for micro_batches in (1, 2, 4):  # 64, 32, 16 samples a micro-batch: whole samples for 16 replicas
        for zero, recompute in ((0, False), (1, False), (1, True)):
            mixed = Plan(micro_batches=micro_batches, stages=(
                Stage(layers=(0, layers), devices=tuple(range(16)), dp=16, zero=zero, recompute=recompute),))
            two = Plan(micro_batches=micro_batches, stages=(
                Stage(layers=(0, layers // 2), devices=tuple(range(8)), dp=8, zero=zero, recompute=recompute),
                Stage(layers=(layers // 2, layers), devices=tuple(range(8, 16)), dp=8, zero=zero,
                      recompute=recompute)))
            for plan in (mixed, two):
                report = sim.simulate(plan)
                verdicts.add(report.fits)
                assert sim.fits(plan) == report.fits, plan
                for i, stage in enumerate(plan.stages):  # a stage's report shows its most loaded device
                    assert sim.stage_fits(plan, i, stage) == report.stages[i].memory.fits, (plan, i)
    assert verdicts == {True, False}


def results(case: tuple[str, str, int, int], *, check: bool, complete: bool,
            monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Baseline], int]:
    """The baselines (and the plans simulated) with the memory count first, or every plan simulated."""
    sim = simulator(*case)
    judge = SimulatorEvaluator(PlanSpace(sim))
    with monkeypatch.context() as patch:
        if not check:  # every plan simulated; trimming recomputation still counts memory (it is no skip)
            patch.setattr(baselines, "fewest_recomputed", functools.partial(fewest_recomputed, fits=sim.fits))
            patch.setattr(sim, "fits", lambda plan: True)
        found = run_baselines(sim, judge.candidate, complete=complete)
    return found, len(judge.candidates)


def _time(candidate: Candidate | None) -> float | None:
    return candidate.report.iteration_time_s if candidate is not None else None


@pytest.mark.parametrize("complete", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_skipping_what_cannot_fit_picks_the_same_plans_with_fewer_simulations(
        case: tuple[str, str, int, int], complete: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    checked, fewer = results(case, check=True, complete=complete, monkeypatch=monkeypatch)
    plain, more = results(case, check=False, complete=complete, monkeypatch=monkeypatch)
    assert fewer < more
    assert checked.keys() == plain.keys()
    for name, baseline in checked.items():
        assert baseline.config == plain[name].config and baseline.reason == plain[name].reason
        assert _time(baseline.candidate) == _time(plain[name].candidate)
        if baseline.candidate is not None:
            assert baseline.candidate.plan == plain[name].candidate.plan  # type: ignore[union-attr]


def test_the_fastest_type_is_the_highest_peak() -> None:
    sim = simulator(*CASES[2])
    assert fastest_type_nodes(sim) == (0,)  # the A100 node, not the V100 one


def test_interleaved_grid_points_are_megatron_layouts() -> None:
    """Virtual stages round-robin over the pp device groups, blocks split evenly into pp x vp chunks
    (embedding first, head last), micro-batch counts divisible by pp, vp dividing the blocks per stage."""
    sim = simulator(*CASES[2])  # gpt3-6.7b: 32 blocks
    devices = tuple(range(sim.cluster.num_devices))
    seen = set()
    for by_chunks in _configurations(sim, devices, 2, 4, "order"):
        for chunks, series in by_chunks:
            for point, plan in series:
                assert point.chunks == chunks
                seen.add(point.chunks)
                assert len(plan.stages) == 4 * point.chunks
                if point.chunks == 1:
                    continue
                assert plan.micro_batches % 4 == 0
                assert [s.devices for s in plan.stages] == [plan.stages[k % 4].devices for k in range(len(plan.stages))]
                sizes = [s.layers[1] - s.layers[0] for s in plan.stages]
                assert sizes[1:-1] == [32 // (4 * point.chunks)] * (len(sizes) - 2)  # embedding, head on the ends
                assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == len(sim.model.layers)
    assert seen == {1, 2, 4, 8}  # the divisors of 32 / 4


def test_the_grid_takes_an_interleaved_configuration_where_it_is_fastest() -> None:
    """On 6.7B over an A100 and a V100 node the fastest uniform configuration is interleaved: the grid
    must return it, faster than every 1F1B configuration of the grid."""
    sim = simulator(*CASES[2])
    judge = SimulatorEvaluator(PlanSpace(sim))
    grid = baselines.megatron_grid(sim, judge.candidate, tuple(range(len(sim.cluster.nodes))))
    assert grid.candidate is not None and "vp=" in grid.config
    assert grid.candidate.plan.schedule.value != "1f1b"
    plan = grid.candidate.plan  # nodes reversed: launched with the host order that ranks its devices in stage order
    rank = {d: r for r, d in enumerate(dict.fromkeys(d for stage in plan.stages for d in stage.devices))}
    stages = tuple(st.model_copy(update={"devices": tuple(rank[d] for d in st.devices)}) for st in plan.stages)
    launched = plan.model_copy(update={"stages": stages})
    args = megatron_arguments(sim.model, launched, global_batch=32, seq_len=1024)  # Megatron runs the layout
    vp = int(grid.config.split("vp=")[1].split()[0])
    pp = len({st.devices for st in plan.stages})  # pipeline ranks; each runs vp chunks
    assert len(plan.stages) == pp * vp
    assert args[args.index("--num-layers-per-virtual-pipeline-stage") + 1] == str(32 // (pp * vp))
    one_f_one_b = [p for p in grid_plans(sim) if len(p.stages) == len({s.devices for s in p.stages})]
    fastest = min(t for p in one_f_one_b if (r := sim.simulate(p)).fits for t in [r.iteration_time_s])
    assert grid.candidate.report.iteration_time_s < fastest


@pytest.mark.parametrize("case", CASES)
def test_the_quick_walk_finds_the_complete_walks_grid_optimum(case: tuple[str, str, int, int]) -> None:
    """The planner's seeds stop walking micro-batch sizes and virtual-stage counts past a series'
    fastest; on these cases that loses nothing against walking every one."""
    sim = simulator(*case)
    judge = SimulatorEvaluator(PlanSpace(sim))
    nodes = tuple(range(len(sim.cluster.nodes)))
    quick = baselines.megatron_grid(sim, judge.candidate, nodes)
    complete = baselines.megatron_grid(sim, judge.candidate, nodes, complete=True)
    assert quick.candidate is not None and complete.candidate is not None
    assert quick.candidate.report.iteration_time_s == complete.candidate.report.iteration_time_s


def test_a_device_in_two_unequal_replica_groups_holds_both_stages() -> None:
    """Two chunks on the same four GPUs, one as two tp-2 replicas and one as a tp-4 group: the replica
    groups overlap without being equal, and every device holds both stages' model state."""
    sim = simulator("gpt3-1.3b", "dgx-a100-80gb", 16, 1024)
    layers = len(sim.model.layers)
    first = Stage(layers=(0, layers // 2), devices=(0, 1, 2, 3), dp=2, tp=2, zero=1)
    second = Stage(layers=(layers // 2, layers), devices=(0, 1, 2, 3), dp=1, tp=4)
    plan = Plan(micro_batches=4, schedule=Schedule.INTERLEAVED_1F1B, stages=(first, second))
    report = sim.simulate(plan)
    weights = sum(model_state_bytes(sim.coster.local_params(s), sim.workload, zero=s.zero, dp=s.dp)[0]
                  for s in plan.stages)
    assert report.worst_device_memory.weights_bytes == pytest.approx(weights)
    held = sim.memory_bytes(plan)
    assert sorted(held) == [0, 1, 2, 3] and len(set(held.values())) == 1
    assert held == dict(zip(report.devices, report.memory_per_device_bytes, strict=True))


def test_a_group_of_unequal_memories_fits_only_within_its_smallest() -> None:
    """Tensor-parallel pairs of an 80 GB and a 40 GB A100 holding 41-79 GB each do not fit: each
    device is held to its own memory (a count that read the pair's largest memory would pass them)."""
    sim = simulator("gpt3-2.7b", "dgx-a100-80gb+dgx-a100-40gb", 64, 2048)
    pairs = tuple(d for i in range(8) for d in (i, 8 + i))  # one 80 GB and one 40 GB device per group
    checked = []
    for micro_batches in (8, 4, 2, 1):  # 8 to 64 samples a micro-batch: 1 to 8 per pair
        plan = Plan(micro_batches=micro_batches, stages=(Stage(layers=(0, len(sim.model.layers)), devices=pairs,
                                                               dp=8, tp=2),))
        held = sim.memory_bytes(plan)
        own = all(b <= sim.cluster.devices[d].spec.mem_bytes for d, b in held.items())
        assert sim.fits(plan) == own == sim.simulate(plan).fits
        checked.append((own, 40e9 < max(held.values()) <= 80e9))
    assert (True, False) in checked and (False, True) in checked  # fits, and too big only for the 40 GB ones


def test_data_parallelism_runs_on_as_many_of_the_fastest_devices_as_the_batch_splits_over() -> None:
    """A global batch that does not split into equal whole shares over every device (6 samples, 12 GPUs) runs as
    a practitioner runs it: on as many devices as it does split over (6), the fastest ones (the A100s), the rest
    idle; every replica a whole number of samples."""
    sim = Simulator(load_model("gpt?layers=2&hidden=256&heads=4&vocab=1024", seq_len=128),
                    load_cluster("p3.8xlarge+dgx-a100-80gb"), Workload(global_batch=6, seq_len=128))
    found = baselines.data_parallel_best(sim, SimulatorEvaluator(PlanSpace(sim)).candidate, range(2))
    assert found.candidate is not None, found.config
    (stage,) = found.candidate.plan.stages
    assert stage.dp == 6 and all(sim.cluster.devices[d].spec.name.startswith("A100") for d in stage.devices)
    assert "on the 6 fastest of the 12 devices" in found.config
    one = Simulator(sim.model, load_cluster("dgx-a100-80gb"), Workload(global_batch=1, seq_len=128))
    single = baselines.data_parallel_best(one, SimulatorEvaluator(PlanSpace(one)).candidate, range(1))
    assert single.candidate is not None and single.candidate.plan.stages[0].devices == (0,)
