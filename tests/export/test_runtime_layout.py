"""The pipeline runtime's arithmetic (tagplan.export.runtime_layout): rows, transfers, programs, rank order."""

from __future__ import annotations

import pytest

from tagplan.export.runtime_layout import programs, rank_devices, simulate, stage_layouts, transfers
from tagplan.ir.plan import Plan, Schedule, Stage


def test_uneven_whole_shares_split_rows_and_transfers_intersect_them() -> None:
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), dp=2, batch_samples=(3, 1)),
                                         Stage(layers=(2, 4), devices=(2, 3), dp=2)))
    first, second = stage_layouts(plan, {d: d for d in range(4)}, micro_batch_size=4)
    assert (first.samples, first.offsets, second.samples) == ((3, 1), (0, 3), (2, 2))
    moves = [(x.src, x.dst, x.start, x.end, x.src_rows, x.dst_rows) for x in transfers(first, second)]
    assert moves == [(0, 0, 0, 2, (0, 2), (0, 2)), (0, 1, 2, 3, (2, 3), (0, 1)), (1, 1, 3, 4, (0, 1), (1, 2))]


def test_fractional_shares_are_refused_with_the_stage() -> None:
    plan = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), dp=2, batch_shares=(0.7, 0.3)),))
    with pytest.raises(ValueError, match="whole number"):
        stage_layouts(plan, {0: 0, 1: 1}, micro_batch_size=4)


def test_replica_ranks_ascend_within_tensor_parallel_groups() -> None:
    plan = Plan(stages=(Stage(layers=(0, 4), devices=(5, 4, 7, 6), dp=2, tp=2),))
    (lay,) = stage_layouts(plan, {4: 0, 5: 1, 6: 2, 7: 3}, micro_batch_size=2)
    assert lay.replica_ranks(0) == (0, 1) and lay.replica_ranks(1) == (2, 3) and lay.dp_ranks(1) == (1, 3)
    assert lay.place(3) == (1, 1) and lay.place(9) is None


@pytest.mark.parametrize("schedule", list(Schedule))
def test_every_schedule_gives_deadlock_free_programs(schedule: Schedule) -> None:
    if schedule is Schedule.INTERLEAVED_1F1B:
        groups = [(0, 1), (2,), (3,)]
        stages = tuple(Stage(layers=(i, i + 1), devices=groups[i % 3], dp=len(groups[i % 3])) for i in range(6))
    else:
        stages = tuple(Stage(layers=(i, i + 1), devices=(i,)) for i in range(3))
    plan = Plan(schedule=schedule, micro_batches=5, stages=stages)
    progs = programs(plan)
    assert simulate(plan, progs) is None
    for group, prog in progs.items():
        mine = [i for i, s in enumerate(plan.stages) if s.devices == group]
        assert sorted(prog) == sorted((k, s, m) for k in "FB" for s in mine for m in range(5))
    if schedule is Schedule.ONE_F_ONE_B:  # stage 0 warms up with 2 forwards, then alternates
        assert progs[(0,)][:4] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0)]


def test_a_program_that_waits_on_itself_is_reported() -> None:
    plan = Plan(micro_batches=1, stages=(Stage(layers=(0, 1), devices=(0,)), Stage(layers=(1, 2), devices=(1,))))
    bad = {(0,): [("B", 0, 0), ("F", 0, 0)], (1,): [("F", 1, 0), ("B", 1, 0)]}
    assert "deadlock" in (simulate(plan, bad) or "")


def test_ranks_follow_the_node_of_stage_zero_first() -> None:
    devices = (12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)  # stage 0 on the last node
    node_of = {d: d // 4 for d in range(16)}
    assert rank_devices(devices, node_of) == [12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7]
    assert rank_devices((5, 4, 0), node_of) == [4, 5, 0]
    assert rank_devices((5, 4, 0), None) == [5, 4, 0]
