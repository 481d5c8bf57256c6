"""Tests for tagplan/cost/pipeline.py: hand-computed schedules, closed forms and properties."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tagplan.cost.pipeline import (
    Phase,
    PipelineResult,
    StageTiming,
    _compile,
    _compile_builtin,
    _compiled_schedule,
    _simulate,
    lane_order,
    lane_peaks,
    max_in_flight,
    simulate_orders,
    simulate_pipeline,
)
from tagplan.ir.plan import Schedule

F, B = Phase.FORWARD, Phase.BACKWARD
GPIPE, ONE_F_ONE_B, INTERLEAVED = Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B


def equal(num_stages: int, f: float = 1.0, b: float = 2.0, comm: float = 0.0) -> list[StageTiming]:
    return [StageTiming(f, b, comm, comm) for _ in range(num_stages)]


def check_semantics(stages: list[StageTiming], result: PipelineResult) -> None:
    """Every task starts exactly at max(lane free, dependency ready) and lasts its stage's time."""
    S = len(stages)
    by_key = {(t.stage, t.micro_batch, t.phase): t for t in result.tasks}
    assert len(by_key) == len(result.tasks)
    lane_free: dict[int, float] = {}
    for t in result.tasks:
        timing = stages[t.stage]
        if t.phase is F:
            assert t.end_s == pytest.approx(t.start_s + timing.forward_s)
            dep = by_key.get((t.stage - 1, t.micro_batch, F))
            ready = dep.end_s + stages[t.stage - 1].send_forward_s if dep else 0.0
        elif t.stage == S - 1:
            assert t.end_s == pytest.approx(t.start_s + timing.backward_s)
            ready = by_key[(t.stage, t.micro_batch, F)].end_s
        else:
            assert t.end_s == pytest.approx(t.start_s + timing.backward_s)
            ready = by_key[(t.stage + 1, t.micro_batch, B)].end_s + stages[t.stage + 1].send_backward_s
        assert t.start_s == pytest.approx(max(lane_free.get(t.lane, 0.0), ready))
        lane_free[t.lane] = t.end_s
    assert result.lane_end_s == pytest.approx([lane_free.get(lane, 0.0) for lane in range(len(result.lane_end_s))])
    assert result.makespan_s == max(result.lane_end_s)


# --- orders -----------------------------------------------------------------------------------


def test_gpipe_order_is_all_forwards_then_backwards_in_micro_batch_order() -> None:
    assert lane_order(2, 3, GPIPE, 2)[1] == [(1, 0, F), (1, 1, F), (1, 2, F), (1, 0, B), (1, 1, B), (1, 2, B)]


def test_one_f_one_b_order_has_warmup_steady_state_and_cooldown() -> None:
    orders = lane_order(3, 4, ONE_F_ONE_B, 3)
    assert orders[0] == [(0, 0, F), (0, 1, F), (0, 2, F), (0, 0, B), (0, 3, F), (0, 1, B), (0, 2, B), (0, 3, B)]
    assert orders[2] == [(2, m, p) for m in range(4) for p in (F, B)]
    # more warm-up than micro-batches: all forwards first
    assert lane_order(4, 2, ONE_F_ONE_B, 4)[0] == [(0, 0, F), (0, 1, F), (0, 0, B), (0, 1, B)]


def test_interleaved_order_matches_megatron() -> None:
    # S = 2 lanes, v = 2 chunks, M = 4: stage = chunk * 2 + lane; lane 0 warms up 2 * 1 + 1 * 2 = 4 forwards
    lane0, lane1 = lane_order(4, 4, INTERLEAVED, 2)
    assert lane0 == [
        (0, 0, F), (0, 1, F), (2, 0, F), (2, 1, F),
        (0, 2, F), (2, 0, B), (0, 3, F), (2, 1, B), (2, 2, F), (0, 0, B), (2, 3, F), (0, 1, B),
        (2, 2, B), (2, 3, B), (0, 2, B), (0, 3, B),
    ]  # fmt: skip
    assert lane1 == [
        (1, 0, F), (1, 1, F),
        (3, 0, F), (3, 0, B), (3, 1, F), (3, 1, B), (1, 2, F), (1, 0, B),
        (1, 3, F), (1, 1, B), (3, 2, F), (3, 2, B), (3, 3, F), (3, 3, B),
        (1, 2, B), (1, 3, B),
    ]  # fmt: skip


