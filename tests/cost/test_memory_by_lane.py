"""The simulator's memory read lane by lane (every lane's stages on the same tensor-parallel groups, no device in
two lanes) against the same count group by group, stage by stage: equal to the byte on plans where the groups of a
stage hold the same memory, where they differ (uneven shares, GPUs with and without fused attention) and on
interleaved plans, whose devices hold several stages."""

import pytest

from tagplan.cost import simulator as simulator_module
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.plan import Plan, Schedule, Stage

MODEL = load_model("gpt?layers=8&hidden=1024&heads=16&vocab=1000", seq_len=1024)  # 10 layers: embedding, 8, head
CLUSTER = load_cluster("dgx-a100-80gb+p3.16xlarge")  # devices 0-7 A100 (fused attention), 8-15 V100


def _stage(layers: tuple[int, int], devices: range, **kw: object) -> Stage:
    return Stage(layers=layers, devices=tuple(devices), **kw)  # type: ignore[arg-type]


PLANS = {
    "1f1b, equal groups": Plan(micro_batches=4, schedule=Schedule.ONE_F_ONE_B, stages=(
        _stage((0, 5), range(0, 8), dp=4, tp=2, zero=1), _stage((5, 10), range(8, 16), dp=4, tp=2, recompute=True))),
    "uneven whole-sample shares": Plan(micro_batches=2, schedule=Schedule.ONE_F_ONE_B, stages=(
        _stage((0, 10), range(0, 16), dp=8, tp=2, batch_samples=(3, 3, 3, 3, 1, 1, 1, 1)),)),
    "a stage over both GPU types": Plan(micro_batches=4, schedule=Schedule.ONE_F_ONE_B, stages=(
        _stage((0, 4), range(0, 4), dp=2, tp=2), _stage((4, 9), range(4, 12), dp=4, tp=2),
        _stage((9, 10), range(12, 16), dp=2, tp=2))),
    "context parallel": Plan(micro_batches=2, schedule=Schedule.ONE_F_ONE_B, stages=(
        _stage((0, 10), range(0, 16), dp=4, cp=2, tp=2, zero=1),)),
    "interleaved": Plan(micro_batches=8, schedule=Schedule.INTERLEAVED_1F1B, stages=tuple(
        _stage(layers, range(0, 8) if k % 2 == 0 else range(8, 16), dp=2, tp=4, zero=1)
        for k, layers in enumerate([(0, 3), (3, 5), (5, 8), (8, 10)]))),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_memory_by_lane_equals_the_count_group_by_group(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = PLANS[name]
    workload = Workload(global_batch=32, seq_len=1024)

    def measured() -> tuple[object, ...]:
        sim = Simulator(MODEL, CLUSTER, workload)
        return sim.memory_bytes(plan), sim.fits(plan), sim.simulate(plan)  # the report: per device, per stage

    by_lane = measured()
    assert simulator_module._lane_aligned(plan, simulator_module._lanes(plan))  # the lane-wise reading applies
    monkeypatch.setattr(simulator_module, "_lane_aligned", lambda plan, lanes: False)
    assert measured() == by_lane


def test_groups_of_one_stage_without_fused_attention_hold_the_attention_scores() -> None:
    # the middle stage spans A100s (flash attention: no scores kept) and V100s (eager attention keeps them)
    sim = Simulator(MODEL, CLUSTER, Workload(global_batch=32, seq_len=1024))
    held = sim.memory_bytes(PLANS["a stage over both GPU types"])
    scores_per_sample = 2 * 16 * 1024 * 1024 / 2  # a layer's fp16/bf16 scores and their softmax, heads over tp=2
    assert held[8] - held[4] >= scores_per_sample  # at least one layer's scores of one sample
    assert held[4] == held[7] and held[8] == held[11]


def test_a_lane_whose_stages_differ_in_tp_is_counted_group_by_group() -> None:
    # (plans whose lanes share devices are refused before the simulator sees them)
    mixed_tp = Plan(micro_batches=4, schedule=Schedule.INTERLEAVED_1F1B, stages=(
        _stage((0, 5), range(0, 8), dp=4, tp=2), _stage((5, 10), range(0, 8), dp=2, tp=4)))
    assert not simulator_module._lane_aligned(mixed_tp, simulator_module._lanes(mixed_tp))
    sim = Simulator(MODEL, CLUSTER, Workload(global_batch=32, seq_len=1024))
    alone = sim.memory_bytes(mixed_tp.model_copy(update={"schedule": Schedule.ONE_F_ONE_B, "stages": (
        _stage((0, 10), range(0, 8), dp=4, tp=2),)}))
    held = sim.memory_bytes(mixed_tp)
    assert set(held) == set(range(8)) and len(set(held.values())) == 1  # every device holds both stages alike
    assert 0 < held[0] != alone[0]
