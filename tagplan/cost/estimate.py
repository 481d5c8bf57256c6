"""A closed-form iteration time from the cost model's per-stage figures: the GNN's physical prior.

TAG and Placeto feed their GNNs each op's profiled compute time; tagplan does the same at stage
granularity. `estimate` takes each stage's per-micro-batch task times from the calibrated cost
model (`Simulator.stage_costs`: roofline compute, TP collectives on the stage's own links, p2p
sends) and composes them with textbook formulas instead of the event simulation:

    period    = max(busiest lane's work, max_s cycle_s)       (GPipe: the busiest lane's work)
    pipeline  = M * period + (sum_i t_i - busiest lane's work) / v + sum_i p2p_i - (period - busiest lane's work)
    lane end  = pipeline - backward sends still travelling to the first stage
    iteration = max_lane(lane end + exposed gradient sync + optimizer step)

with t_i the forward plus backward of stage i for one micro-batch, p2p_i its sends, M micro-batches,
v interleaved chunks per lane (Narayanan et al., SC'21: bubble (p - 1) / v), and the round trip
sum_i (t_i + p2p_i). 1F1B's stage s keeps S - s micro-batches in flight, so the forward-backward
cycle through stages s..S-1 (their work and the sends between them) carries S - s micro-batches:
cycle_s = (sum_{j >= s} t_j + sends between them) / (S - s). A pipeline whose sends outweigh its
compute is paced by its slowest such cycle, not by its busiest lane (interleaved: round trip / S). Exposed gradient sync
is what the lane's reductions take beyond its last backward, at least the last bucket.

The GNN predicts the correction log(T / estimate): how the schedule, the overlaps and the links
really compose (the event simulation, or, after retraining on traces, the hardware). Its
accuracy therefore rests partly on the calibration, as the simulator's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Plan, Schedule


@dataclass(frozen=True)
class Estimate:
    """One plan's closed-form iteration and the parts it is made of, in seconds."""

    iteration_s: float
    pipeline_s: float  # last task end of the busiest schedule
    busy_s: float  # M times the busiest lane's work per micro-batch
    p2p_s: float  # one micro-batch's sends along the whole pipeline, both directions
    dp_s: float  # the largest lane's gradient synchronisation, overlapped or not
    exposed_dp_s: float  # the part of it on the critical lane that no backward hides
    optimizer_s: float  # the critical lane's optimizer step
    stage_s: np.ndarray  # [S] forward + backward of one micro-batch on each stage
    stage_tp_s: np.ndarray  # [S] of which tensor-parallel communication
    stage_dp_s: np.ndarray  # [S] each stage's gradient reduction and weight gather per iteration


def estimate(sim: Simulator, plan: Plan) -> Estimate:
    """The closed-form estimate of `plan` with `sim`'s cost model (and its memo tables)."""
    costs, timings = sim.stage_costs(plan)
    stages, micro = len(plan.stages), plan.micro_batches
    stage_s = np.array([t.forward_s + t.backward_s for t in timings])
    stage_tp = np.array([c.critical.forward_tp_s + c.critical.backward_tp_s for c in costs])
    sync = np.array([c.dp_sync_s for c in costs]).reshape(stages, 2)
    lanes: dict[tuple[int, ...], list[int]] = {}
    for i, stage in enumerate(plan.stages):
        lanes.setdefault(stage.devices, []).append(i)
    members = list(lanes.values())
    chunks = max(stages // len(members), 1)
    work = np.array([stage_s[m].sum() for m in members])
    busiest = int(work.argmax())
    p2p = float(sum(t.send_forward_s + t.send_backward_s for t in timings))
    # 1F1B keeps about S micro-batches in flight, so a pipeline slower to traverse than S times its
    # busiest lane is paced by the round trip; GPipe starts every forward at once
    round_trip = stage_s.sum() + p2p
    period = float(work[busiest])
    if plan.schedule is Schedule.ONE_F_ONE_B:
        # stage s keeps S - s micro-batches in flight: the cycle through stages s..S-1 and back
        cut = np.zeros(stages)  # cut[s]: both directions between stage s and s + 1
        for c in range(stages - 1):
            cut[c] = timings[c].send_forward_s + timings[c + 1].send_backward_s
        suffix_work = np.cumsum(stage_s[::-1])[::-1]
        suffix_sends = np.cumsum(cut[::-1])[::-1]
        in_flight = stages - np.arange(stages)
        binding = in_flight < micro  # with M <= S - s micro-batches the cycle never closes
        if binding.any():
            period = max(period, float(np.max(((suffix_work + suffix_sends) / in_flight)[binding])))
    elif plan.schedule is Schedule.INTERLEAVED_1F1B:
        period = max(period, round_trip / stages)
    pipeline = micro * period + (stage_s.sum() - work[busiest]) / chunks + p2p - (period - work[busiest])
    # the first stage's last backward ends last; a later lane ends before the gradients travel back
    back = np.array([t.backward_s + t.send_backward_s for t in timings])
    hidden = sim.overlapped(plan)
    tied, waiting = sim.tied_sync(plan)
    finish, parts = [], []
    for every in members:
        end = pipeline - (back[: every[0]].sum() if chunks == 1 else 0.0)
        # reduced after the flush (the runtime's rule) and the tied table's sum: exposed whole
        exposed = float(sum(sync[i].sum() for i in every if not hidden[i])) + (
            tied if waiting.intersection(every) else 0.0)
        lane = [i for i in every if hidden[i]]
        reduce, gather = sync[lane, 0].sum(), sync[lane, 1].sum()
        layers = max(sum(plan.stages[i].num_layers for i in lane), 1)
        if reduce:
            exposed += max(reduce - min(timings[i].backward_s for i in lane), reduce / layers)
        if gather:
            first_forward = min(costs[i].critical.forward_compute_s for i in lane)
            exposed += max(gather - first_forward, gather / layers)
        step = sim.optimizer_s(plan, every, costs)
        finish.append(end + exposed + step)
        parts.append((exposed, step))
    critical = int(np.argmax(finish))
    return Estimate(
        iteration_s=float(finish[critical]), pipeline_s=float(pipeline), busy_s=float(micro * work[busiest]),
        p2p_s=p2p, dp_s=float(max(sync[m].sum() for m in members)), exposed_dp_s=float(parts[critical][0]),
        optimizer_s=float(parts[critical][1]), stage_s=stage_s, stage_tp_s=stage_tp, stage_dp_s=sync.sum(axis=1))