@pytest.mark.parametrize("schedule", list(Schedule))
def test_orders_hold_every_task_once(schedule: Schedule) -> None:
    S, v, M = 4, 3, 8
    stages, lanes = (S * v, S) if schedule is INTERLEAVED else (S, S)
    orders = lane_order(stages, M, schedule, lanes)
    tasks = [t for order in orders for t in order]
    assert sorted(tasks) == sorted((s, m, p) for s in range(stages) for m in range(M) for p in (F, B))
    assert all(s % lanes == lane for lane, order in enumerate(orders) for s, _, _ in order)


# --- closed forms -----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", [GPIPE, ONE_F_ONE_B])
@pytest.mark.parametrize(("S", "M"), [(1, 1), (1, 5), (2, 1), (2, 4), (4, 8), (4, 3), (8, 32)])
def test_equal_stages_take_m_plus_s_minus_one_slots(schedule: Schedule, S: int, M: int) -> None:
    result = simulate_pipeline(equal(S, f=1.0, b=2.0), M, schedule)
    assert result.makespan_s == (M + S - 1) * 3.0
    assert result.busy_s == (M * 3.0,) * S
    check_semantics(equal(S), result)


def slow(S: int, position: int, k: float, f: float = 1.0, b: float = 2.0) -> list[StageTiming]:
    stages = equal(S, f, b)
    stages[position] = StageTiming(k * f, k * b)
    return stages


@pytest.mark.parametrize(("S", "M", "k", "position"), [(4, 8, 3.0, 0), (4, 8, 3.0, 2), (4, 8, 3.0, 3), (3, 5, 2.0, 1)])
def test_gpipe_slow_stage_dominates(S: int, M: int, k: float, position: int) -> None:
    # Forwards and backwards are each a flow shop of identical jobs: sum of the stage times plus
    # (M - 1) times the largest, so T = sum_s (f_s + b_s) + (M - 1) * k * (f + b), wherever the slow stage is.
    result = simulate_pipeline(slow(S, position, k), M, GPIPE)
    assert result.makespan_s == pytest.approx((S - 1 + k) * 3.0 + (M - 1) * k * 3.0)


@pytest.mark.parametrize(("S", "M", "k"), [(4, 8, 3.0), (2, 5, 4.0), (6, 12, 1.5)])
def test_one_f_one_b_slow_last_stage_dominates(S: int, M: int, k: float) -> None:
    # The slow last stage (no warm-up) runs F, B back to back from the moment its first input arrives,
    # sum_{s<S-1} f, and its last gradient drains back through sum_{s<S-1} b:
    # T = sum_s (f_s + b_s) + (M - 1) * k * (f + b).
    result = simulate_pipeline(slow(S, S - 1, k), M, ONE_F_ONE_B)
    assert result.makespan_s == pytest.approx((S - 1 + k) * 3.0 + (M - 1) * k * 3.0)
    check_semantics(slow(S, S - 1, k), result)


def test_one_f_one_b_slow_first_stage_hides_the_downstream_round_trip() -> None:
    # S = 2, stage 0 is k = 4 times slower (4, 8) than stage 1 (1, 2). Stage 0 never idles: its first
    # backward is ready at 4 + 1 + 2 = 7 <= 8 (after its two warm-up forwards), and its last backward
    # waits for stage 1's F + B = 3 <= 8 (the previous backward). So T = M * k * (f + b).
    result = simulate_pipeline(slow(2, 0, 4.0), 5, ONE_F_ONE_B)
    assert result.makespan_s == 5 * 4.0 * 3.0
    assert result.busy_s[0] == result.makespan_s


def test_p2p_adds_to_fill_and_drain() -> None:
    S, M, c = 4, 6, 0.5
    # GPipe: each of the S - 1 links delays the forward fill and the backward drain once.
    assert simulate_pipeline(equal(S, comm=c), M, GPIPE).makespan_s == (M + S - 1) * 3.0 + 2 * (S - 1) * c
    # One micro-batch: a round trip through every link.
    assert simulate_pipeline(equal(S, comm=c), 1, ONE_F_ONE_B).makespan_s == S * 3.0 + 2 * (S - 1) * c


