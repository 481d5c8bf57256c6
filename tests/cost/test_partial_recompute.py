"""Partial recomputation (`Stage.recompute_layers`): a stage recomputes its first N transformer blocks and
keeps every activation of the others. Its time and memory lie between no recompute and full recompute, each
recomputed block moving the stage by the same step; `search.recompute.fewest_recomputed` picks the least N
that fits; plans name an N the stage can hold."""

from __future__ import annotations

import pytest

from tagplan.cost.simulator import Simulator
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.plan import Plan, Stage
from tagplan.search.recompute import fewest_recomputed, with_recomputed

MODEL = "gpt?layers=24&hidden=4096&heads=32&vocab=50304"  # embedding, 24 blocks, head


def _sim(batch: int = 64) -> Simulator:
    return Simulator(load_model(MODEL, seq_len=2048), load_cluster("dgx-a100-40gb"),
                     Workload(global_batch=batch, seq_len=2048))


def _plan(recompute: bool, count: int | None = None, micro_batches: int = 16) -> Plan:
    """Two stages of tp 4: layers [0, 13) (embedding and 12 blocks) and [13, 26) (12 blocks and the head)."""
    return Plan(micro_batches=micro_batches, stages=tuple(
        Stage(layers=layers, devices=devices, tp=4, recompute=recompute, recompute_layers=count)
        for layers, devices in (((0, 13), (0, 1, 2, 3)), ((13, 26), (4, 5, 6, 7)))))


def _first_stage(sim: Simulator, plan: Plan) -> tuple[float, float]:
    report = sim.simulate(plan)
    return report.stages[0].backward_s, sim.memory_bytes(plan)[0]


def test_each_recomputed_block_costs_one_forward_replay_and_saves_the_same_bytes() -> None:
    sim = _sim()
    off = _first_stage(sim, _plan(False))
    full = _first_stage(sim, _plan(True))
    steps = [_first_stage(sim, _plan(True, n)) for n in (1, 2, 3, 6, 11)]
    backward = [b for b, _ in steps]
    memory = [m for _, m in steps]
    assert off[0] < backward[0] and backward == sorted(backward) and backward[-1] < full[0]
    # the stage's 12 blocks are alike: each one recomputed adds the same replay time, and keeps only its input
    per_block_s = (full[0] - off[0]) / 12
    for n, b in zip((1, 2, 3, 6, 11), backward, strict=True):
        assert b - off[0] == pytest.approx(n * per_block_s, rel=1e-9)
    assert memory == sorted(memory, reverse=True) and full[1] < memory[-1]
    per_block_bytes = memory[1] - memory[2]
    assert per_block_bytes > 0 and memory[0] - memory[3] == pytest.approx(5 * per_block_bytes, rel=1e-9)
    # a recomputed block keeps its input for every micro-batch in flight, and all it saves only while it replays
    assert memory[0] < off[1]


def test_the_full_count_is_full_recompute_and_bad_counts_are_refused() -> None:
    sim = _sim()
    assert sim.simulate(_plan(True, 12)).iteration_time_s == sim.simulate(_plan(True)).iteration_time_s
    assert sim.memory_bytes(_plan(True, 12)) == sim.memory_bytes(_plan(True))
    with pytest.raises(SpecError, match=r"stages\[0\]\.recompute_layers = 13 but the stage holds 12 checkpointable "
                                        r"layers \(layers \[0, 13\), embeddings and heads excluded\); accepted: 1..12"):
        sim.simulate(_plan(True, 13))
    with pytest.raises(ValueError, match="recompute_layers=2 needs recompute=true"):
        Stage(layers=(0, 4), devices=(0,), recompute_layers=2)


