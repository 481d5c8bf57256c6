import json

import pytest

from tagplan.cli import main
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan
from tagplan.search.pareto import dominates
from tagplan.search.planner import PriorFactory, plan
from tagplan.search.problem import Objective, PlanProblem
from tagplan.search.result import PlanResult


def _plan(model: ModelGraph, cluster: Cluster, workload: Workload, *, prior_factory: PriorFactory | None = None,
          **problem: object) -> PlanResult:
    return plan(PlanProblem(model, cluster, workload, **problem), prior_factory=prior_factory)  # type: ignore[arg-type]


SMALL = [
    ("gpt?layers=4&hidden=256&heads=4&vocab=500", "p3.8xlarge+g4dn.12xlarge", 16),
    ("llama?layers=4&hidden=256&heads=4&vocab=500", "dgx-a100-80gb+g4dn.12xlarge", 16),
    ("gpt?layers=6&hidden=512&heads=8&vocab=500", "p3.8xlarge:nodes=2", 8),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "cluster", "batch"), SMALL)
def test_planner_matches_the_exhaustive_optimum_on_small_heterogeneous_cases(model: str, cluster: str,
                                                                              batch: int) -> None:
    result = _plan(load_model(model, seq_len=256), load_cluster(cluster), Workload(global_batch=batch, seq_len=256),
                  max_evaluations=400, budget_s=60, exhaustive_limit=20000)
    exhaustive = result.baselines["exhaustive"].candidate
    assert exhaustive is not None
    assert result.best.report.iteration_time_s <= exhaustive.report.iteration_time_s * 1.02


def test_tp_stays_inside_nvlink_nodes_and_not_across_a_slow_network() -> None:
    result = _plan(load_model("gpt?layers=8&hidden=2048&heads=16&vocab=1000", seq_len=1024),
                  load_cluster("p3.8xlarge:nodes=2"), Workload(global_batch=16, seq_len=1024), max_evaluations=150)
    cluster = load_cluster("p3.8xlarge:nodes=2")
    for stage in result.best.plan.stages:
        for r in range(stage.dp):
            nodes = {cluster.devices[d].node for d in stage.replica(r)}
            assert len(nodes) == 1


def test_faster_gpus_get_more_layers_or_batch() -> None:
    result = _plan(load_model("gpt?layers=12&hidden=1024&heads=16&vocab=1000", seq_len=512),
                  load_cluster("dgx-a100-80gb+g4dn.12xlarge"), Workload(global_batch=32, seq_len=512),
                  max_evaluations=200)
    cluster = load_cluster("dgx-a100-80gb+g4dn.12xlarge")
    best = result.best.plan
    per_device: dict[str, list[float]] = {}
    for stage in best.stages:
        shares = stage.shares()
        for r in range(stage.dp):
            work = stage.num_layers * shares[r] / stage.tp
            for d in stage.replica(r):
                per_device.setdefault(cluster.devices[d].spec.name, []).append(work)
    if "T4" in per_device:  # the plan may also leave the slow node to a small share
        assert max(per_device["T4"]) <= max(per_device["A100-SXM-80GB"])
    assert result.best.report.iteration_time_s <= min(
        b.candidate.report.iteration_time_s for b in result.baselines.values() if b.candidate)


def test_frontier_is_non_dominated_and_same_seed_same_plan() -> None:
    args = (load_model("gpt?layers=6&hidden=512&heads=8&vocab=500", seq_len=256), load_cluster("p3.8xlarge:nodes=2"),
            Workload(global_batch=16, seq_len=256))
    a = _plan(*args, max_evaluations=80, seed=3)
    b = _plan(*args, max_evaluations=80, seed=3)
    assert a.best.plan == b.best.plan
    for x in a.pareto:
        assert not any(dominates(y.objectives, x.objectives) for y in a.pareto)
    memory = _plan(*args, max_evaluations=80, seed=3, objective=Objective.MEMORY)
    assert memory.best.report.peak_memory_bytes <= a.best.report.peak_memory_bytes
    # the slack is over the fastest plan of the memory run's own pool (on its frontier), which its
    # memory-driven search need not share with the time run's
    fastest_s = min(x.report.iteration_time_s for x in memory.pareto)
    assert memory.best.report.iteration_time_s <= 1.25 * fastest_s + 1e-12
    within = [x for x in memory.pareto if x.report.iteration_time_s <= 1.25 * fastest_s]
    assert memory.best.report.peak_memory_bytes == min(x.report.peak_memory_bytes for x in within)