def test_one_f_one_b_with_p2p_by_hand() -> None:
    # S = 2, M = 2, f = 1, b = 2, c = 0.5. Lane 0: F0 F1 B0 B1; lane 1: F0 B0 F1 B1.
    result = simulate_pipeline(equal(2, comm=0.5), 2, ONE_F_ONE_B)
    times = [(t.stage, t.micro_batch, t.phase, t.start_s, t.end_s) for t in result.tasks]
    assert times == [
        (0, 0, F, 0.0, 1.0), (0, 1, F, 1.0, 2.0), (0, 0, B, 5.0, 7.0), (0, 1, B, 8.0, 10.0),
        (1, 0, F, 1.5, 2.5), (1, 0, B, 2.5, 4.5), (1, 1, F, 4.5, 5.5), (1, 1, B, 5.5, 7.5),
    ]  # fmt: skip
    assert result.stage_last_backward_s == ((8.0, 10.0), (5.5, 7.5))
    assert result.lane_end_s == (10.0, 7.5)
    assert result.makespan_s == 10.0


@pytest.mark.parametrize(("S", "M"), [(2, 1), (2, 4), (3, 2), (4, 1), (4, 5), (5, 7)])
def test_one_f_one_b_p2p_costs_a_round_trip_per_round_of_s_micro_batches(S: int, M: int) -> None:
    # Stage 0 holds S micro-batches in flight; each further round of S costs their compute S (f + b)
    # plus one round trip 2 (S - 1) c that the warm-up cannot hide.
    f, b, c = 0.7, 1.3, 0.25
    step = simulate_pipeline(equal(S, f, b, c), M + S, ONE_F_ONE_B).makespan_s
    step -= simulate_pipeline(equal(S, f, b, c), M, ONE_F_ONE_B).makespan_s
    assert step == pytest.approx(S * (f + b) + 2 * (S - 1) * c)


@pytest.mark.parametrize(("S", "v", "M"), [(2, 2, 2), (4, 2, 8), (4, 2, 4), (4, 4, 16), (8, 2, 16), (4, 3, 12)])
def test_interleaving_divides_the_bubble_by_v(S: int, v: int, M: int) -> None:
    f, b = 1.0, 2.0  # per physical stage; each of its v chunks takes 1 / v of it
    chunks = [StageTiming(f / v, b / v) for _ in range(S * v)]
    result = simulate_pipeline(chunks, M, INTERLEAVED, lanes=S)
    assert result.makespan_s == pytest.approx(M * (f + b) + (S - 1) * (f + b) / v)
    assert result.makespan_s < simulate_pipeline(equal(S, f, b), M, ONE_F_ONE_B).makespan_s
    check_semantics(chunks, result)


@pytest.mark.parametrize(("S", "M"), [(1, 3), (4, 2), (4, 4), (4, 9), (8, 32)])
def test_max_in_flight(S: int, M: int) -> None:
    assert simulate_pipeline(equal(S), M, ONE_F_ONE_B).max_in_flight == tuple(min(S - s, M) for s in range(S))
    assert simulate_pipeline(equal(S), M, GPIPE).max_in_flight == (M,) * S


def test_without_records_the_numbers_are_the_same() -> None:
    stages = [StageTiming(0.3, 0.5, 0.1, 0.2), StageTiming(0.4, 0.9, 0.0, 0.05), StageTiming(0.2, 0.3)]
    full = simulate_pipeline(stages, 6, ONE_F_ONE_B)
    bare = simulate_pipeline(stages, 6, ONE_F_ONE_B, record_tasks=False)
    assert bare.tasks == ()
    assert (bare.makespan_s, bare.lane_end_s, bare.busy_s) == (full.makespan_s, full.lane_end_s, full.busy_s)
    assert bare.stage_last_backward_s == full.stage_last_backward_s
    assert len(full.tasks) == 2 * 3 * 6
    check_semantics(stages, full)


# --- level-by-level evaluation ------------------------------------------------------------------


