"""Discrete-event simulation of a pipeline schedule's tasks (stage x micro-batch x forward/backward).

Numeric only: it sees per-stage times, never a model or a cluster. A *lane* is one physical pipeline
rank (a stage's device group); it runs its tasks one after another in the order `lane_order` gives.

Dependencies, with `S` pipeline stages and p2p transfers that delay the consumer but occupy no lane:

    F(s, m) >= end F(s-1, m) + stages[s-1].send_forward_s
    B(S-1, m) >= end F(S-1, m)
    B(s, m) >= end B(s+1, m) + stages[s+1].send_backward_s

and each task starts at `max(lane free, dependency ready)`. The last stage's `send_forward_s` and the
first stage's `send_backward_s` are never used.

Ordering rules, per lane:
- gpipe: all forwards m = 0..M-1, then all backwards m = 0..M-1 (the order of
  torch.distributed.pipelining's ScheduleGPipe).
- 1f1b (PipeDream-flush, Megatron's non-interleaved schedule): stage s runs
  `min(S - s - 1, M)` warm-up forwards, then (forward, backward) pairs, then the cool-down backwards.
- interleaved_1f1b (Megatron's virtual pipeline, Narayanan et al. SC'21): `S` lanes each hold
  `v = num_stages / S` chunks; pipeline stage `chunk * S + lane`. The k-th forward on a lane is chunk
  `(k // S) % v`, the k-th backward chunk `v - 1 - (k // S) % v`, both of micro-batch
  `(k // (S v)) S + k % S`; lane r runs `min(2 (S - r - 1) + (v - 1) S, M v)` warm-up forwards, then
  1F1B pairs, then cool-down. Needs `M % S == 0`.

Speed: each schedule is compiled once per `(num_stages, micro_batches, schedule, lanes)` into flat
task ids, dependencies and the per-stage in-flight counts; `_compiled_schedule` is that explicit,
keyed memo table (least recently used out first, bounded by the tasks it holds). Then an O(tasks)
event loop in pure Python runs it, at 0.2 to 0.4 us a task (and
always for `simulate_orders`). Deep pipelines are evaluated level by level instead: a task starts at
`max(end of its lane predecessor, end of its dependency + lag)`, a longest path over a DAG the
schedule fixes, so the compiled schedule also groups the tasks by their depth in that DAG, and a
level costs a handful of numpy calls (two gathers, an add, a maximum, an add into the level's
slice), about 3 us however wide it is; a schedule finds its levels on its third evaluation
(finding them costs about 1.3 runs of the loop, which its first two evaluations run instead). It does
the loop's additions and maxima on the same operands, so the times are bit-for-bit the loop's.
It pays from about 16 tasks a level (`_LEVELS_MIN_WIDTH`): a pp64 1f1b pipeline of 256
micro-batches (32,768 tasks, 638 levels) takes about 2 ms instead of about 13 ms; shallow
pipelines of many micro-batches (2 to 8 tasks a level) stay on the loop. Records
(`record_tasks`) cost several times the evaluation either way.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from itertools import pairwise
from numbers import Real

import numpy as np
import numpy.typing as npt

from tagplan.ir.plan import Schedule

_Positions = npt.NDArray[np.intp]
_Seconds = npt.NDArray[np.float64]


class Phase(StrEnum):
    """Direction of a pipeline task."""

    FORWARD = "forward"
    BACKWARD = "backward"


TaskKey = tuple[int, int, Phase]
"""(stage, micro_batch, phase): one task of the schedule."""


@dataclass(frozen=True, slots=True)
class StageTiming:
    """Times of one pipeline stage for one micro-batch, in seconds."""

    forward_s: float
    """Forward on this stage (compute + tensor-parallel communication)."""
    backward_s: float
    """Backward, including recomputation if any."""
    send_forward_s: float = 0.0
    """p2p time to send the activations to the next stage (unused on the last stage)."""
    send_backward_s: float = 0.0
    """p2p time to send the activation gradient to the previous stage (unused on the first stage)."""

    def __post_init__(self) -> None:
        for name in _TIMING_FIELDS:
            value = getattr(self, name)
            if type(value) is float and 0.0 <= value < math.inf:  # the common case, without the ABC check
                continue
            if not (isinstance(value, Real) and math.isfinite(float(value)) and float(value) >= 0):
                raise ValueError(f"StageTiming.{name} must be a finite number of seconds >= 0, got {value!r}")


_TIMING_FIELDS = tuple(f.name for f in fields(StageTiming))


@dataclass(frozen=True, slots=True)
class Task:
    """One executed task: where it ran and when, in seconds from the iteration's start."""

    stage: int
    micro_batch: int
    phase: Phase
    lane: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of one simulated iteration; all times in seconds from its start."""

    tasks: tuple[Task, ...]
    """Every task, lane by lane, each lane in execution order; empty when not recorded."""
    lane_end_s: tuple[float, ...]
    """Per lane: when its last task ends."""
    stage_last_backward_s: tuple[tuple[float, float], ...]
    """Per stage: (start, end) of its last backward, which data-parallel gradient sync can overlap."""
    busy_s: tuple[float, ...]
    """Per lane: sum of its task durations."""
    max_in_flight: tuple[int, ...]
    """Per stage: most micro-batches forwarded but not yet fully backwarded at once (activation memory)."""
    makespan_s: float
    """When the last task of any lane ends."""


@dataclass(frozen=True, slots=True, eq=False)
class _Levels:
    """A compiled schedule's tasks renumbered by depth in the DAG of lane and dependency edges.

    Position `p` holds task id `task[p]`; the tasks of one level are contiguous positions and wait
    only for tasks of earlier levels. Position `n` (the task count) stands for "none": its end is 0.
    Shared by every evaluation of the schedule, so its arrays are read-only.
    """

    task: _Positions
    """Per position: its task id."""
    kind: _Positions
    """Per position: `phase * S + stage` (task id // M), the index of its duration and lag."""
    prev: _Positions
    """Per position: the position of the task before it on its lane."""
    dep: _Positions
    """Per position: the position of its dependency."""
    steps: tuple[tuple[slice, _Positions, _Positions], ...]
    """Per level: its positions and their slices of `prev` and `dep`."""
    lane_last: _Positions
    """Per lane: the position of its last task (n for an empty lane)."""
    last_backward: _Positions
    """Per stage: the position of its last backward."""


@dataclass(frozen=True, slots=True)
class _Times:
    """What one evaluation of a compiled schedule yields, in seconds."""

    lane_end_s: list[float]
    last_backward_s: tuple[tuple[float, float], ...]
    """Per stage: (start, end) of its last backward."""
    start_s: list[float]
    """Per task id; empty when not asked for."""
    end_s: list[float]


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A schedule as flat task ids: forward (s, m) is `s * M + m`, backward (s, m) is `S * M + s * M + m`."""

    num_stages: int
    micro_batches: int
    orders: tuple[tuple[int, ...], ...]
    deps: tuple[int, ...]
    """Per task id: the task id it waits for, or -1."""
    max_in_flight: tuple[int, ...]
    last_backward: tuple[int, ...]
    """Per stage: the task id of its last backward."""
    stage_lane: tuple[int, ...]
    """Per stage: the lane that runs it."""
    levels: _Levels | None = None
    """For deep schedules: the level decomposition the vectorized evaluation runs (else the event loop)."""
    levels_tried: bool = False
    """Whether `levels` was decided (`_LOOP_EVALUATIONS`: the first evaluations run the loop)."""
    lane_tasks: _Positions | None = field(default=None, compare=False)
    """The built-in schedules' `orders` as one (lanes x tasks per lane) array: their lanes run equally many tasks."""
    schedule: Schedule | None = field(default=None, compare=False)
    """The built-in schedule these orders are (None: custom orders); gpipe and 1f1b have their depths in closed
    form (`_closed_depth`), so their levels cost no run of the loop and pay from the first evaluation."""


def lane_order(num_stages: int, micro_batches: int, schedule: Schedule, lanes: int) -> list[list[TaskKey]]:
    """Return, per lane, its ordered `(stage, micro_batch, phase)` tasks under `schedule`."""
    _check_count("num_stages", num_stages)
    _check_count("micro_batches", micro_batches)
    _check_count("lanes", lanes)
    schedule = Schedule(schedule)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return _interleaved(num_stages, micro_batches, lanes)
    if lanes != num_stages:
        raise ValueError(f"schedule '{schedule.value}' runs one stage per lane: lanes={lanes} != {num_stages} stages")
    if schedule is Schedule.GPIPE:
        fwd = [[(s, m, Phase.FORWARD) for m in range(micro_batches)] for s in range(num_stages)]
        return [f + [(s, m, Phase.BACKWARD) for m in range(micro_batches)] for s, f in enumerate(fwd)]
    return [
        _one_f_one_b(
            [(s, m, Phase.FORWARD) for m in range(micro_batches)],
            [(s, m, Phase.BACKWARD) for m in range(micro_batches)],
            warmup=min(num_stages - s - 1, micro_batches),
        )
        for s in range(num_stages)
    ]


def _interleaved(num_stages: int, micro_batches: int, lanes: int) -> list[list[TaskKey]]:
    """Megatron's interleaved 1F1B order (forward_backward_pipelining_with_interleaving)."""
    S, M = lanes, micro_batches
    if num_stages % S:
        raise ValueError(
            f"interleaved_1f1b needs num_stages ({num_stages}) to be a multiple of lanes S ({S}): "
            "each lane holds the same number of virtual chunks"
        )
    if M % S:
        raise ValueError(f"interleaved_1f1b needs micro_batches ({M}) to be a multiple of S ({S}) pipeline lanes")
    v = num_stages // S

    # k-th task on a lane: chunk (k // S) % v (reversed for backwards), micro-batch (k // (S v)) S + k % S
    chunk_mb = [((k // S) % v, (k // (S * v)) * S + k % S) for k in range(M * v)]
    return [
        _one_f_one_b(
            [(c * S + r, m, Phase.FORWARD) for c, m in chunk_mb],
            [((v - 1 - c) * S + r, m, Phase.BACKWARD) for c, m in chunk_mb],
            warmup=min((S - r - 1) * 2 + (v - 1) * S, M * v),
        )
        for r in range(S)
    ]


def _one_f_one_b(fwd: list[TaskKey], bwd: list[TaskKey], *, warmup: int) -> list[TaskKey]:
    """`warmup` forwards, then (forward, backward) pairs, then the remaining backwards."""
    order = fwd[:warmup]
    for f, b in zip(fwd[warmup:], bwd, strict=False):
        order += (f, b)
    order += bwd[len(fwd) - warmup :]
    return order


def simulate_pipeline(
    stages: Sequence[StageTiming],
    micro_batches: int,
    schedule: Schedule,
    *,
    lanes: int | None = None,
    record_tasks: bool = True,
) -> PipelineResult:
    """Simulate one iteration of `schedule` over `stages` (pipeline order) and return its timings.

    `lanes` defaults to `len(stages)` for gpipe and 1f1b; interleaved_1f1b needs it (the number of
    physical stages S, with `len(stages) = S * v`). With `record_tasks=False` the result's `tasks` is
    empty and the call is several times faster (what the planner wants).
    """
    if not stages:
        raise ValueError("stages is empty: a pipeline needs at least one stage")
    schedule = Schedule(schedule)
    if lanes is None:
        if schedule is Schedule.INTERLEAVED_1F1B:
            raise ValueError("interleaved_1f1b needs lanes=S, the number of physical pipeline stages")
        lanes = len(stages)
    _check_count("micro_batches", micro_batches)  # before the memo table, where 2.0 would hit the entry for 2
    _check_count("lanes", lanes)
    key = (len(stages), micro_batches, schedule, lanes)
    compiled = _compiled_schedule(*key)  # raises for a shape the schedule does not take, before it is counted
    with _schedule_lock:
        uses = _schedule_uses[key] = _schedule_uses.get(key, 0) + 1
    if not compiled.levels_tried and (uses > _LOOP_EVALUATIONS or schedule in _CLOSED_DEPTH):
        compiled = _compiled_schedule(*key, levels=True)
    return _simulate(compiled, stages, record_tasks)


def simulate_orders(
    stages: Sequence[StageTiming],
    micro_batches: int,
    orders: Sequence[Sequence[TaskKey]],
    *,
    record_tasks: bool = True,
) -> PipelineResult:
    """Simulate explicit per-lane task orders (a custom schedule); see `simulate_pipeline`.

    Every (stage, micro-batch, phase) must appear exactly once and each stage on one lane only.
    Raises RuntimeError when the orders deadlock.
    """
    if not stages:
        raise ValueError("stages is empty: a pipeline needs at least one stage")
    _check_count("micro_batches", micro_batches)
    return _simulate(_compile(orders, len(stages), micro_batches), stages, record_tasks)


_PHASE_OFFSET = {Phase.FORWARD: 0, Phase.BACKWARD: 1}


_LEVELS_MIN_TASKS = 2048
"""Schedules smaller than this run the loop (under 1 ms) without computing their levels."""
_LEVELS_MIN_WIDTH = 16
"""Mean tasks per level from which the vectorized evaluation is faster: a level costs about 3 us, the loop
0.2 (gpipe) to 0.4 (1f1b) us a task; measured break-even 10 to 16."""


_SCHEDULE_CACHE_TASKS = 1_000_000
"""The compiled schedules kept, counted in tasks (about 120 bytes a task: ~120 MB). A planner run over
1024 GPUs compiles about 60 distinct schedules of 585k tasks in all; a count-bounded cache of 32
entries recompiled some of them."""
_schedule_cache: OrderedDict[tuple[int, int, Schedule, int], _Compiled] = OrderedDict()
_schedule_uses: dict[tuple[int, int, Schedule, int], int] = {}
"""Evaluations of each cached schedule (`simulate_pipeline`)."""
_LOOP_EVALUATIONS = 2
"""An interleaved schedule's first evaluations run the loop; the next finds its levels. Finding them costs
about 1.3 runs of the loop and an evaluation over them a fifth to an eighth of one (measured on pp32-96
schedules of 25k-50k tasks), so levels pay from the second evaluation after the one that finds them; most
shapes the grid and the search simulate are evaluated once or twice, which then run the loop alone. Gpipe
and 1f1b find theirs without the loop (`_closed_depth`) at their first evaluation."""
_schedule_lock = threading.Lock()  # simulators in several threads share them


def _compiled_schedule(num_stages: int, micro_batches: int, schedule: Schedule, lanes: int, *,
                       levels: bool = False) -> _Compiled:
    """The compiled schedule of a key, from the least-recently-used cache bounded by its tasks;
    `levels=True` also decides its level decomposition (once per cached schedule)."""
    key = (num_stages, micro_batches, Schedule(schedule), lanes)
    with _schedule_lock:
        hit = _schedule_cache.get(key)
        if hit is not None:
            _schedule_cache.move_to_end(key)
    compiled = hit if hit is not None else _compile_builtin(*key)
    if levels and not compiled.levels_tried:
        compiled = _with_levels(compiled)
    elif hit is not None:
        return hit
    with _schedule_lock:
        _schedule_cache[key] = compiled
        _schedule_cache.move_to_end(key)
        held = sum(2 * s * m for s, m, _, _ in _schedule_cache)
        while held > _SCHEDULE_CACHE_TASKS and len(_schedule_cache) > 1:
            old, _ = _schedule_cache.popitem(last=False)
            _schedule_uses.pop(old, None)
            held -= 2 * old[0] * old[1]
    return compiled


def _with_levels(compiled: _Compiled) -> _Compiled:
    """`compiled` with its levels where they pay: deep enough, and wide enough on average."""
    tasks = 2 * compiled.num_stages * compiled.micro_batches
    if tasks < _LEVELS_MIN_TASKS:
        return replace(compiled, levels_tried=True)
    levels = _levels(compiled)
    if tasks < _LEVELS_MIN_WIDTH * len(levels.steps):
        return replace(compiled, levels_tried=True)
    return replace(compiled, levels=levels, levels_tried=True)


def _compile(orders: Sequence[Sequence[TaskKey]], num_stages: int, micro_batches: int) -> _Compiled:
    S, M = num_stages, micro_batches
    n = 2 * S * M
    seen = [False] * n
    stage_lane = [-1] * S
    flat: list[tuple[int, ...]] = []
    for lane, order in enumerate(orders):
        ids = []
        for stage, mb, phase in order:
            if not (0 <= stage < S and 0 <= mb < M):
                raise ValueError(f"task {(stage, mb, phase)} on lane {lane} is outside {S} stages x {M} micro-batches")
            if stage_lane[stage] not in (-1, lane):
                raise ValueError(f"stage {stage} has tasks on lanes {stage_lane[stage]} and {lane}; it needs one lane")
            if phase not in _PHASE_OFFSET:
                raise ValueError(f"task {(stage, mb, phase)} on lane {lane}: phase must be one of {list(Phase)}")
            tid = _PHASE_OFFSET[phase] * S * M + stage * M + mb
            if seen[tid]:
                raise ValueError(f"task {(stage, mb, str(phase))} appears twice")
            seen[tid] = True
            stage_lane[stage] = lane
            ids.append(tid)
        flat.append(tuple(ids))
    if not all(seen):
        stage, mb = divmod(seen.index(False) % (S * M), M)
        raise ValueError(f"the orders miss some tasks, e.g. stage {stage}, micro-batch {mb}")
    fwd_deps = [-1] * M + list(range(S * M - M))
    bwd_deps = [S * M + t for t in range(M, S * M)] + list(range(S * M - M, S * M))
    return _Compiled(S, M, tuple(flat), tuple(fwd_deps + bwd_deps), *_stage_stats(flat, S, M), tuple(stage_lane))


def _compile_builtin(num_stages: int, micro_batches: int, schedule: Schedule, lanes: int) -> _Compiled:
    """`_compile(lane_order(...))` for the built-in schedules, built as task-id arrays (no per-task
    tuples, no checks: these orders are valid by construction; tests compare the two)."""
    _check_count("num_stages", num_stages)
    _check_count("micro_batches", micro_batches)
    _check_count("lanes", lanes)
    schedule = Schedule(schedule)
    if schedule is Schedule.INTERLEAVED_1F1B:
        valid = num_stages % lanes == 0 and micro_batches % lanes == 0
    else:
        valid = lanes == num_stages
    if not valid:
        lane_order(num_stages, micro_batches, schedule, lanes)  # raises lane_order's error for this shape
    S, M = num_stages, micro_batches
    ids = _lane_ids(S, M, schedule, lanes)
    orders = [tuple(a.tolist()) for a in ids]
    lane_tasks = _read_only(np.stack(ids)) if len({len(a) for a in ids}) == 1 else None
    stage_lane = list(range(S)) if schedule in _CLOSED_DEPTH else [0] * S
    for lane, order in enumerate(ids if schedule not in _CLOSED_DEPTH else ()):
        for st in np.unique((order // M) % S).tolist():
            stage_lane[st] = lane
    fwd_deps = [-1] * M + list(range(S * M - M))
    bwd_deps = [S * M + t for t in range(M, S * M)] + list(range(S * M - M, S * M))
    if schedule in _CLOSED_DEPTH:  # each stage on its own lane, its backward of the last micro-batch last
        stats = (max_in_flight(S, M, schedule, lanes), tuple(S * M + st * M + M - 1 for st in range(S)))
    else:
        stats = _stage_stats(orders, S, M)
    return _Compiled(S, M, tuple(orders), tuple(fwd_deps + bwd_deps), *stats, tuple(stage_lane),
                     lane_tasks=lane_tasks, schedule=schedule)


def max_in_flight(num_stages: int, micro_batches: int, schedule: Schedule, lanes: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward has run and backward not yet (`PipelineResult.
    max_in_flight`) without simulating: gpipe holds all M; 1f1b's stage s runs min(S - s - 1, M)
    warm-up forwards and then the first forward of its steady pairs, min(S - s, M) in all;
    interleaved schedules read their compiled order."""
    schedule = Schedule(schedule)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return _compiled_schedule(num_stages, micro_batches, schedule, lanes).max_in_flight
    _check_count("num_stages", num_stages)
    _check_count("micro_batches", micro_batches)
    if lanes != num_stages:
        raise ValueError(f"schedule '{schedule.value}' runs one stage per lane: lanes={lanes} != {num_stages} stages")
    if schedule is Schedule.GPIPE:
        return (micro_batches,) * num_stages
    if schedule is Schedule.ONE_F_ONE_B:
        return tuple(min(num_stages - s, micro_batches) for s in range(num_stages))
    raise ValueError(f"schedule {schedule.value!r} has no in-flight count; add it here as in `lane_order`")


def lane_peaks(num_stages: int, micro_batches: int, schedule: Schedule, lanes: int,
               weights: Sequence[float]) -> tuple[float, ...]:
    """Per lane, the peak of a running sum over its tasks in order: a forward of stage s adds
    `weights[s]`, its backward takes it away (e.g. the activation bytes a lane holds at its fullest,
    with `weights` a stage's bytes per micro-batch). The sums run in the lane's order, as a loop over
    `lane_order` would add them; the peak is at least 0 (before the first task)."""
    if len(weights) != num_stages:
        raise ValueError(f"{len(weights)} weights for a schedule of {num_stages} stages")
    c = _compiled_schedule(num_stages, micro_batches, schedule, lanes)
    M = c.micro_batches
    signed = np.concatenate([np.asarray(weights, dtype=np.float64), -np.asarray(weights, dtype=np.float64)])
    if c.lane_tasks is not None:  # a task id // M is phase * S + stage: its index into `signed`
        steps = signed.take(c.lane_tasks // M)
        return tuple(np.maximum(np.cumsum(steps, axis=1).max(axis=1, initial=0.0), 0.0).tolist())
    return tuple(max(float(np.cumsum(signed.take(np.asarray(order, dtype=np.int64) // M)).max(initial=0.0)), 0.0)
                 if order else 0.0 for order in c.orders)


def _lane_ids(S: int, M: int, schedule: Schedule, lanes: int) -> list[npt.NDArray[np.int64]]:
    """Per lane, its task ids in `lane_order`'s order (forward (s, m) is s M + m, backward S M + s M + m)."""
    if schedule is Schedule.INTERLEAVED_1F1B:
        v, k = S // lanes, np.arange(M * (S // lanes))
        chunk, mb = (k // lanes) % v, (k // (lanes * v)) * lanes + k % lanes
        return [_one_f_one_b_ids((chunk * lanes + r) * M + mb, S * M + ((v - 1 - chunk) * lanes + r) * M + mb,
                                 warmup=min((lanes - r - 1) * 2 + (v - 1) * lanes, M * v)) for r in range(lanes)]
    m = np.arange(M)
    if schedule is Schedule.GPIPE:
        return [np.concatenate([s * M + m, S * M + s * M + m]) for s in range(S)]
    if schedule is Schedule.ONE_F_ONE_B:
        return [_one_f_one_b_ids(s * M + m, S * M + s * M + m, warmup=min(S - s - 1, M)) for s in range(S)]
    raise ValueError(f"schedule {schedule.value!r} has no array-built order; add it here as in `lane_order`")


def _one_f_one_b_ids(fwd: npt.NDArray[np.int64], bwd: npt.NDArray[np.int64], *, warmup: int) -> npt.NDArray[np.int64]:
    """`_one_f_one_b` on id arrays: `warmup` forwards, then (forward, backward) pairs, then the rest."""
    pairs = len(fwd) - warmup
    steady = np.empty(2 * pairs, dtype=np.int64)
    steady[0::2], steady[1::2] = fwd[warmup:], bwd[:pairs]
    return np.concatenate([fwd[:warmup], steady, bwd[pairs:]])


def _stage_stats(orders: list[tuple[int, ...]], S: int, M: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage: max micro-batches in flight and its last backward's task id (each stage is on one lane)."""
    in_flight, peak, last = [0] * S, [0] * S, [0] * S
    for order in orders:
        for tid in order:
            stage = (tid // M) % S
            if tid < S * M:
                in_flight[stage] += 1
                peak[stage] = max(peak[stage], in_flight[stage])
            else:
                in_flight[stage] -= 1
                last[stage] = tid
    return tuple(peak), tuple(last)


def _closed_depth(S: int, M: int, schedule: Schedule) -> npt.NDArray[np.int64]:
    """Per task id, its depth in the DAG of lane and dependency edges (what the event loop gives with unit
    durations and no lags) for gpipe and 1f1b, in closed form. Forward (s, j) runs at depth s + j while it is
    among stage s's warm-up forwards and the first forward of its steady pairs (1f1b: j <= min(S - s - 1, M)),
    then one pair (two tasks) per micro-batch: s + 2 j. A 1f1b backward (s, j) follows the backward of stage
    s + 1, which the last stage runs right after its forward: 2 S - 1 - s + 2 j. Gpipe runs every forward
    first: its last stage's backward j starts after its M forwards and j backwards, S - 1 + M + j, and each
    stage before it one later. Tests compare both with the loop."""
    s, j = np.repeat(np.arange(S), M), np.tile(np.arange(M), S)
    if schedule is Schedule.GPIPE:
        return np.concatenate([s + j, 2 * S - 2 - s + M + j])
    if schedule is Schedule.ONE_F_ONE_B:
        forward = np.where(j <= np.minimum(S - s - 1, M), s + j, s + 2 * j)
        return np.concatenate([forward, 2 * S - 1 - s + 2 * j])
    raise ValueError(f"schedule {schedule.value!r} has no closed-form depth")


_CLOSED_DEPTH = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


def _levels(c: _Compiled) -> _Levels:
    """Group the tasks by depth: the event loop with unit durations and no lags starts each task at its depth."""
    n = 2 * c.num_stages * c.micro_batches
    closed = c.schedule is not None and c.schedule in _CLOSED_DEPTH
    depth = _closed_depth(c.num_stages, c.micro_batches, c.schedule) if closed and c.schedule is not None else \
        np.array(_run(c, [1.0] * n, [0.0] * n)[0])
    task = _read_only(np.argsort(depth, kind="stable"))
    position = np.empty(n + 1, dtype=np.intp)  # task id -> position; index -1 ("none") -> n
    position[task] = np.arange(n)
    position[n] = n
    prev = np.full(n, -1, dtype=np.intp)  # task id -> the task before it on its lane
    if c.lane_tasks is not None:
        prev[c.lane_tasks[:, 1:]] = c.lane_tasks[:, :-1]
    else:
        for order in c.orders:
            prev[list(order[1:])] = order[:-1]
    prev_position = _read_only(position[prev[task]])
    dep_position = _read_only(position[np.array(c.deps, dtype=np.intp)[task]])
    bounds = [0, *(np.flatnonzero(np.diff(depth[task])) + 1).tolist(), n]
    steps = tuple((slice(lo, hi), prev_position[lo:hi], dep_position[lo:hi]) for lo, hi in pairwise(bounds))
    lane_last = _read_only(position[[order[-1] if order else -1 for order in c.orders]])
    last_backward = _read_only(position[list(c.last_backward)])
    kind = _read_only(task // c.micro_batches)
    return _Levels(task, kind, prev_position, dep_position, steps, lane_last, last_backward)


def _read_only(array: _Positions) -> _Positions:
    array.setflags(write=False)
    return array


def _simulate(c: _Compiled, stages: Sequence[StageTiming], record_tasks: bool) -> PipelineResult:
    if len(stages) != c.num_stages:
        raise ValueError(f"{len(stages)} stage timings for a schedule of {c.num_stages} stages")
    times = _run_loop(c, stages) if c.levels is None else _run_levels(c.levels, stages, record_tasks)
    tasks: tuple[Task, ...] = ()
    if record_tasks:
        tasks = tuple(_records(c, times.start_s, times.end_s))
    return PipelineResult(
        tasks=tasks,
        lane_end_s=tuple(times.lane_end_s),
        stage_last_backward_s=times.last_backward_s,
        busy_s=_lane_busy_s(c, stages),
        max_in_flight=c.max_in_flight,
        makespan_s=max(times.lane_end_s),
    )


def _run_loop(c: _Compiled, stages: Sequence[StageTiming]) -> _Times:
    """The event loop over per-task-id durations and lags."""
    M = c.micro_batches
    dur: list[float] = []
    for attr in ("forward_s", "backward_s"):
        for st in stages:
            dur += [getattr(st, attr)] * M
    lag = [0.0] * M
    for st in stages[:-1]:
        lag += [st.send_forward_s] * M
    for st in stages[1:]:
        lag += [st.send_backward_s] * M
    lag += [0.0] * M
    start, end, lane_end = _run(c, dur, lag)
    return _Times(lane_end, tuple((start[t], end[t]) for t in c.last_backward), start, end)


def _run_levels(lv: _Levels, stages: Sequence[StageTiming], by_task: bool) -> _Times:
    """Level by level, vectorized: the event loop's additions and maxima, a level at a time."""
    dur_s = np.array([st.forward_s for st in stages] + [st.backward_s for st in stages], dtype=np.float64)
    lag_s = np.array(
        [0.0] + [st.send_forward_s for st in stages[:-1]] + [st.send_backward_s for st in stages[1:]] + [0.0],
        dtype=np.float64,
    )
    dur, lag = dur_s.take(lv.kind), lag_s.take(lv.kind)  # per position
    n = len(lv.task)
    end = np.zeros(n + 1)  # end[n] = 0: "no predecessor" or "no dependency"
    for level, prev, dep in lv.steps:
        t = end.take(dep)
        t += lag[level]
        np.maximum(t, end.take(prev), out=t)
        np.add(t, dur[level], out=end[level])
    start_s, end_s = [], []
    if by_task:
        start_s, end_s = _by_task(lv, _start(lv, end, lag, slice(None))), _by_task(lv, end[:n])
    last = lv.last_backward
    last_backward = zip(_start(lv, end, lag, last).tolist(), end.take(last).tolist(), strict=True)
    return _Times(end.take(lv.lane_last).tolist(), tuple(last_backward), start_s, end_s)


def _start(lv: _Levels, end: _Seconds, lag: _Seconds, at: slice | _Positions) -> _Seconds:
    """Start times of the tasks at positions `at`, recomputed from the ends exactly as the loop over levels did."""
    return np.maximum(end[lv.dep[at]] + lag[at], end[lv.prev[at]])


def _by_task(lv: _Levels, per_position: _Seconds) -> list[float]:
    by_task = np.empty_like(per_position)
    by_task[lv.task] = per_position
    return by_task.tolist()


def _lane_busy_s(c: _Compiled, stages: Sequence[StageTiming]) -> tuple[float, ...]:
    """Per lane, the seconds its tasks take: M x (forward + backward) of each stage on it."""
    busy = [0.0] * len(c.orders)
    for stage, lane in enumerate(c.stage_lane):
        busy[lane] += c.micro_batches * (stages[stage].forward_s + stages[stage].backward_s)
    return tuple(busy)


def _run(c: _Compiled, dur: list[float], lag: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Event loop: advance each lane until its next task waits for an unfinished dependency, then park
    the lane on that dependency; finishing a task wakes the (single) lane parked on it. O(tasks)."""
    n = len(dur)
    start = [0.0] * n
    end = [-1.0] * n  # -1: not yet run (times are >= 0)
    waiter = [-1] * n
    deps, orders = c.deps, c.orders
    pos = [0] * len(orders)
    free = [0.0] * len(orders)
    runnable = list(range(len(orders)))
    while runnable:
        lane = runnable.pop()
        order = orders[lane]
        i, t, count = pos[lane], free[lane], len(order)
        while i < count:
            tid = order[i]
            d = deps[tid]
            if d >= 0:
                ready = end[d]
                if ready < 0.0:
                    waiter[d] = lane
                    break
                ready += lag[tid]
                if ready > t:
                    t = ready
            start[tid] = t
            t += dur[tid]
            end[tid] = t
            if waiter[tid] >= 0:
                runnable.append(waiter[tid])
            i += 1
        pos[lane], free[lane] = i, t
    blocked = [lane for lane, order in enumerate(orders) if pos[lane] < len(order)]
    if blocked:
        lane = blocked[0]
        tid = orders[lane][pos[lane]]
        raise RuntimeError(
            f"pipeline order deadlocks on lanes {blocked}: lane {lane}'s next task {_key(c, tid)} "
            f"waits for {_key(c, deps[tid])}, which never runs before it"
        )
    return start, end, free


def _key(c: _Compiled, tid: int) -> TaskKey:
    backward, rest = divmod(tid, c.num_stages * c.micro_batches)
    stage, mb = divmod(rest, c.micro_batches)
    return stage, mb, Phase.BACKWARD if backward else Phase.FORWARD


def _records(c: _Compiled, start: list[float], end: list[float]) -> list[Task]:
    M, per_phase = c.micro_batches, c.num_stages * c.micro_batches
    phases = (Phase.FORWARD, Phase.BACKWARD)
    records = []
    for lane, order in enumerate(c.orders):
        for tid in order:
            backward, rest = divmod(tid, per_phase)
            records.append(Task(rest // M, rest % M, phases[backward], lane, start[tid], end[tid]))
    return records


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