def test_cli_plan_beats_both_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "gpt3-1.3b", "--cluster", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", "--batch", "32",
            "--seq", "1024", "--json", "--max-evaluations", "150"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"best", "pareto", "baselines", "search"}
    best = out["best"]["report"]["iteration_time_s"]
    for name in ("data_parallel", "megatron_grid", "fastest_nodes"):
        baseline = out["baselines"][name]
        assert (baseline is None and out["baseline_reasons"][name]) or best <= baseline["report"]["iteration_time_s"]
        assert baseline is None or out["baseline_configs"][name]  # each says how it was configured
    assert out["baselines"]["exhaustive"] is None and "exhaustive" in out["baseline_reasons"]
    assert out["search"]["evaluations"] <= 150 and out["search"]["wall_s"] > 0


def test_fewer_nodes_are_offered_to_every_objective() -> None:
    """A tiny model over 10 Gb/s: one node is faster than four (the time objective leaves nodes out too) and uses
    fewer GPUs; a time bound no plan meets returns the fastest plan and says so."""
    model = load_model("gpt?layers=4&hidden=256&heads=4&vocab=500", seq_len=128)
    cluster = load_cluster("p3.8xlarge:nodes=4")
    workload = Workload(global_batch=16, seq_len=128)
    fastest = _plan(model, cluster, workload, max_evaluations=150)
    assert fastest.best.report.devices_used < 16
    every = _plan(model, cluster, workload, max_evaluations=150, objective=Objective.GPUS)
    assert every.best.report.devices_used <= fastest.best.report.devices_used
    assert every.best.report.iteration_time_s <= 1.25 * fastest.best.report.iteration_time_s + 1e-12
    assert not any("time bound" in note for note in every.notes)
    impossible = _plan(model, cluster, workload, max_evaluations=150, objective=Objective.GPUS, time_bound_s=1e-6)
    fastest_s = min(c.report.iteration_time_s for c in (impossible.best, *impossible.pareto))
    assert impossible.best.report.iteration_time_s == fastest_s  # the fastest it found, and said so
    assert any("no plan runs within the time bound of 1e-06 s" in note for note in impossible.notes)


def test_a_subset_of_nodes_without_the_memory_for_the_training_state_is_not_offered() -> None:
    """A half (quarter, eighth) of a node set is offered only where its memory holds the training state."""
    from tagplan.cost.simulator import Simulator
    from tagplan.search.space import PlanSpace

    cluster = load_cluster("rtx4090x4:nodes=2+g4dn.12xlarge")  # 13B's 208 GB of state: only all three nodes
    sim = Simulator(load_model("gpt3-13b", seq_len=2048), cluster, Workload(global_batch=32, seq_len=2048))
    assert PlanSpace(sim).node_subsets == [(0, 1, 2), (0, 1)]  # every node, the fastest type's; no half of them
    small = Simulator(load_model("gpt?layers=4&hidden=256&heads=4&vocab=500", seq_len=128), cluster,
                      Workload(global_batch=16, seq_len=128))
    assert PlanSpace(small).node_subsets == [(0, 1, 2), (0, 1), (0,)]  # and half of the fastest type's nodes