def heterogeneous(num_stages: int, seed: int) -> list[StageTiming]:
    """Random per-stage times and p2p lags, with some exact zeros and repeats so that ties occur."""
    rng = random.Random(seed)

    def seconds(high: float) -> float:
        return rng.choice([0.0, 0.25 * high, rng.uniform(0.0, high), rng.uniform(0.0, high)])

    return [StageTiming(seconds(2.0) + 0.1, seconds(4.0) + 0.1, seconds(0.5), seconds(0.5)) for _ in range(num_stages)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("schedule", "num_stages", "lanes", "M", "vectorized"),
    [
        (GPIPE, 32, 32, 64, True),  # 4,096 tasks in 190 levels
        (ONE_F_ONE_B, 32, 32, 64, True),
        (ONE_F_ONE_B, 48, 48, 40, True),
        (INTERLEAVED, 64, 32, 64, True),  # 8,192 tasks in 318 levels
        (INTERLEAVED, 96, 32, 32, True),  # v = 3 chunks per lane
        (INTERLEAVED, 48, 16, 48, False),  # 4,608 tasks but only 14.5 a level: the event loop is faster
        (ONE_F_ONE_B, 4, 4, 6, False),  # small: both runs take the event loop
    ],
)
def test_level_by_level_evaluation_equals_the_event_loop(
    schedule: Schedule, num_stages: int, lanes: int, M: int, vectorized: bool, seed: int
) -> None:
    stages = heterogeneous(num_stages, seed)
    compiled = _compiled_schedule(num_stages, M, schedule, lanes, levels=True)
    assert (compiled.levels is not None) == vectorized, "the cases must exercise both sides of the switch"
    reference = _simulate(replace(compiled, levels=None), stages, record_tasks=True)  # the per-task event loop
    fast = simulate_pipeline(stages, M, schedule, lanes=lanes)
    # the same additions and maxima in the same order: equal to the bit, task by task
    assert [(t.start_s, t.end_s) for t in fast.tasks] == [(t.start_s, t.end_s) for t in reference.tasks]
    assert fast == reference
    assert fast.makespan_s > 0 and fast.busy_s == reference.busy_s
    bare = simulate_pipeline(stages, M, schedule, lanes=lanes, record_tasks=False)
    assert bare.tasks == ()
    assert (bare.makespan_s, bare.lane_end_s, bare.busy_s) == (fast.makespan_s, fast.lane_end_s, fast.busy_s)
    assert bare.stage_last_backward_s == fast.stage_last_backward_s


@pytest.mark.parametrize(
    ("schedule", "num_stages", "lanes", "M"),
    [(GPIPE, 32, 32, 64), (ONE_F_ONE_B, 48, 48, 40), (INTERLEAVED, 96, 32, 32)],
)
def test_levels_keep_every_edge_and_order_it(schedule: Schedule, num_stages: int, lanes: int, M: int) -> None:
    """Whatever the times: each task reads its lane predecessor and its dependency, from earlier levels."""
    compiled = _compiled_schedule(num_stages, M, schedule, lanes, levels=True)
    lv = compiled.levels
    assert lv is not None
    n = 2 * num_stages * M
    assert sorted(lv.task.tolist()) == list(range(n))
    position = {int(t): p for p, t in enumerate(lv.task)} | {-1: n}
    level = [0] * (n + 1)
    level[n] = -1  # "none" comes before everything
    covered = 0
    for depth, (positions, prev, dep) in enumerate(lv.steps):
        assert positions.start == covered
        covered = positions.stop
        assert prev.tolist() == lv.prev[positions].tolist() and dep.tolist() == lv.dep[positions].tolist()
        level[positions] = [depth] * (positions.stop - positions.start)
    assert covered == n
    for order in compiled.orders:
        for before, tid in zip((-1, *order), order, strict=False):
            assert lv.prev[position[tid]] == position[before]
            assert lv.dep[position[tid]] == position[compiled.deps[tid]]
            assert lv.kind[position[tid]] == tid // M
            assert level[lv.prev[position[tid]]] < level[position[tid]] > level[lv.dep[position[tid]]]
    assert lv.lane_last.tolist() == [position[order[-1]] for order in compiled.orders]
    assert lv.last_backward.tolist() == [position[t] for t in compiled.last_backward]


