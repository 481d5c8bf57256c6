"""The simulator: Plan -> Report, the ground truth the search is judged by.

One iteration is simulated as: per-stage forward/backward task times for one micro-batch
(compute from the roofline, TP all-reduces on the stage's own links; the slowest replica of a
stage paces it, so uneven batch shares across unequal GPUs are simulated replica by replica);
an event simulation of the schedule with p2p transfers on the links between stage groups;
then per lane the data-parallel gradient synchronisation, overlapped with the last backward
except for the last bucket (or after the flush, exposed, where `Workload.grad_reduce_overlap` is
False), and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration, calibrated_cluster
from tagplan.cost.comm import Collective, CommMode, CommModel
from tagplan.cost.compute import model_flops
from tagplan.cost.memory import (
    DeviceMemory,
    fused_loss_saved_bytes,
    is_loss,
    model_state_bytes,
    transient_bytes_per_sample,
)
from tagplan.cost.object_memo import object_memo
from tagplan.cost.pipeline import PipelineResult, StageTiming, lane_peaks, max_in_flight, simulate_pipeline
from tagplan.cost.report import Breakdown, DeviceMemoryReport, Report, StageReport
from tagplan.cost.sharding import divides, sharding_problem
from tagplan.cost.stage_cost import GroupCost, StageCoster, sharding_key
from tagplan.errors import SpecError
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import Block, ModelGraph, Op, OpKind
from tagplan.ir.plan import Plan, Schedule, Stage, check_plan, check_whole_samples
from tagplan.ir.workload import LossKernel, Workload


@dataclass(frozen=True)
class StagePlanCost:
    """A stage's costs for one micro-batch, with its critical (slowest) tensor-parallel group."""

    critical: GroupCost
    samples: tuple[float, ...]  # per tensor-parallel group, per micro-batch (a replica's samples / cp)
    local_params: float
    p2p_s: float  # send one micro-batch's activations to the next stage
    dp_sync_s: tuple[float, float]  # (gradient reduction, parameter all-gather after the step) seconds
    zero3_s: tuple[float, float]  # per micro-batch parameter gathers/reductions (forward, backward)
    zero3_hidden_fraction: float = 1.0  # of the shorter of compute and fetches, hidden under the other (`Calibration`)

    @property
    def task_s(self) -> tuple[float, float]:
        """Forward and backward task seconds of one micro-batch with the ZeRO-3 collectives: prefetched (hidden
        fraction 1) a task takes the longer of its compute and its fetches; otherwise the hidden part of the shorter
        of the two is not paid again."""
        fwd, bwd = (self.critical.forward_s, self.zero3_s[0]), (self.critical.backward_s, self.zero3_s[1])
        if self.zero3_hidden_fraction >= 1.0:
            return max(fwd), max(bwd)
        hidden = self.zero3_hidden_fraction
        return sum(fwd) - hidden * min(fwd), sum(bwd) - hidden * min(bwd)


@dataclass(frozen=True)
class Simulation:
    """A report with the pipeline's task times behind it (for timelines)."""

    report: Report
    pipeline: PipelineResult
    lanes: tuple[tuple[int, ...], ...]  # lane -> devices
    lane_tail_s: tuple[tuple[float, float, float], ...]  # lane -> (last task end, exposed dp, optimizer)


ReduceOverlap = Callable[[Plan], Mapping[int, bool]]
"""A runtime's rule for which stages reduce their gradients while their backward runs: stage index
-> overlapped, for the stages it decides (the others follow `Workload.grad_reduce_overlap`). The
export layer provides one per target (`export.capability.reduce_overlap`); the simulator imports none."""