def test_the_fewest_recomputed_layers_that_fit_are_found() -> None:
    sim = _sim(batch=512)  # 32 samples a micro-batch: without recompute the stages do not fit in 40 GB
    full = _plan(True, micro_batches=16)
    assert not sim.fits(_plan(False)) and sim.fits(full)
    trimmed = fewest_recomputed(sim, full)
    counts = {s.recompute_layers for s in trimmed.stages}
    assert len(counts) == 1 and None not in counts  # one count, as Megatron's flag
    n = counts.pop()
    assert n is not None and 1 < n < 12
    assert sim.fits(trimmed) and not sim.fits(with_recomputed(sim, full, n - 1))
    assert sim.simulate(trimmed).iteration_time_s < sim.simulate(full).iteration_time_s
    assert fewest_recomputed(sim, _plan(False)) == _plan(False)  # nothing recomputes: nothing to trim
    tight = _sim(batch=8192)
    too_big = _plan(True, micro_batches=16)
    assert not tight.fits(too_big) and fewest_recomputed(tight, too_big) == too_big  # not even full fits


def test_a_runtime_without_partial_recompute_gets_the_full_one() -> None:
    """A plan that recomputes some layers, under a runtime that refuses that (DeepSpeed's; here an `admissible`
    that refuses it), is replaced by the same plan with full recomputation, not dropped; a plan refused for
    another reason is dropped."""
    from tagplan.search.planner import SimulatorEvaluator, _admitted
    from tagplan.search.space import PlanSpace

    sim = _sim(batch=512)
    judge = SimulatorEvaluator(PlanSpace(sim))
    partial = judge.candidate(fewest_recomputed(sim, _plan(True, micro_batches=16)))
    assert any(s.recompute_layers is not None for s in partial.plan.stages)

    def no_partial(p: Plan) -> str | None:
        return "partial" if any(s.recompute_layers is not None for s in p.stages) else None

    assert _admitted(partial, lambda p: None, judge) is partial
    full = _admitted(partial, no_partial, judge)
    assert full is not None and full.plan == _plan(True, micro_batches=16) and full.report.fits
    assert full.report.iteration_time_s > partial.report.iteration_time_s
    assert _admitted(partial, lambda p: "never", judge) is None


def test_each_stage_recomputes_what_its_own_memory_needs() -> None:
    """Under 1F1B the first of four stages holds four micro-batches in flight and the last one: per stage, the
    later stages recompute fewer layers (or none) than one count for all makes them, and the plan is faster; a
    runtime that takes one count only (Megatron-LM) is offered the common count."""
    from tagplan.search.planner import SimulatorEvaluator, _admitted
    from tagplan.search.space import PlanSpace

    sim = _sim(batch=512)
    bounds = (0, 7, 13, 19, 26)
    full = Plan(micro_batches=32, stages=tuple(
        Stage(layers=(bounds[i], bounds[i + 1]), devices=(2 * i, 2 * i + 1), tp=2, recompute=True) for i in range(4)))

    def recomputed(p: Plan) -> list[int]:
        return [len(s.recomputed(sim.model)) for s in p.stages]

    uniform = fewest_recomputed(sim, full)
    own = fewest_recomputed(sim, full, per_stage=True)
    assert sim.fits(uniform) and sim.fits(own)
    common = recomputed(uniform)
    assert len(set(common)) == 1 and 0 < common[0] < 6  # one count, below full recompute
    mine = recomputed(own)
    assert mine == sorted(mine, reverse=True) and mine[-1] < mine[0] <= common[0] and sum(mine) < sum(common)
    for i, n in enumerate(mine):  # each stage's count is the least that fits, the others held
        if n > 0:
            fewer = own.stages[i].model_copy(update={"recompute_layers": n - 1} if n > 1 else
                                             {"recompute": False, "recompute_layers": None})
            assert not sim.fits(own.model_copy(update={"stages": (*own.stages[:i], fewer, *own.stages[i + 1:])}))
    assert sim.simulate(own).iteration_time_s < sim.simulate(uniform).iteration_time_s

    def one_count(p: Plan) -> str | None:
        differ = len({s.recompute_layers for s in p.stages}) > 1 or len({s.recompute for s in p.stages}) > 1
        return "one count for every stage" if differ else None

    judge = SimulatorEvaluator(PlanSpace(sim))
    offered = _admitted(judge.candidate(own), one_count, judge)
    assert offered is not None and offered.plan == uniform