def test_custom_orders_of_a_deep_schedule_match_it() -> None:
    stages = heterogeneous(32, 3)
    orders = lane_order(32, 64, ONE_F_ONE_B, 32)
    assert _compiled_schedule(32, 64, ONE_F_ONE_B, 32, levels=True).levels is not None
    assert simulate_orders(stages, 64, orders) == simulate_pipeline(stages, 64, ONE_F_ONE_B)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batches": 0}, "micro_batches must be an integer >= 1, got 0"),
        ({"micro_batches": 2.0}, "micro_batches must be an integer"),
        ({"stages": []}, "stages is empty"),
        ({"lanes": 3}, "lanes=3 != 2 stages"),
        ({"schedule": INTERLEAVED}, "needs lanes=S"),
        ({"schedule": INTERLEAVED, "lanes": 2, "micro_batches": 3}, r"micro_batches \(3\).*S \(2\)"),
        ({"schedule": INTERLEAVED, "lanes": 3}, r"num_stages \(2\).*lanes S \(3\)"),
    ],
)
def test_bad_inputs_say_what_is_wrong(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"stages": equal(2), "micro_batches": 4, "schedule": ONE_F_ONE_B} | kwargs
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_stage_timing_rejects_bad_times(bad: float) -> None:
    with pytest.raises(ValueError, match=r"StageTiming\.send_backward_s must be a finite number of seconds >= 0"):
        StageTiming(1.0, 1.0, 0.0, bad)


def test_deadlocked_order_raises() -> None:
    orders = [[(0, 0, F), (0, 0, B), (0, 1, B), (0, 1, F)], [(1, 0, F), (1, 0, B), (1, 1, F), (1, 1, B)]]
    with pytest.raises(RuntimeError, match=r"deadlocks on lanes \[0, 1\]"):
        simulate_orders(equal(2), 2, orders)


def test_custom_orders_must_cover_each_task_once() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        simulate_orders(equal(1), 1, [[(0, 0, F), (0, 0, F), (0, 0, B)]])
    with pytest.raises(ValueError, match="miss some tasks"):
        simulate_orders(equal(1), 2, [[(0, 0, F), (0, 0, B)]])
    with pytest.raises(ValueError, match="stage 0 has tasks on lanes 0 and 1"):
        simulate_orders(equal(1), 1, [[(0, 0, F)], [(0, 0, B)]])


def test_custom_orders_reproduce_the_schedule() -> None:
    stages = [StageTiming(0.3, 0.5, 0.1, 0.2), StageTiming(0.4, 0.9, 0.0, 0.05)]
    orders = lane_order(2, 5, ONE_F_ONE_B, 2)
    assert simulate_orders(stages, 5, orders) == simulate_pipeline(stages, 5, ONE_F_ONE_B)


# --- properties -------------------------------------------------------------------------------

seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)
timings = st.builds(StageTiming, seconds, seconds, seconds, seconds)


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[list[StageTiming], int, Schedule, int]:
    schedule = draw(st.sampled_from(list(Schedule)))
    lanes = draw(st.integers(1, 5))
    chunks = draw(st.integers(1, 3)) if schedule is INTERLEAVED else 1
    micro_batches = lanes * draw(st.integers(1, 3)) if schedule is INTERLEAVED else draw(st.integers(1, 9))
    stages = draw(st.lists(timings, min_size=lanes * chunks, max_size=lanes * chunks))
    return stages, micro_batches, schedule, lanes


@settings(max_examples=150, deadline=None)
@given(pipelines(), st.data())
def test_makespan_never_decreases_when_a_time_grows(case: tuple, data: st.DataObject) -> None:
    stages, M, schedule, lanes = case
    before = simulate_pipeline(stages, M, schedule, lanes=lanes)
    check_semantics(stages, before)
    i = data.draw(st.integers(0, len(stages) - 1))
    field = data.draw(st.sampled_from(["forward_s", "backward_s", "send_forward_s", "send_backward_s"]))
    grown = list(stages)
    times = {name: getattr(stages[i], name) for name in StageTiming.__dataclass_fields__}
    grown[i] = StageTiming(**(times | {field: times[field] + data.draw(seconds)}))
    after = simulate_pipeline(grown, M, schedule, lanes=lanes)
    assert after.makespan_s >= before.makespan_s
    for result in (before, after):  # busy time sums durations without the idle gaps: allow rounding
        assert result.makespan_s >= max(result.busy_s) * (1 - 1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(timings, min_size=1, max_size=6), st.integers(1, 12))
