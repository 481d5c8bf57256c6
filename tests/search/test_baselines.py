"""The practitioner baselines: skipping configurations too big to fit changes nothing but the work."""

from __future__ import annotations

import pytest

from tagplan.cost.simulator import Simulator
from tagplan.export.megatron import megatron_arguments
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.plan import Plan
from tagplan.search import baselines
from tagplan.search.baselines import _configurations, certainly_too_big, fastest_type_nodes, run_baselines
from tagplan.search.planner import SimulatorEvaluator
from tagplan.search.result import Baseline, Candidate
from tagplan.search.space import PlanSpace, divisors

# (model, cluster, global batch, sequence): each has configurations whose model state alone overflows
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
def test_a_configuration_certainly_too_big_never_fits(case: tuple[str, str, int, int]) -> None:
    sim = simulator(*case)
    plans = grid_plans(sim)
    flagged = [p for p in plans if certainly_too_big(sim, p)]
    assert flagged and len(flagged) < len(plans)  # the check has work to do, and lets plans through
    for plan in flagged[:: max(len(flagged) // 60, 1)]:
        assert not sim.simulate(plan).fits


def results(case: tuple[str, str, int, int], *, check: bool, complete: bool,
            monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Baseline], int]:
    """The baselines (and the plans simulated) with the model-state check on or off."""
    sim = simulator(*case)
    judge = SimulatorEvaluator(PlanSpace(sim))
    with monkeypatch.context() as patch:
        if not check:
            patch.setattr(baselines, "certainly_too_big", lambda sim, plan: False)
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
    assert args[args.index("--num-layers-per-virtual-pipeline-stage") + 1] == str(32 // (4 * vp))
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