@pytest.mark.parametrize("batch", [256, 512, 1024])
def test_a_stage_fits_alone_as_the_whole_plan_says(batch: int) -> None:
    """`Simulator.stage_fits` (a stage's own devices) agrees with `fits` on the plan holding that stage, and the
    per-stage trim that asks it finds what the whole-plan check finds."""
    sim = _sim(batch=batch)
    bounds = (0, 7, 13, 19, 26)
    full = Plan(micro_batches=32, stages=tuple(
        Stage(layers=(bounds[i], bounds[i + 1]), devices=(2 * i, 2 * i + 1), tp=2, recompute=True) for i in range(4)))
    for i, stage in enumerate(full.stages):
        for update in ({"recompute": False}, {"recompute_layers": 1}, {"recompute_layers": 3}, {}):
            variant = stage.model_copy(update=update)
            others_fit = sim.fits(full)
            whole = full.model_copy(update={"stages": (*full.stages[:i], variant, *full.stages[i + 1:])})
            assert not others_fit or sim.stage_fits(full, i, variant) == sim.fits(whole)
    assert fewest_recomputed(sim, full, per_stage=True) == fewest_recomputed(
        sim, full, lambda p: sim.fits(p), per_stage=True)


def test_a_baseline_plan_seeds_its_per_stage_recompute() -> None:
    """The planner judges each baseline's plan (one recompute count for all stages, as Megatron runs it) with
    every stage recomputing only what it needs: a faster candidate of its own that fits."""
    from tagplan.search.planner import SimulatorEvaluator, _per_stage_seed
    from tagplan.search.space import PlanSpace

    sim = _sim(batch=512)
    bounds = (0, 7, 13, 19, 26)
    full = Plan(micro_batches=32, stages=tuple(
        Stage(layers=(bounds[i], bounds[i + 1]), devices=(2 * i, 2 * i + 1), tp=2, recompute=True) for i in range(4)))
    uniform = fewest_recomputed(sim, full)
    judge = SimulatorEvaluator(PlanSpace(sim))
    _per_stage_seed(uniform, judge)
    (seed,) = judge.candidates.values()
    assert seed.source == "baseline+recompute" and seed.plan == fewest_recomputed(sim, full, per_stage=True)
    assert seed.report.fits and seed.report.iteration_time_s < sim.simulate(uniform).iteration_time_s
    _per_stage_seed(_plan(False), judge)  # nothing recomputes: nothing to seed
    assert len(judge.candidates) == 1


def test_a_runtime_that_recomputes_whole_stages_gets_them_where_the_plan_recomputed() -> None:
    """Per-stage counts [4, 2, off, off], a runtime taking only whole-stage recompute (DeepSpeed's per-stage
    checkpoint intervals): offered full recompute on the first two stages, the others still off."""
    from tagplan.search.planner import SimulatorEvaluator, _admitted
    from tagplan.search.space import PlanSpace

    sim = _sim(batch=512)
    bounds = (0, 7, 13, 19, 26)
    full = Plan(micro_batches=32, stages=tuple(
        Stage(layers=(bounds[i], bounds[i + 1]), devices=(2 * i, 2 * i + 1), tp=2, recompute=True) for i in range(4)))
    own = fewest_recomputed(sim, full, per_stage=True)
    assert [s.recompute for s in own.stages] == [True, True, False, False]

    def whole_stages(p: Plan) -> str | None:
        return "partial" if any(s.recompute_layers is not None for s in p.stages) else None

    judge = SimulatorEvaluator(PlanSpace(sim))
    offered = _admitted(judge.candidate(own), whole_stages, judge)
    assert offered is not None and [s.recompute for s in offered.plan.stages] == [True, True, False, False]
    assert offered.report.fits and offered.report.iteration_time_s < sim.simulate(full).iteration_time_s