def test_one_f_one_b_bounds_activations(stages: list[StageTiming], M: int) -> None:
    S = len(stages)
    one_f_one_b = simulate_pipeline(stages, M, ONE_F_ONE_B, record_tasks=False).max_in_flight
    gpipe = simulate_pipeline(stages, M, GPIPE, record_tasks=False).max_in_flight
    assert all(a <= g for a, g in zip(one_f_one_b, gpipe, strict=True))
    assert max(one_f_one_b) <= S
    assert simulate_pipeline(stages, M + S, ONE_F_ONE_B, record_tasks=False).max_in_flight == tuple(
        min(S - s, M + S) for s in range(S)
    )


def test_the_schedule_cache_keeps_what_its_task_budget_holds_and_drops_the_least_recent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import OrderedDict

    from tagplan.cost import pipeline

    monkeypatch.setattr(pipeline, "_schedule_cache", OrderedDict())
    monkeypatch.setattr(pipeline, "_SCHEDULE_CACHE_TASKS", 2 * 64)  # two schedules of 2 x 4 x 8 tasks
    a = _compiled_schedule(4, 8, ONE_F_ONE_B, 4)
    b = _compiled_schedule(4, 8, GPIPE, 4)
    assert _compiled_schedule(4, 8, ONE_F_ONE_B, 4) is a  # a hit, and now the most recent
    _compiled_schedule(2, 16, GPIPE, 2)  # 64 more tasks: the least recent (b) goes
    assert _compiled_schedule(4, 8, ONE_F_ONE_B, 4) is a
    again = _compiled_schedule(4, 8, GPIPE, 4)
    assert again is not b and again.orders == b.orders  # compiled anew, the same schedule
    assert sum(2 * s * m for s, m, _, _ in pipeline._schedule_cache) <= 2 * 64


@pytest.mark.parametrize("schedule", list(Schedule))
def test_the_built_in_schedules_compile_to_what_their_lane_orders_compile_to(schedule: Schedule) -> None:
    """The array-built compilation of a built-in schedule equals compiling its `lane_order` task by task."""
    shapes = [(1, 1, 1), (2, 1, 2), (4, 3, 4), (4, 9, 4), (7, 16, 7), (8, 8, 2), (12, 8, 4), (16, 32, 4), (6, 6, 3)]
    for stages, micro_batches, lanes in shapes:
        if schedule is not Schedule.INTERLEAVED_1F1B:
            lanes = stages
        elif stages % lanes or micro_batches % lanes:
            continue
        slow = _compile(lane_order(stages, micro_batches, schedule, lanes), stages, micro_batches)
        assert _compile_builtin(stages, micro_batches, schedule, lanes) == slow, (stages, micro_batches, lanes)
    with pytest.raises(ValueError, match="multiple of"):
        _compile_builtin(6, 4, Schedule.INTERLEAVED_1F1B, 4)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_in_flight_counts_and_lane_peaks_follow_the_lane_orders(schedule: Schedule) -> None:
    """`max_in_flight` (closed form for gpipe and 1f1b) and `lane_peaks` (running sums over the
    compiled order) equal walking `lane_order` task by task, with random stage weights."""
    rng = random.Random(7)
    for stages, micro_batches, lanes in [(1, 1, 1), (2, 1, 2), (4, 3, 4), (4, 9, 4), (7, 16, 7), (8, 8, 2),
                                         (12, 8, 4), (16, 32, 4), (6, 6, 3)]:
        if schedule is not Schedule.INTERLEAVED_1F1B:
            lanes = stages
        elif stages % lanes or micro_batches % lanes:
            continue
        orders = lane_order(stages, micro_batches, schedule, lanes)
        weights = [rng.uniform(0.0, 5.0) for _ in range(stages)]
        held, peak_in_flight, peaks = [0] * stages, [0] * stages, []
        for order in orders:
            peak = current = 0.0
            for stage, _, phase in order:
                forward = phase is Phase.FORWARD
                held[stage] += 1 if forward else -1
                peak_in_flight[stage] = max(peak_in_flight[stage], held[stage])
                current += weights[stage] if forward else -weights[stage]
                peak = max(peak, current)
            peaks.append(peak)
        assert max_in_flight(stages, micro_batches, schedule, lanes) == tuple(peak_in_flight)
        assert lane_peaks(stages, micro_batches, schedule, lanes, weights) == tuple(peaks)
    with pytest.raises(ValueError, match="weights"):
        lane_peaks(4, 4, schedule, 4 if schedule is not Schedule.INTERLEAVED_1F1B else 2, [1.0])