@pytest.mark.slow
def test_gnn_guided_search_still_matches_the_exhaustive_optimum() -> None:
    import torch

    from tagplan.gnn.model import load_checkpoint
    from tagplan.gnn.scorer import GNNPrior, GNNScorer
    from tagplan.training.registry import PACKAGED_CHECKPOINT

    torch.set_num_threads(1)
    model, _ = load_checkpoint(PACKAGED_CHECKPOINT)
    scorer = GNNScorer(model)
    args = (load_model("gpt?layers=4&hidden=256&heads=4&vocab=500", seq_len=256),
            load_cluster("p3.8xlarge+g4dn.12xlarge"), Workload(global_batch=16, seq_len=256))
    guided = _plan(*args, max_evaluations=400, budget_s=120, exhaustive_limit=20000,
                  prior_factory=lambda space: GNNPrior(space, scorer))
    exhaustive = guided.baselines["exhaustive"].candidate
    assert exhaustive is not None
    assert guided.best.report.iteration_time_s <= exhaustive.report.iteration_time_s * 1.02


def test_result_carries_the_best_plans_simulation_and_timeline() -> None:
    result = _plan(load_model("gpt?layers=4&hidden=256&heads=4&vocab=500", seq_len=128), load_cluster("p3.8xlarge"),
                   Workload(global_batch=8, seq_len=128), max_evaluations=30)
    assert result.simulation.report == result.best.report  # the same plan, simulated with its task times
    events = result.timeline()["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)


def test_never_worse_than_a_baseline_and_exhaustive_stays_apart() -> None:
    problem = (load_model("gpt?layers=4&hidden=512&heads=8&vocab=500", seq_len=256),
               load_cluster("p3.8xlarge+g4dn.12xlarge"), Workload(global_batch=16, seq_len=256))
    result = _plan(*problem, max_evaluations=20, exhaustive_limit=20000)
    for name, baseline in result.baselines.items():
        if baseline.candidate is not None and name != "exhaustive":
            assert result.best.report.iteration_time_s <= baseline.candidate.report.iteration_time_s
    exhaustive = result.baselines["exhaustive"]
    assert exhaustive.candidate is not None and "plans of the decision process" in exhaustive.config
    # the enumeration is a yardstick: none of its plans joins the search's answers (merged, they would
    # be labelled "search"), so the answers are those of the same search without it
    assert all(c.source != "exhaustive" for c in (result.best, *result.pareto))
    alone = _plan(*problem, max_evaluations=20, exhaustive_limit=0)
    assert result.best.plan == alone.best.plan
    assert [c.plan for c in result.pareto] == [c.plan for c in alone.pareto]


def test_time_objective_may_leave_slow_nodes_idle() -> None:
    # a tiny model over 10 Gb/s: the V100 node alone beats dragging four T4s along
    result = _plan(load_model("gpt?layers=4&hidden=256&heads=4&vocab=500", seq_len=128),
                   load_cluster("p3.8xlarge+g4dn.12xlarge"), Workload(global_batch=8, seq_len=128),
                   max_evaluations=150)
    assert result.idle_devices == [4, 5, 6, 7]
    assert result.to_json()["idle_devices"] == [4, 5, 6, 7]


def test_a_learned_correction_reranks_the_final_candidates() -> None:
    from tagplan.search.planner import Correction

    args = (load_model("gpt?layers=6&hidden=512&heads=8&vocab=500", seq_len=256), load_cluster("p3.8xlarge:nodes=2"),
            Workload(global_batch=16, seq_len=256))
    plain = _plan(*args, max_evaluations=80)
    assert plain.predictor.correction_applied is False and plain.best.corrected_time_s is None
    def family_of(p: Plan) -> tuple[object, ...]:  # its stages' (dp, tp) and its micro-batches
        return *((s.dp, s.tp) for s in p.stages), p.micro_batches

    family = family_of(plain.best.plan)

    def penalise(plans):  # measurements say the simulator's favourite family runs 10x slower
        return [p_time * (10.0 if family_of(p) == family else 1.0)
                for p, p_time in zip(plans, [1.0] * len(plans), strict=True)]

    corrected = plan(PlanProblem(*args, max_evaluations=80), correction=Correction("v0007", penalise))
    assert corrected.predictor.correction_applied and corrected.predictor.gnn == "v0007"
    assert family_of(corrected.best.plan) != family
    assert corrected.best.corrected_time_s == 1.0
    assert corrected.to_json()["best"]["predicted_time_s"]["corrected"] == 1.0
    from rich.console import Console

    from tagplan.cli.tables import plan_result_table

    def as_text(table: object) -> str:
        console = Console(width=300, record=True)
        console.print(table)
        return " ".join(console.export_text().split())

    assert "ranked by GNN v0007's learned correction: 1.000 s per iteration as corrected" in as_text(
        plan_result_table(corrected))
    assert "learned correction" not in as_text(plan_result_table(plain))


@pytest.mark.parametrize(("model", "cluster", "batch", "seq"), [
    ("gpt?layers=4&hidden=1024&heads=16&vocab=500", "dgx-h100+dgx-a100-80gb", 16, 1024),
    ("llama?layers=6&hidden=1024&heads=16&vocab=500", "rtx4090x4:nodes=2+g4dn.12xlarge", 32, 512),
])
def test_more_evaluations_never_give_a_slower_plan(model: str, cluster: str, batch: int, seq: int) -> None:
    # the H100 at its boost clock: an instance where each budget step buys a better plan
    at_boost_clock = load_cluster(cluster)
    if "H100-SXM" in at_boost_clock.device_types:  # the instances were chosen at the H100's boost clock
        at_boost_clock = at_boost_clock.with_device_figures("H100-SXM", sustained_peak_fraction=1.0)
    args = (load_model(model, seq_len=seq), at_boost_clock, Workload(global_batch=batch, seq_len=seq))
    times = []
    for evaluations in (50, 100, 200, 400):
        result = _plan(*args, max_evaluations=evaluations, budget_s=600)
        assert result.search.stopped_by in ("evaluations", "exhausted")
        assert result.search.local_evaluations > 0  # hill climbing shared the budget
        times.append(result.best.report.iteration_time_s)
    assert times == sorted(times, reverse=True)
    assert times[-1] < times[0]  # and the budget bought something


WORK_COUNTERS = ("wall_s", "cache_hits", "simulations", "intra_solves", "intra_cache_hits")
"""What may differ between one process and several: the search's cache finds the baselines' plans only in one,
and refinements judged ahead count as cache hits."""


def _answer(result: PlanResult) -> dict[str, object]:
    out = result.to_json()
    out["search"] = {k: v for k, v in out["search"].items() if k not in WORK_COUNTERS}
    return out


@pytest.mark.parametrize(("model", "cluster", "batch", "seq"), [
    ("gpt?layers=6&hidden=512&heads=8&vocab=500", "p3.8xlarge+g4dn.12xlarge", 16, 256),  # fastest-nodes baseline
    ("llama?layers=8&hidden=1024&heads=16&vocab=500", "dgx-a100-80gb:nodes=2+p3.16xlarge:nodes=2", 64, 512),
])
def test_the_baselines_in_other_processes_give_the_same_answer(model: str, cluster: str, batch: int, seq: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    from tagplan.search.background import Background

    args = (load_model(model, seq_len=seq), load_cluster(cluster), Workload(global_batch=batch, seq_len=seq))
    one = _answer(_plan(*args, max_evaluations=60))
    assert one["search"]["baseline_evaluations"] > 0
    for workers in (2, 3):
        assert _answer(_plan(*args, max_evaluations=60, workers=workers)) == one
        assert not multiprocessing.active_children()
    # the baselines' processes still busy when the search ends: it refines its incumbents ahead, all of them
    monkeypatch.setattr(Background, "ready", lambda self: False)
    assert _answer(_plan(*args, max_evaluations=60, workers=2)) == one


def test_without_a_baselines_process_the_answer_is_one_processs(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal

    from tagplan.search import background, planner

    args = (load_model("gpt?layers=6&hidden=512&heads=8&vocab=500", seq_len=256),
            load_cluster("p3.8xlarge+g4dn.12xlarge"), Workload(global_batch=16, seq_len=256))
    one = _answer(_plan(*args, max_evaluations=40))
    parent, run_families = os.getpid(), planner._run_families

    def killed_in_the_child(*a: object) -> object:
        if os.getpid() != parent:  # as the kernel's OOM killer would
            os.kill(os.getpid(), signal.SIGKILL)
        return run_families(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "_run_families", killed_in_the_child)
    assert _answer(_plan(*args, max_evaluations=40, workers=3)) == one  # run here afresh, time limit anew

    def no_fork(method: str) -> object:
        raise ValueError(f"cannot find context for {method!r}")

    monkeypatch.setattr(background.multiprocessing, "get_context", no_fork)
    assert _answer(_plan(*args, max_evaluations=40, workers=2)) == one  # one process from the start


def test_a_search_stopped_by_its_progress_callback_leaves_no_baseline_process() -> None:
    import multiprocessing

    class StoppedError(Exception):
        pass

    def stop(done: int, total: int) -> None:
        if done >= 3:
            raise StoppedError

    problem = PlanProblem(load_model("gpt?layers=6&hidden=512&heads=8&vocab=500", seq_len=256),
                          load_cluster("dgx-a100-80gb:nodes=2+p3.16xlarge:nodes=2"),
                          Workload(global_batch=64, seq_len=256), workers=2)
    with pytest.raises(StoppedError):
        plan(problem, progress=stop)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("workers", [0, 4, True])
def test_workers_other_than_one_or_two_are_refused(workers: object) -> None:
    with pytest.raises(SpecError, match=f"workers={workers!r}: must be 1"):
        PlanProblem(load_model("gpt?layers=4&hidden=256&heads=4&vocab=500", seq_len=128), load_cluster("p3.8xlarge"),
                    Workload(global_batch=8, seq_len=128), workers=workers)  # type: ignore[arg-type]


def test_memory_objective_without_a_fitting_plan_returns_the_nearest_to_fitting() -> None:
    """Where nothing fits, the memory objective answers with the infeasible plan nearest to fitting (its worst
    device least over its memory, on a mixed cluster not the least bytes), the time objective with the fastest."""
    args = (load_model("gpt3-175b", seq_len=2048), load_cluster("rtx4090x4+g4dn.12xlarge"),
            Workload(global_batch=8, seq_len=2048))
    fastest = _plan(*args, max_evaluations=40)
    nearest = _plan(*args, max_evaluations=40, objective=Objective.MEMORY)

    def over(result: PlanResult) -> float:
        worst = result.best.report.worst_device_memory
        return worst.memory_bytes / worst.mem_bytes

    assert not fastest.best.report.fits and not nearest.best.report.fits
    assert over(nearest) < over(fastest)
    assert fastest.best.report.iteration_time_s <= nearest.best.report.iteration_time_s
    assert any("nearest to fitting" in note for note in nearest.notes)


def test_where_no_plan_that_fits_is_admissible_the_answer_is_an_admissible_one_and_says_so() -> None:
    """`admissible` accepting only plans that do not fit: the best is one of those (not a fitting plan it
    refused), and the notes say that no admissible plan fits; refusing every plan: the best is the fastest
    plan of all, and the notes say it is not admissible."""
    from tagplan.cost.simulator import Simulator

    model, cluster = load_model("gpt3-1.3b", seq_len=1024), load_cluster("rtx4090x4")  # some plans fit, some not
    workload = Workload(global_batch=16, seq_len=1024)
    sim = Simulator(model, cluster, workload)
    problem = PlanProblem(model, cluster, workload, max_evaluations=60, budget_s=20, workers=1)
    free = plan(problem)
    assert free.best.report.fits
    only_oom = plan(problem, admissible=lambda p: "it fits" if sim.simulate(p).fits else None)
    assert not only_oom.best.report.fits and not sim.simulate(only_oom.best.plan).fits
    assert any("no plan that fits in memory is admissible (it fits)" in n for n in only_oom.notes)
    assert not only_oom.pareto  # the frontier holds admissible plans that fit: none
    assert any("no admissible plan fits in memory" in n for n in only_oom.notes)
    from tagplan.search.planner import Correction

    ones = Correction("v0001", lambda plans: [1.0] * len(plans))  # a learned correction re-ranks admissible plans
    nothing = plan(problem, admissible=lambda p: "never", correction=ones)  # none: nothing to re-rank (it raised)
    assert nothing.best.report.fits  # the best of all, for reference (`free` may refine its own further)
    assert not nothing.predictor.correction_applied
    assert nothing.best.report.iteration_time_s >= free.best.report.iteration_time_s
    assert any("no plan the search simulated is admissible (never)" in n for n in nothing.notes)
    assert not any("fits in memory" in n for n in nothing.notes)


def test_a_gpu_without_the_dtypes_tensor_cores_is_named_with_the_rate_it_is_costed_at() -> None:
    from tagplan.ir.workload import DType
    from tagplan.search.planner import dtype_notes

    mixed = load_cluster("p3.8xlarge+g4dn.12xlarge+dgx-a100-80gb")
    (bf16,) = dtype_notes(mixed, DType.BF16)
    assert bf16.startswith("T4, V100-SXM2-16GB: no bf16 tensor cores; costed at the fp16 rate")
    assert dtype_notes(mixed, DType.FP16) == [] and dtype_notes(mixed, DType.FP32) == []
    fp8 = dtype_notes(mixed, DType.FP8)
    assert any(n.startswith("A100-SXM-80GB: no fp8 tensor cores; costed at the bf16 rate") for n in fp8)
    assert any(n.startswith("T4, V100-SXM2-16GB: no fp8 tensor cores; costed at the fp16 rate") for n in fp8)
    assert dtype_notes(load_cluster("dgx-h100"), DType.FP8) == []
    assert dtype_notes(load_cluster("dgx-h100"), DType.MXFP8)[0].startswith(
        "H100-SXM: no mxfp8 tensor cores; costed at the fp8 rate")  # block-scaled cores are Blackwell's
    a100 = [d for d in range(mixed.num_devices) if mixed.devices[d].spec.name == "A100-SXM-80GB"]
    assert dtype_notes(mixed, DType.BF16, a100) == []  # a plan on the A100s alone: nothing to say
    assert dtype_notes(load_cluster("dgx-h100"), DType.NVFP4)[0].startswith("H100-SXM: no nvfp4 tensor cores; "
                                                                            "costed at the fp8 rate")
    old_gpus = load_cluster("p3.8xlarge+g4dn.12xlarge")  # whichever GPUs the plan takes lack bf16 tensor cores
    result = _plan(load_model("gpt?layers=2&hidden=128&heads=4&vocab=500", seq_len=64), old_gpus,
                   Workload(global_batch=8, seq_len=64), max_evaluations=20)
    assert result.notes == tuple(dtype_notes(old_gpus, DType.BF16, result.best.plan.devices))
    assert len(result.notes) == 1 and "no bf16 tensor cores; costed at the fp16 rate" in result.notes[0]


def test_a_result_whose_refinement_was_cut_by_the_deadline_says_so(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import tagplan.search.planner as planner
    from tagplan.ir import Workload
    from tagplan.search.problem import PlanProblem

    model = load_model("gpt3-2.7b", seq_len=1024)  # on 16 GB V100s: tensor-parallel incumbents
    problem = PlanProblem(model, load_cluster("p3.8xlarge"), Workload(global_batch=8, seq_len=1024),
                          max_evaluations=60)
    in_time = planner.plan(problem)
    assert in_time.search.intra_solves > 0  # tensor-parallel incumbents were refined
    assert not any("stopped at its deadline" in n for n in in_time.notes)
    monkeypatch.setattr(planner, "REFINE_OVERRUN_SHARE", -1.0)  # the deadline is the search's start: passed
    cut = planner.plan(problem)
    assert any("sharding refinement stopped at its deadline" in n for n in cut.notes)
    assert all(not c.source.endswith("+intra") for c in (cut.best, *cut.pareto))  # nothing was refined