class Simulator:
    """Simulates plans of one model on one cluster and workload; reuse it to share memo tables."""

    def __init__(self, model: ModelGraph, cluster: Cluster, workload: Workload, *,
                 calibration: Calibration = DEFAULT_CALIBRATION, comm_mode: CommMode = CommMode.TOPOLOGY,
                 fold: bool = True, reduce_overlap: ReduceOverlap | None = None) -> None:
        """`fold=False` costs every layer on its own and clears the cost memos (block, tensor-parallel,
        data-parallel and tied-gradient times) between plans (for ablation; lookups of pure values such as
        links, device specs and sample counts stay memoised);
        `reduce_overlap`: the runtime's per-stage rule (default: `workload.grad_reduce_overlap` for all)."""
        cluster = attention_cluster(cluster, workload.fused_attention)
        self.model, self.cluster, self.workload = model, cluster, workload
        self.calibration, self.comm_mode = calibration, comm_mode
        self.reduce_overlap = reduce_overlap
        self.comm = CommModel(calibrated_cluster(cluster, calibration), comm_mode,  # measured links, if any
                              collective_overhead_s=(lambda device: calibration.overhead_s("collective_overhead_s",
                                                                                           device))
                              if calibration.collective_overhead_s else None)
        self.coster = StageCoster(model, cluster, workload, calibration, self.comm, fold=fold)
        self._dp_sync_memo: dict[tuple[tuple[int, ...], int, int, int, float, int], tuple[float, float]] = {}
        per_block = {block.hash: model_flops(block) for block in model.blocks}  # once per distinct block
        self._model_flops = sum(per_block[layer.block] for layer in model.layers)
        # per device id, for the O(devices) sums of every report
        self._peak_flops = tuple(d.spec.peak_flops(workload.dtype) for d in cluster.devices)
        self._mem_bytes = tuple(d.spec.mem_bytes for d in cluster.devices)
        self._fused = tuple(d.spec.fused_attention for d in cluster.devices)
        self._fused_memo: dict[tuple[int, ...], tuple[bool, ...]] = {}
        self._tied_memo: dict[tuple[object, ...], float] = {}
        self._least_mem_memo: dict[tuple[int, ...], float] = {}
        self._samples_memo: dict[tuple[object, ...], tuple[float, ...]] = {}

    def simulate(self, plan: Plan) -> Report:
        """The Report of one iteration of `plan`."""
        return self.run(plan, record_tasks=False).report

    def fits(self, plan: Plan) -> bool:
        """`simulate(plan).fits` from the memory terms alone (`memory_bytes`): what a walk that stops
        at the first plan too big asks before timing one."""
        if plan.schedule is not Schedule.INTERLEAVED_1F1B and _disjoint_stages(plan):
            _check(plan, self.model, self.cluster, self.workload)
            per_micro = self.workload.global_batch // plan.micro_batches
            lanes = len(_lanes(plan))
            in_flight = self._in_flight(plan, max_in_flight(len(plan.stages), plan.micro_batches, plan.schedule,
                                                            lanes), lanes)
            verdicts = [self._uniform_fits(stage, self._samples(stage, per_micro), in_flight[i])
                        for i, stage in enumerate(plan.stages)]
            if None not in verdicts:
                return all(verdicts)
        return self._fits(self._memory_alone(plan))

    def stage_fits(self, plan: Plan, index: int, stage: Stage) -> bool:
        """Whether stage `index` of `plan`, replaced by `stage` (same layers and devices), fits its devices: what
        `fits` says of the plan with that stage where no two stages share a device (1F1B and GPipe plans: a
        stage's memory is its devices' alone). ValueError for an interleaved plan, whose devices hold several
        stages."""
        if plan.schedule is Schedule.INTERLEAVED_1F1B:
            raise ValueError("stage_fits: an interleaved plan's devices hold several stages; ask fits(plan)")
        in_flight = max_in_flight(len(plan.stages), plan.micro_batches, plan.schedule, len(_lanes(plan)))[index]
        return self.stage_fits_alone(stage, plan.micro_batches, float(in_flight))

    def stage_fits_alone(self, stage: Stage, micro_batches: int, in_flight: float) -> bool:
        """Whether `stage` fits its devices, holding them alone, with `in_flight` micro-batches of its
        activations held at its peak and the global batch in `micro_batches` micro-batches (`stage_fits` where
        the caller has the schedule's in-flight count already)."""
        samples = self._samples(stage, self.workload.global_batch // micro_batches)
        verdict = self._uniform_fits(stage, samples, in_flight)
        if verdict is not None:
            return verdict
        alone = Plan.model_construct(micro_batches=micro_batches, schedule=Schedule.ONE_F_ONE_B, stages=(stage,))
        mem = self._memory(alone, [samples], [self.coster.local_params(stage)], [in_flight])
        return self._fits(mem)

    def memory_bytes(self, plan: Plan) -> dict[int, float]:
        """Per device the plan uses, its peak bytes (the report's `memory_per_device_bytes`) from the
        memory terms alone: model state, activations held at the schedule's peak in flight and
        transients, without stage times or the event simulation."""
        return {d: _total(mems) for group, mems in self._memory_alone(plan).items() for d in group}

    def _memory_alone(self, plan: Plan) -> dict[tuple[int, ...], list[DeviceMemory]]:
        _check(plan, self.model, self.cluster, self.workload)
        per_micro = self.workload.global_batch // plan.micro_batches
        samples = [self._samples(s, per_micro) for s in plan.stages]
        params = [self.coster.local_params(s) for s in plan.stages]
        lanes = len(_lanes(plan))
        in_flight = max_in_flight(len(plan.stages), plan.micro_batches, plan.schedule, lanes)
        return self._memory(plan, samples, params, self._in_flight(plan, in_flight, lanes))

    def run(self, plan: Plan, *, record_tasks: bool = True) -> Simulation:
        """Simulate `plan`; SpecError for a plan that does not apply to this model or cluster.

        `record_tasks=False` skips the per-task records a timeline needs (most of the time of the
        pipeline simulation, which then takes a few ms even for deep pipelines).
        """
        _check(plan, self.model, self.cluster, self.workload)
        if not self.coster.fold:
            self.coster.clear()
            self._dp_sync_memo.clear()
            self._tied_memo.clear()
        costs = [self._stage(plan, i) for i in range(len(plan.stages))]
        lanes = _lanes(plan)
        timings = [self._timing(plan, i, c) for i, c in enumerate(costs)]
        pipe = simulate_pipeline(timings, plan.micro_batches, plan.schedule, lanes=len(lanes),
                                 record_tasks=record_tasks)
        hidden = self.overlapped(plan)
        tails = [self._lane_tail(plan, costs, pipe, lane, list(range(lane, len(plan.stages), len(lanes))), hidden)
                 for lane in range(len(lanes))]
        tied, ends = self.tied_sync(plan)
        if tied:  # after the flush the first stage and the tied head's sum their tables' gradients
            tails = [(end, dp + tied, opt) if any(i % len(lanes) == lane for i in ends) else (end, dp, opt)
                     for lane, (end, dp, opt) in enumerate(tails)]
        report = self._report(plan, costs, pipe, _exposed_p2p_s(timings, plan.micro_batches), lanes, tails)
        return Simulation(report, pipe, tuple(devs for devs, _ in lanes), tuple(tails))

    def stage_costs(self, plan: Plan) -> tuple[list[StagePlanCost], list[StageTiming]]:
        """Per stage: its per-micro-batch costs and the task times the schedule simulation takes.

        What `run` composes into an iteration; also the analytic features of `tagplan.gnn`.
        """
        _check(plan, self.model, self.cluster, self.workload)
        costs = [self._stage(plan, i) for i in range(len(plan.stages))]
        return costs, [self._timing(plan, i, c) for i, c in enumerate(costs)]

    def optimizer_s(self, plan: Plan, stages: list[int], costs: list[StagePlanCost]) -> float:
        """Seconds of the optimizer step of `stages` run one after another on their devices."""
        return self._optimizer_s(plan, stages, costs)

    def _stage(self, plan: Plan, index: int) -> StagePlanCost:
        stage = plan.stages[index]
        per_micro = self.workload.global_batch // plan.micro_batches
        samples = self._samples(stage, per_micro)
        groups = self.coster.group_costs(stage, samples)
        # The stage waits for its slowest tensor-parallel group in each phase separately.
        fwd = max(groups, key=lambda c: c.forward_s)
        bwd = max(groups, key=lambda c: c.backward_s)
        # fixed per-micro-batch cost (host dispatch, data, launches the op model misses), counted with compute
        device = self.coster.slowest(stage.devices).name
        overhead = self.calibration.overhead_s("micro_batch_overhead_s", device)
        # a recomputed stage also pays each checkpoint call's own cost, once per checkpointed layer
        # (the runtimes checkpoint the repeated blocks, not the embedding or head) and micro-batch
        replay = (self.coster.checkpointed_layers(stage) * self.calibration.overhead_s("recompute_overhead_s", device)
                  if stage.recompute else 0.0)
        critical = GroupCost(fwd.forward_compute_s + overhead, bwd.backward_compute_s + replay, fwd.forward_tp_s,
                             bwd.backward_tp_s)
        params = self.coster.local_params(stage)
        p2p = 0.0
        if index + 1 < len(plan.stages):
            nxt = plan.stages[index + 1]
            act = self.coster.cut_bytes(stage.layers[1]) * per_micro
            p2p = (self.comm.p2p_groups(stage.devices, nxt.devices, act).time_s
                   + self.calibration.overhead_s("p2p_overhead_s", device))
        reduce, gather = self._dp_sync(stage, params)
        reduce += self.coster.per_iteration_tp_s(stage)
        scale, hidden = self.calibration.zero3_factors(device)
        gathers, reductions = self._zero3(stage, params)
        return StagePlanCost(critical, samples, params, p2p, (reduce, gather), (gathers * scale, reductions * scale),
                             hidden)

    def _samples(self, stage: Stage, per_micro: int) -> tuple[float, ...]:
        """Per tensor-parallel group of `stage` (`Stage.tp_group`), its share of a micro-batch of `per_micro`:
        its replica's whole samples, split by sequence over the cp groups of the replica (memoised)."""
        key = (stage.dp, stage.cp, stage.batch_samples, stage.batch_shares, per_micro)
        hit = self._samples_memo.get(key)
        if hit is None:
            hit = self._samples_memo[key] = tuple(float(n) / stage.cp for n in stage.replica_samples(per_micro)
                                                  for _ in range(stage.cp))
        return hit

    def _dp_sync(self, stage: Stage, params: float) -> tuple[float, float]:
        """(gradient reduction, parameter all-gather) seconds of one stage's data-parallel sync.

        ZeRO 0 all-reduces gradients; ZeRO 1-2 reduce-scatter them and all-gather the updated
        weights after the step; ZeRO-3 reduces inside every backward (see `_zero3`). Sharded
        stages (ZeRO 1-3) issue one collective per layer, as FSDP's per-layer units and Megatron's
        distributed-optimizer buckets do: each pays the collective's latency (`_per_layer`).
        """
        if stage.dp_cp < 2 or stage.zero >= 3:
            return 0.0, 0.0
        # equal stages of deep pipelines sync alike; sharded ones issue a collective per layer
        key = (stage.devices, stage.tp, stage.cp, stage.zero, params, self._synced_layers(stage))
        hit = self._dp_sync_memo.get(key)
        if hit is None:
            hit = self._dp_sync_memo[key] = self._dp_sync_uncached(stage, params)
        return hit

    def _dp_sync_uncached(self, stage: Stage, params: float) -> tuple[float, float]:
        grad_bytes = params * self.workload.grad_reduce_bytes_per_param
        weight_bytes = params * self.workload.stored_weight_bytes_per_param
        reduce = gather = 0.0
        for j in range(stage.tp):  # the tp ranks' syncs run at once; the slowest paces the stage
            group = tuple(stage.devices[g * stage.tp + j] for g in range(stage.dp_cp))
            if stage.zero == 0:
                reduce = max(reduce, self.comm.collective(Collective.ALL_REDUCE, group, grad_bytes).time_s)
            else:
                reduce = max(reduce, self._per_layer(Collective.REDUCE_SCATTER, group, grad_bytes, stage))
                gather = max(gather, self._per_layer(Collective.ALL_GATHER, group, weight_bytes, stage))
        return reduce, gather

    def _per_layer(self, kind: Collective, group: tuple[int, ...], nbytes: float, stage: Stage) -> float:
        """Seconds of `kind` over `nbytes` issued as one collective per layer of `stage` that holds
        parameters (under the alpha-beta model the split of bytes between layers does not change the
        sum, only the count)."""
        layers = self._synced_layers(stage)
        return layers * self.comm.collective(kind, group, nbytes / layers).time_s

    def _synced_layers(self, stage: Stage) -> int:
        """Layers of `stage` with parameters: the units a sharded stage reduces and gathers one by one."""
        blocks = self.model.block_by_hash
        return max(sum(n for h, n in self.coster.units(stage) if blocks[h].params > 0), 1)

    def _zero3(self, stage: Stage, params: float) -> tuple[float, float]:
        if stage.zero < 3 or stage.dp_cp < 2:
            return 0.0, 0.0
        gather = scatter = 0.0
        for j in range(stage.tp):  # the slowest of the tp ranks paces the stage
            group = tuple(stage.devices[g * stage.tp + j] for g in range(stage.dp_cp))
            weights = params * self.workload.stored_weight_bytes_per_param
            gather = max(gather, self._per_layer(Collective.ALL_GATHER, group, weights, stage))
            grads = params * self.workload.grad_reduce_bytes_per_param
            scatter = max(scatter, self._per_layer(Collective.REDUCE_SCATTER, group, grads, stage))
        return gather, gather + scatter

    def _timing(self, plan: Plan, index: int, cost: StagePlanCost) -> StageTiming:
        # ZeRO-3 prefetches parameters: a task takes the longer of its compute and its gathers (`task_s`)
        fwd, bwd = cost.task_s
        back = plan.stages[index - 1] if index > 0 else None
        send_back = 0.0
        if back is not None:
            act = self.coster.cut_bytes(back.layers[1]) * self.workload.global_batch / plan.micro_batches
            device = self.coster.slowest(plan.stages[index].devices).name
            send_back = (self.comm.p2p_groups(plan.stages[index].devices, back.devices, act).time_s
                         + self.calibration.overhead_s("p2p_overhead_s", device))
        return StageTiming(forward_s=fwd, backward_s=bwd, send_forward_s=cost.p2p_s, send_backward_s=send_back)

    def overlapped(self, plan: Plan) -> list[bool]:
        """Per stage, whether its gradient reduction runs while its backward does (the runtime's rule,
        else `Workload.grad_reduce_overlap`)."""
        rule = self.reduce_overlap(plan) if self.reduce_overlap is not None else {}
        return [rule.get(i, self.workload.grad_reduce_overlap) for i in range(len(plan.stages))]

    def tied_sync(self, plan: Plan) -> tuple[float, frozenset[int]]:
        """(seconds, stages that wait for it) of all-reducing a tied table's gradients between its
        owner (the first stage) and each stage holding a copy (a tied head), device by device, after
        the flush: Megatron's embedding-group all-reduce, DeepSpeed's ReduceTiedGrads, the torch
        pipeline runtime's `sum_tied`. It sums the gradient as stored (DeepSpeed's `fp32_allreduce`
        covers only its data-parallel reduction). Pairs run concurrently; the slowest paces it.
        (0, {}) where no stage holds a copy."""
        first = plan.stages[0]
        seconds, waiting = 0.0, {0}
        for i, stage in enumerate(plan.stages[1:], start=1):
            params = self.coster.tied_copy_params(stage)
            if not params:
                continue
            waiting.add(i)
            nbytes = params * self.workload.grad_bytes_per_param  # the gradient as stored, not the dp reduction's
            whole = self.coster.tied_table_params(stage) * self.workload.grad_bytes_per_param
            # the meshes decide pair by pair or one all-reduce: equal devices under other meshes are another sum
            key = (first.devices, (first.dp, first.cp, first.tp), stage.devices, (stage.dp, stage.cp, stage.tp),
                   nbytes, whole)
            hit = self._tied_memo.get(key)
            if hit is None:
                hit = self._tied_memo[key] = self._tied_sum_s(first, stage, nbytes, whole)
            seconds = max(seconds, hit)
        return (seconds, frozenset(waiting)) if seconds else (0.0, frozenset())

    def _tied_sum_s(self, first: Stage, holder: Stage, nbytes: float, whole_bytes: float) -> float:
        """One tied sum: pair by pair where both stages have the same (dp, tp) (device j of one with
        device j of the other, `nbytes` each), else one all-reduce of the whole table (`whole_bytes`)
        over both stages' devices (the torch pipeline runtime's `sum_tied`)."""
        if (first.dp, first.cp, first.tp) == (holder.dp, holder.cp, holder.tp):
            pairs = [(a, b) for a, b in zip(first.devices, holder.devices, strict=True) if a != b]
            return max([0.0, *(self.comm.collective(Collective.ALL_REDUCE, p, nbytes).time_s for p in pairs)])
        group = tuple(dict.fromkeys((*first.devices, *holder.devices)))
        return self.comm.collective(Collective.ALL_REDUCE, group, whole_bytes).time_s if len(group) > 1 else 0.0

    def _lane_tail(self, plan: Plan, costs: list[StagePlanCost], pipe: PipelineResult, lane: int,
                   members: list[int], hidden: list[bool]) -> tuple[float, float, float]:
        """(last task end, exposed gradient sync, optimizer step) of one lane (stages `members`), in
        seconds; `hidden`: per stage, whether its reduction overlaps its backward (`overlapped`)."""
        after = [i for i in members if not hidden[i]]
        # a runtime that reduces after the flush: all of it exposed, one after another on shared links
        flushed = sum(costs[i].dp_sync_s[0] + costs[i].dp_sync_s[1] for i in after)
        members = [i for i in members if hidden[i]]
        if not members:
            return pipe.lane_end_s[lane], flushed, self._step_s(plan, [*after], costs)
        gather = sum(costs[i].dp_sync_s[1] for i in members)
        layers = max(sum(plan.stages[i].num_layers for i in members), 1)
        # the overlap window is compute only, so more bandwidth can never lengthen the iteration
        first_forward = min(costs[i].critical.forward_compute_s for i in members)
        # Gradient buckets reduce while the last backward runs, and updated weights are gathered
        # while the next iteration's first forward runs (Megatron's overlap_grad_reduce and
        # overlap_param_gather, DeepSpeed's prefetch); the last bucket of each cannot overlap.
        # Each chunk's reduction starts with its own last backward (interleaved plans hold several);
        # reductions share the links, so they queue.
        exposed, queue_end, last = flushed, 0.0, None
        for i in sorted(members, key=lambda k: pipe.stage_last_backward_s[k][0]):
            reduce = costs[i].dp_sync_s[0]
            if reduce:
                queue_end = max(queue_end, pipe.stage_last_backward_s[i][0]) + reduce
                last = reduce / max(plan.stages[i].num_layers, 1)
        if last is not None:
            exposed += max(queue_end - pipe.lane_end_s[lane], last)
        if gather:
            exposed += max(gather - first_forward, gather / layers)
        return pipe.lane_end_s[lane], exposed, self._step_s(plan, [*members, *after], costs)

    def _step_s(self, plan: Plan, members: list[int], costs: list[StagePlanCost]) -> float:
        """The lane's optimizer step and the fixed per-iteration cost (reported together)."""
        return self._optimizer_s(plan, members, costs) + max(
            self.calibration.overhead_s("iteration_overhead_s", self.coster.slowest(plan.stages[i].devices).name)
            for i in members)

    def _optimizer_s(self, plan: Plan, members: list[int], costs: list[StagePlanCost]) -> float:
        """Memory-bound optimizer step: read and write weights, gradients and state once."""
        w = self.workload
        traffic = 2.0 * (w.stored_weight_bytes_per_param + w.grad_bytes_per_param + w.optimizer_bytes_per_param)
        seconds = 0.0
        for i in members:
            stage = plan.stages[i]
            spec = self.coster.slowest(stage.devices)
            shard = stage.dp_cp if stage.zero >= 1 else 1
            bandwidth = spec.mem_bandwidth_Bps * self.calibration.bandwidth_fraction(spec.name)
            step = costs[i].local_params / shard * traffic / bandwidth + self.calibration.launch_s(spec.name)
            seconds += step * self.calibration.optimizer_factor(spec.name)
        return seconds

    def _report(self, plan: Plan, costs: list[StagePlanCost], pipe: PipelineResult, p2p_s: float,
                lanes: list[tuple[tuple[int, ...], list[int]]], tails: list[tuple[float, float, float]]) -> Report:
        finish = [end + dp + opt for end, dp, opt in tails]
        critical = max(range(len(finish)), key=lambda i: finish[i])
        iteration = finish[critical]
        breakdown = self._breakdown(plan, costs, lanes[critical][1], p2p_s, tails[critical], iteration)
        held = self._memory(plan, [c.samples for c in costs], [c.local_params for c in costs],
                            self._in_flight(plan, pipe.max_in_flight, len(pipe.lane_end_s)))
        parts = {d: mems for group, mems in held.items() for d in group}
        group_total = _group_totals(held)
        devices = tuple(sorted(parts))
        total_of = {d: t for group, t in group_total.items() for d in group}
        totals = tuple(map(total_of.__getitem__, devices))
        mem_bytes = self._mem_bytes
        ratio = {d: total_of[d] / mem_bytes[d] for d in devices}
        fits = self._fits_totals(group_total)
        worst = max(devices, key=ratio.__getitem__)
        stage_worst = [max(s.devices, key=ratio.__getitem__) for s in plan.stages]
        flops = 3.0 * self.workload.global_batch * self._model_flops
        peak = sum(self._peak_flops[d] for d in devices)
        return Report(
            iteration_time_s=iteration, throughput_samples_s=self.workload.global_batch / iteration,
            tokens_per_s=self.workload.global_batch * self.model.seq_len / iteration,
            tflops_per_device=flops / iteration / len(devices) / 1e12, mfu=flops / (iteration * peak),
            peak_memory_bytes=max(totals), worst_device=worst, fits=fits,
            breakdown=breakdown, devices=devices, memory_per_device_bytes=totals,
            worst_device_memory=_device_report(self.cluster, worst, parts[worst]),
            stages=tuple(self._stage_report(plan, i, c, pipe, _device_report(self.cluster, d, parts[d]))
                         for i, (c, d) in enumerate(zip(costs, stage_worst, strict=True))),
            devices_used=len(devices), model_flops_per_iteration=flops, comm_mode=self.comm_mode.value,
        )

    def _breakdown(self, plan: Plan, costs: list[StagePlanCost], members: list[int], p2p_s: float,
                   tail: tuple[float, float, float], iteration: float) -> Breakdown:
        m = plan.micro_batches
        compute = m * sum(costs[i].critical.forward_compute_s + costs[i].critical.backward_compute_s for i in members)
        tp = m * sum(costs[i].critical.forward_tp_s + costs[i].critical.backward_tp_s for i in members)
        busy = m * sum(sum(costs[i].task_s) for i in members)
        zero3_exposed = max(busy - compute - tp, 0.0)
        end, dp_exposed, optimizer = tail
        idle = max(end - busy, 0.0)
        pp = min(p2p_s, idle)
        bubble = max(iteration - compute - tp - zero3_exposed - dp_exposed - optimizer - pp, 0.0)
        return Breakdown(compute=compute, tp_comm=tp, dp_comm=dp_exposed + zero3_exposed, pp_comm=pp, bubble=bubble,
                         optimizer=optimizer)

    def _fits(self, held: dict[tuple[int, ...], list[DeviceMemory]]) -> bool:
        """Whether every device's peak bytes are within its memory (a group's least memory bounds it), stopping
        at the first group that does not fit. Each distinct list of `DeviceMemory` objects is totalled once per
        memory size (`_group_totals`)."""
        seen: dict[tuple[tuple[int, ...], float], bool] = {}
        for group, mems in held.items():
            key = (tuple(map(id, mems)), self._least_mem(group))
            ok = seen.get(key)
            if ok is None:
                ok = seen[key] = _total(mems) <= key[1]
            if not ok:
                return False
        return True

    def _fits_totals(self, group_total: dict[tuple[int, ...], float]) -> bool:
        """`_fits` from each group's total, where the report has them already."""
        least = self._least_mem
        return all(total <= least(group) for group, total in group_total.items())

    def _uniform_fits(self, stage: Stage, samples: tuple[float, ...], in_flight: float) -> bool | None:
        """Whether a stage whose devices hold it alone fits them, where every tensor-parallel group holds the
        same memory (equal samples, one kind of attention kernel): one `DeviceMemory` against the stage's least
        device memory, as `_memory` and `_fits` would find group by group; None where the groups differ."""
        mem = self._uniform_memory(stage, samples, self.coster.local_params(stage), in_flight)
        return None if mem is None else _total([mem]) <= self._least_mem(stage.devices)

    def _uniform_memory(self, stage: Stage, samples: tuple[float, ...], params: float,
                        in_flight: float) -> DeviceMemory | None:
        """The one `DeviceMemory` every tensor-parallel group of `stage` holds, where they all hold the same (equal
        samples, one kind of attention kernel); None where the groups differ."""
        kinds = self._fused_kinds(stage.devices)
        if min(samples) != max(samples) or len(kinds) != 1:
            return None
        fused_sample = self._activation_memory(stage)
        scores = self._score_memory(stage)
        fused = kinds[0] or not (scores[0] or scores[1])
        per_sample = fused_sample if fused else (fused_sample[0] + scores[0], fused_sample[1] + scores[1])
        return self._stage_memory(stage, params, samples[0], per_sample, in_flight)

    def _fused_kinds(self, devices: tuple[int, ...]) -> tuple[bool, ...]:
        """The distinct fused-attention flags of `devices` (memoised per device set)."""
        hit = self._fused_memo.get(devices)
        if hit is None:
            hit = self._fused_memo[devices] = tuple(sorted({self._fused[d] for d in devices}))
        return hit

    def _least_mem(self, group: tuple[int, ...]) -> float:
        hit = self._least_mem_memo.get(group)
        if hit is None:
            hit = self._least_mem_memo[group] = min(self._mem_bytes[d] for d in group)
        return hit

    def _memory(self, plan: Plan, samples: list[tuple[float, ...]], params: list[float],
                in_flight: list[float]) -> dict[tuple[int, ...], list[DeviceMemory]]:
        """Per group of devices that hold the very same parts, the memory of each stage they hold
        (interleaved plans hold several), in stage order, from each stage's samples per replica,
        local parameters and micro-batches in flight at its peak. The groups are the replicas' device
        groups, or single devices where two stages' replica groups overlap without being equal.

        Where every lane's stages share their tensor-parallel groups and the lanes share no device (every
        1F1B, GPipe and Megatron-interleaved plan), the groups are read lane by lane: each stage's memory
        once per distinct (samples, fused attention) of its groups, and groups whose stages all hold the
        same memories share one list (on 1024 GPUs a stage has hundreds of groups and a lane a dozen
        stages: what counting group by group, stage by stage cost)."""
        lanes = _lanes(plan)
        if _lane_aligned(plan, lanes):
            held: dict[tuple[int, ...], list[DeviceMemory]] = {}
            for _, members in lanes:
                per_stage = [self._group_memories(plan.stages[i], samples[i], params[i], in_flight[i])
                             for i in members]
                groups = plan.stages[members[0]].tp_groups
                if all(len(mems) == 1 for mems in per_stage):  # every group holds the same: one list for all
                    column = [mems[0] for mems in per_stage]
                    held.update(dict.fromkeys(groups, column))
                    continue
                shared: dict[tuple[int, ...], list[DeviceMemory]] = {}  # one list per distinct column
                for g, group in enumerate(groups):
                    column = [mems[g] if len(mems) > 1 else mems[0] for mems in per_stage]
                    held[group] = shared.setdefault(tuple(map(id, column)), column)
            return held
        placed: list[tuple[tuple[int, ...], DeviceMemory]] = []
        for i, stage in enumerate(plan.stages):
            mems = self._group_memories(stage, samples[i], params[i], in_flight[i])
            placed += zip(stage.tp_groups, mems * len(stage.tp_groups) if len(mems) == 1 else mems, strict=True)
        by_group: dict[tuple[int, ...], list[DeviceMemory]] = {}
        for devices, mem in placed:
            by_group.setdefault(devices, []).append(mem)
        if sum(map(len, by_group)) == len(set().union(*by_group)):  # the groups are disjoint
            return by_group
        by_device: dict[tuple[int, ...], list[DeviceMemory]] = {}
        for devices, mem in placed:
            for d in devices:
                by_device.setdefault((d,), []).append(mem)
        return by_device

    def _group_memories(self, stage: Stage, samples: tuple[float, ...], params: float,
                        in_flight: float) -> list[DeviceMemory]:
        """Per tensor-parallel group of `stage`, the memory one of its devices holds for it; replicas with equal
        shares and the same attention kernel share one `DeviceMemory`, and where every group does, the list
        holds that one alone."""
        uniform = self._uniform_memory(stage, samples, params, in_flight)
        if uniform is not None:
            return [uniform]
        fused_sample = self._activation_memory(stage)
        scores = self._score_memory(stage)
        unfused_sample = (fused_sample[0] + scores[0], fused_sample[1] + scores[1])
        memo: dict[tuple[float, bool], DeviceMemory] = {}
        out = []
        for g, devices in enumerate(stage.tp_groups):
            n = samples[g]
            fused = self._fused[devices[0]] or not (scores[0] or scores[1])
            mem = memo.get((n, fused))
            if mem is None:
                mem = memo[n, fused] = self._stage_memory(stage, params, n, fused_sample if fused else unfused_sample,
                                                          in_flight)
            out.append(mem)
        return out

    def _in_flight(self, plan: Plan, in_flight_counts: tuple[int, ...], lanes: int) -> list[float]:
        """Micro-batches whose activations each stage holds at its device's peak.

        One chunk per device: the stage's own maximum. Interleaved plans hold several chunks per
        device whose maxima fall at different times, so each chunk's count is scaled so that the
        sum over a device's chunks equals the true peak found by walking the lane's task order.
        """
        counts = [float(c) for c in in_flight_counts]
        if plan.schedule is not Schedule.INTERLEAVED_1F1B:
            return counts
        weight = [self._activation_memory(s)[0] for s in plan.stages]
        peaks = lane_peaks(len(plan.stages), plan.micro_batches, plan.schedule, lanes, weight)
        for lane, peak in enumerate(peaks):
            members = range(lane, len(plan.stages), lanes)
            naive = sum(weight[i] * counts[i] for i in members)
            if naive > 0:
                for i in members:
                    counts[i] *= peak / naive
        return counts

    def _activation_memory(self, stage: Stage) -> tuple[float, float]:
        """(saved bytes kept per in-flight micro-batch, working bytes) per sample on one device.

        Computed from the stage's unique blocks and counts (folding), not layer by layer.
        """
        key = (stage.layers, stage.tp, stage.recompute, stage.recompute_layers, sharding_key(stage.sharding))
        hit = self.coster.memory_memo.get(key)
        if hit is None:
            units = [(self.model.block_by_hash[h], n) for h, n in self.coster.units(stage)]
            blocks = [b for b, _ in units]
            replayed = self.coster.replayed_counts(stage)
            if stage.recompute:  # recomputed layers keep their input; the others (embeddings, heads) all they save
                inputs, kept = self.coster.kept_activations(stage)
                saved = inputs / stage.tp + sum(n * self._saved_of(b, stage) for b, n in kept)
            else:
                saved = sum(n * self._saved_of(b, stage) for b, n in units)
            if self.workload.keeps_stage_outputs and stage.layers != (0, len(self.model.layers)):
                saved += self._engine_buffer_bytes(stage) / stage.tp  # per micro-batch in flight
            # one recomputed layer's activations are live during its backward, kept as the runtime keeps them
            recomputing = max((self._saved_of(self.model.block_by_hash[h], stage) for h in replayed), default=0.0)
            working = recomputing + transient_bytes_per_sample(blocks, tp=stage.tp, loss=self.workload.loss)
            hit = self.coster.memory_memo[key] = (saved, working)
        return hit

    def _engine_buffer_bytes(self, stage: Stage) -> float:
        """Bytes per sample a pipeline engine that keeps stage outputs (`Workload.keeps_stage_outputs`, DeepSpeed's)
        holds for one micro-batch in flight beyond what the stage's ops save: the input it received (it runs the
        forward on a clone), except on the first stage, and the output it handed on. The last stage returns from
        its backward without freeing its buffer, so of its two it holds the previous micro-batch's logits as well
        as the current ones (1F1B: one in flight): the current ones are what an eager loss reads, but what a fused
        or in-place loss already keeps (Megatron-DeepSpeed's pipeline ends in an fp32 cast whose output the in-place
        loss's `.float()` returns as it is and turns into its softmax, then its gradient, so the previous one is
        that fp32 tensor); a traced head without a softmax loss keeps its own output."""
        first, end = stage.layers
        received = self.model.block_of(first - 1).output_bytes if first > 0 else 0.0
        block = self.model.block_of(end - 1)
        losses = [op for op in block.ops if is_loss(op, block)]
        if not losses:
            return received + block.output_bytes
        logits = fused_loss_saved_bytes(losses[0], block)  # as the head writes them
        if self.workload.loss is LossKernel.IN_PLACE:
            return received + losses[0].saved_bytes  # the previous micro-batch's fp32 tensor
        return received + logits * (2.0 if self.workload.loss is LossKernel.EAGER else 1.0)

    def _saved_of(self, block: Block, stage: Stage) -> float:
        """Bytes per sample one device of `stage` keeps of what `block` saves: split by the stage's
        per-op strategies where it overrides them, else 1/tp (tensor + sequence parallelism)."""
        if stage.sharding and stage.tp > 1:
            return self._saved_split(block, stage)
        return sum(self._op_saved_bytes(op, block) for op in block.ops) / stage.tp

    def _op_saved_bytes(self, op: Op, block: Block) -> float:
        """Bytes per sample `op` keeps for its backward in this workload's dtype. Under a quantized recipe,
        Transformer Engine keeps a GEMM's input as the cast copy it multiplied (fp8: 1 byte an element,
        not the bf16 2 the graph records; mxfp8 and nvfp4 with their block scales, as the columnwise
        copy the weight gradient reads); what other ops save stays in the elementwise dtype. Where the
        runtime fuses pointwise chains (`Workload.fused_activation`), a pointwise op does not keep an
        input that another pointwise op of the block made from inputs it keeps: the fused backward
        recomputes it (SwiGLU keeps gate and up, not silu(gate) as well). A fused loss (`Workload.loss`)
        keeps the 16-bit logits, not the fp32 softmax (the eager and in-place losses keep the softmax)."""
        dtype = self.workload.dtype
        if self.workload.loss is LossKernel.FUSED and is_loss(op, block):
            return fused_loss_saved_bytes(op, block)
        if op.kind is OpKind.MATMUL and dtype.quantized:
            return op.saved_bytes * dtype.gemm_nbytes / dtype.nbytes
        if self.workload.fused_activation and op.kind is OpKind.ELEMENTWISE and op.saved_bytes and op.inputs:
            recomputable = self._recomputable(block)
            dropped = sum(recomputable.get(src, 0.0) for src in dict.fromkeys(op.inputs))
            return max(op.saved_bytes - dropped, 0.0)
        return op.saved_bytes

    def _recomputable(self, block: Block) -> dict[str, float]:
        """The block's pointwise ops that keep their inputs, with their outputs' bytes per sample: a fused
        chain recomputes those outputs instead of keeping them."""
        hit = self.coster.recomputable_memo.get(block.hash)
        if hit is None:
            hit = self.coster.recomputable_memo[block.hash] = {
                op.name: op.bytes_written for op in block.ops if op.kind is OpKind.ELEMENTWISE and op.saved_bytes > 0}
        return hit

    def _score_memory(self, stage: Stage) -> tuple[float, float]:
        """(saved, working) bytes per sample on one device that attention without a fused kernel adds.

        Such attention keeps its softmax output, dropout mask and dropout output for the backward:
        2 + 1 + 2 bytes per score element at 16 bits (Korthikanti et al., "Reducing Activation
        Recomputation in Large Transformer Models", MLSys 2023: 5 a s^2 b per layer), divided among
        the tensor-parallel group's heads where the attention is split over them (a replicated one
        keeps all). A recomputed layer holds them only while it recomputes.
        """
        key = ("scores", stage.layers, stage.tp, stage.recompute, stage.recompute_layers, sharding_key(stage.sharding))
        hit = self.coster.memory_memo.get(key)
        if hit is None:
            per_element = 2.0 * self.workload.dtype.elementwise.nbytes + 1.0
            replayed, counts = self.coster.replayed_counts(stage), self.coster.block_counts(stage)
            kept = recomputing = 0.0
            for h, n in self.coster.units(stage):
                strategies = self.coster.sharded(h, stage.sharding).strategies
                per_layer = per_element * sum(op.score_elements / (stage.tp if divides(strategies[op.name]) else 1)
                                              for op in self.model.block_by_hash[h].ops)
                share = replayed[h] / counts[h] if h in replayed else 0.0  # of this block's layers, those recomputed
                kept += per_layer * n * (1.0 - share)
                recomputing = max(recomputing, per_layer if share else 0.0)
            hit = (kept, recomputing)
            self.coster.memory_memo[key] = hit
        return hit

    def _saved_split(self, block: Block, stage: Stage) -> float:
        """Saved bytes per sample of one block on one device: split ops keep 1/tp, replicated ones all."""
        strategies = self.coster.sharded(block.hash, stage.sharding).strategies
        return sum(self._op_saved_bytes(op, block) / (stage.tp if divides(strategies[op.name]) else 1)
                   for op in block.ops)

    def _stage_memory(self, stage: Stage, local_params: float, samples: float, per_sample: tuple[float, float],
                      in_flight: float) -> DeviceMemory:
        weights, grads, optim = model_state_bytes(local_params, self.workload, zero=stage.zero, dp=stage.dp_cp)
        saved, working = per_sample
        kept, replayed = self._cast_copies_bytes(stage)
        return DeviceMemory(weights, grads, optim, (saved * samples + kept) * in_flight + replayed, working * samples)

    def _cast_copies_bytes(self, stage: Stage) -> tuple[float, float]:
        """(bytes each micro-batch in flight keeps, bytes held once) of the 16-bit weight copies on a device of
        `stage` under an eager runtime's autocast over fp32 weights (`Workload.autocast`): each GEMM casts its
        weight once per micro-batch (autocast's cast cache) and the backward keeps that copy until it has run;
        a recomputed layer's backward keeps none (its forward saved nothing, its replay casts again), so its
        copies live only while a forward or a replay runs: once. (0, 0) for a runtime that keeps 16-bit weights
        (Megatron, DeepSpeed) or computes in fp32."""
        if not self.workload.autocast:
            return 0.0, 0.0
        nbytes = self.workload.dtype.nbytes
        if not stage.recompute:
            return self.coster.multiplied_params(stage) * nbytes, 0.0
        return (self.coster.multiplied_params(stage, recomputed=False) * nbytes,
                self.coster.multiplied_params(stage, recomputed=True) * nbytes)

    def _stage_report(self, plan: Plan, i: int, cost: StagePlanCost, pipe: PipelineResult,
                      memory: DeviceMemoryReport) -> StageReport:
        s = plan.stages[i]
        c = cost.critical
        return StageReport(index=i, layers=s.layers, dp=s.dp, tp=s.tp, cp=s.cp, forward_s=c.forward_s,
                           backward_s=c.backward_s, tp_comm_s=c.forward_tp_s + c.backward_tp_s,
                           dp_sync_s=sum(cost.dp_sync_s), p2p_s=cost.p2p_s, in_flight=pipe.max_in_flight[i],
                           samples_per_micro_batch=max(cost.samples) * s.cp, memory=memory,
                           compute_source=self.coster.compute_source(s, cost.samples[0]))


def attention_cluster(cluster: Cluster, fused: bool | None) -> Cluster:
    """`cluster` with every device's attention kernel set to `fused` (None: as each device has it); one copy
    per cluster object (`object_memo`), so that simulators of the same cluster share its link memos."""
    if fused is None or all(n.device.fused_attention is fused for n in cluster.nodes):
        return cluster
    memo = object_memo(cluster, "attention_cluster")
    copy = memo.get(fused)
    if copy is None:
        copy = memo[fused] = cluster.with_device_figures(fused_attention=fused)
    return copy


def _exposed_p2p_s(timings: list[StageTiming], micro_batches: int) -> float:
    """Seconds of pipeline sends the schedule cannot hide (the breakdown's `pp_comm`), in closed form.

    The first micro-batch's forward and the last one's backward cross every cut with nothing to
    overlap; in the steady state a cut whose send outlasts the work of the stages beside it adds
    the difference once per micro-batch. (The iteration time itself comes from the event simulation.)
    """
    fill = sum(t.send_forward_s for t in timings[:-1]) + sum(t.send_backward_s for t in timings[1:])
    steady = max((max(0.0, timings[i].send_forward_s + timings[i + 1].send_backward_s
                      - max(timings[i].forward_s + timings[i].backward_s,
                            timings[i + 1].forward_s + timings[i + 1].backward_s))
                  for i in range(len(timings) - 1)), default=0.0)
    return fill + max(micro_batches - 1, 0) * steady


def _disjoint_stages(plan: Plan) -> bool:
    """Whether no device holds two stages (each device's memory is one stage's)."""
    if len(plan.stages) == 1:
        return True
    return sum(len(s.devices) for s in plan.stages) == len(set().union(*(s.devices for s in plan.stages)))


def _lane_aligned(plan: Plan, lanes: list[tuple[tuple[int, ...], list[int]]]) -> bool:
    """Whether the stages of each lane share their tensor-parallel groups (one tp) and no two lanes share a
    device: each group then holds its lane's stages and nothing else."""
    if any(len({plan.stages[i].tp for i in members}) > 1 for _, members in lanes):
        return False
    return len(lanes) == 1 or sum(len(devices) for devices, _ in lanes) == len(set().union(*(d for d, _ in lanes)))


def _lanes(plan: Plan) -> list[tuple[tuple[int, ...], list[int]]]:
    """Distinct device groups in order (one lane each) and the stages each runs."""
    order: dict[tuple[int, ...], list[int]] = {}
    for i, stage in enumerate(plan.stages):
        order.setdefault(stage.devices, []).append(i)
    return list(order.items())


def _group_totals(held: dict[tuple[int, ...], list[DeviceMemory]]) -> dict[tuple[int, ...], float]:
    """Each group's peak bytes (`_total`). Replicas with equal shares hold the very same `DeviceMemory` objects
    (`Simulator._memory`), so each distinct list is totalled once: on 1024 GPUs a plan has hundreds of groups
    and a few distinct lists."""
    seen: dict[tuple[int, ...], float] = {}
    out: dict[tuple[int, ...], float] = {}
    for group, mems in held.items():
        key = tuple(map(id, mems))
        total = seen.get(key)
        if total is None:
            total = seen[key] = _total(mems)
        out[group] = total
    return out


def _total(mems: list[DeviceMemory]) -> float:
    """A device's peak bytes: model state and activations of all its stages, the largest transient."""
    return (sum(m.weights_bytes + m.gradients_bytes + m.optimizer_bytes + m.activations_bytes for m in mems)
            + max(m.transient_bytes for m in mems) + mems[0].overhead_bytes)


def _device_report(cluster: Cluster, device: int, mems: list[DeviceMemory]) -> DeviceMemoryReport:
    spec = cluster.devices[device].spec
    weights = sum(m.weights_bytes for m in mems)
    grads = sum(m.gradients_bytes for m in mems)
    optim = sum(m.optimizer_bytes for m in mems)
    acts = sum(m.activations_bytes for m in mems)
    other = max(m.transient_bytes for m in mems) + mems[0].overhead_bytes
    total = weights + grads + optim + acts + other
    return DeviceMemoryReport(
        device=device, type=spec.name, memory_bytes=total, mem_bytes=float(spec.mem_bytes),
        fits=total <= spec.mem_bytes, weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=optim,
        activations_bytes=acts, other_bytes=other)


def _check(plan: Plan, model: ModelGraph, cluster: Cluster, workload: Workload) -> None:
    try:
        check_plan(plan, model, cluster)
    except ValueError as exc:
        raise SpecError(f"plan: {exc}") from None
    if any(s.sharding for s in plan.stages) and (problem := sharding_problem(plan, model)) is not None:
        raise SpecError(f"plan: {problem}")
    for i, stage in enumerate(plan.stages):
        if stage.cp > 1 and workload.seq_len % stage.cp:  # each context-parallel rank holds whole tokens
            raise SpecError(f"plan: stages[{i}].cp = {stage.cp} does not divide the {workload.seq_len} tokens per "
                            f"sample; accepted: a cp that divides them (Megatron also needs 2 * cp to)")
    if plan.schedule is Schedule.INTERLEAVED_1F1B:
        groups = len({s.devices for s in plan.stages})
        if plan.micro_batches % groups:
            raise SpecError(f"plan: interleaved_1f1b needs micro_batches ({plan.micro_batches}) to be a multiple "
                            f"of the pipeline depth ({groups})")
    if workload.global_batch < plan.micro_batches:
        raise SpecError(f"plan: micro_batches={plan.micro_batches} exceeds the global batch {workload.global_batch}")
    try:
        check_whole_samples(plan, workload.global_batch)
    except ValueError as exc:
        raise SpecError(f"plan: {exc}") from None