def test_a_deep_interleaved_schedule_finds_its_levels_after_its_first_evaluations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding an interleaved schedule's levels costs more than a run of the loop: the first evaluations run
    the loop, the next finds them, and all give the same times."""
    from collections import OrderedDict

    from tagplan.cost import pipeline

    monkeypatch.setattr(pipeline, "_schedule_cache", OrderedDict())
    monkeypatch.setattr(pipeline, "_schedule_uses", {})
    stages = heterogeneous(64, 5)
    results = []
    for _ in range(pipeline._LOOP_EVALUATIONS):
        results.append(simulate_pipeline(stages, 64, INTERLEAVED, lanes=32))
        assert pipeline._schedule_cache[64, 64, INTERLEAVED, 32].levels is None
    results.append(simulate_pipeline(stages, 64, INTERLEAVED, lanes=32))
    assert pipeline._schedule_cache[64, 64, INTERLEAVED, 32].levels is not None
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("schedule", [GPIPE, ONE_F_ONE_B])
def test_gpipe_and_1f1b_take_their_levels_from_the_first_evaluation(schedule: Schedule,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Their depths are in closed form: no run of the loop finds them, so a deep shape the grid simulates once
    is evaluated level by level, to the bit what the loop gives."""
    from collections import OrderedDict

    from tagplan.cost import pipeline

    monkeypatch.setattr(pipeline, "_schedule_cache", OrderedDict())
    monkeypatch.setattr(pipeline, "_schedule_uses", {})
    monkeypatch.setattr(pipeline, "_run", _no_loop)
    stages = heterogeneous(32, 5)
    first = simulate_pipeline(stages, 64, schedule, record_tasks=False)
    assert pipeline._schedule_cache[32, 64, schedule, 32].levels is not None
    monkeypatch.undo()
    compiled = _compiled_schedule(32, 64, schedule, 32)
    assert first == _simulate(replace(compiled, levels=None), stages, record_tasks=False)  # the event loop's


def _no_loop(*_: object) -> None:
    raise AssertionError("the event loop ran")


@pytest.mark.parametrize("schedule", [GPIPE, ONE_F_ONE_B])
def test_closed_form_depths_are_the_event_loops_unit_time_starts(schedule: Schedule) -> None:
    from tagplan.cost.pipeline import _closed_depth, _run

    for num_stages in range(1, 13):
        for M in (*range(1, 15), 31, 64):
            compiled = _compile_builtin(num_stages, M, schedule, num_stages)
            n = 2 * num_stages * M
            assert _closed_depth(num_stages, M, schedule).tolist() == _run(compiled, [1.0] * n, [0.0] * n)[0], \
                (num_stages, M)
    with pytest.raises(ValueError, match="no closed-form depth"):
        _closed_depth(4, 4, INTERLEAVED)


def test_an_evicted_schedule_forgets_its_evaluations_and_a_bad_shape_is_never_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import OrderedDict

    from tagplan.cost import pipeline

    monkeypatch.setattr(pipeline, "_schedule_cache", OrderedDict())
    monkeypatch.setattr(pipeline, "_schedule_uses", {})
    monkeypatch.setattr(pipeline, "_SCHEDULE_CACHE_TASKS", 2 * 64)  # two schedules of 2 x 4 x 8 tasks
    stages = heterogeneous(4, 1)
    simulate_pipeline(stages, 8, ONE_F_ONE_B)
    assert pipeline._schedule_uses == {(4, 8, ONE_F_ONE_B, 4): 1}
    simulate_pipeline(stages, 8, GPIPE)
    simulate_pipeline(heterogeneous(2, 1), 16, GPIPE)  # 64 more tasks: the 1f1b schedule goes, and its count
    assert (4, 8, ONE_F_ONE_B, 4) not in pipeline._schedule_uses
    with pytest.raises(ValueError, match="multiple of"):
        simulate_pipeline(heterogeneous(6, 1), 4, INTERLEAVED, lanes=4)
    assert len(pipeline._schedule_uses) == len(pipeline._schedule_cache) == 2
