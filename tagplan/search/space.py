"""The decision process: a state is a partial plan; each action fills one small decision.

Order of decisions: which nodes to use (all of them, the nodes of the fastest GPU types, or the fastest
half, quarter or eighth of those; a decision only where there is a choice) -> pipeline depth ->
device groups of the stages -> tensor-parallel degree of each stage -> the context-parallel degree
of the whole plan (from `LONG_CONTEXT_TOKENS`; data parallel is the rest of each group) -> each
layer boundary, among candidates near the compute-balanced split for the
stages' real speeds (or, where memory forbids that split under every option, near the nearest cut that can
fit: `search.capacity`) -> batch split across unequal replicas (even or by speed) -> micro-batches ->
recomputation and ZeRO.

Local structure (`neighbours`, `region`, for `search.polish`): the plans one decision away from a
plan, the later decisions kept where still legal; regions are the pipeline's shape (node set, depth).

Every action is legal by construction, so every terminal state is a valid Plan that can run:
every data-parallel replica gets a whole number of samples of every micro-batch, at least one
(`Stage.batch_samples` where the split is uneven); depths, groups and TP degrees that would leave
a replica without a sample are not offered.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import Any, cast

from tagplan.cost.memory import FRAMEWORK_OVERHEAD_BYTES, model_state_bytes
from tagplan.cost.simulator import Simulator
from tagplan.ir.cluster import Cluster
from tagplan.ir.plan import Plan, Schedule, Stage, context_split_whole
from tagplan.search.capacity import Capacity
from tagplan.search.groups import Partition, partitions, stage_counts, tp_options
from tagplan.search.recompute import fewest_recomputed

MEMORY_OPTIONS: tuple[tuple[bool, int], ...] = ((False, 1), (False, 0), (False, 2), (False, 3), (True, 1), (True, 3))

LONG_CONTEXT_TOKENS = 8192
"""Sequence length from which plans also try context parallelism (the search and the Megatron grid): Megatron-Bridge's
presets use it from 8k tokens (Llama 3 8B and 70B, Llama 3.1 405B at 8192), never at 2k-4k, where each rank's
attention chunk is too short to hide the ring."""

CONTEXT_DEGREES = (1, 2, 4, 8)
"""Context-parallel degrees a plan may take: powers of two up to 8, as the published long-context runs use."""


@dataclass(frozen=True)
class PlanState:
    """A partial plan; None (or a short tuple) marks decisions not taken yet."""

    stages: int | None = None
    groups: Partition | None = None
    tps: tuple[int, ...] = ()
    cp: int | None = None  # context-parallel degree of every stage (Megatron runs one for the whole model)
    bounds: tuple[int, ...] = ()  # end layer of each stage but the last
    balanced_shares: bool | None = None
    micro_batches: int | None = None
    chunks: int | None = None  # virtual pipeline chunks per device: 1 is 1F1B, more is interleaved 1F1B
    memory: tuple[bool, int] | None = None  # (recompute, ZeRO stage)
    nodes: tuple[int, ...] | None = None  # the nodes the plan may use (indices into the cluster's nodes)


@dataclass(frozen=True)
class Action:
    """One decision: which field it fills and the value."""

    field: str
    value: object


class PlanSpace:
    """The decision process over plans of one (model, cluster, workload) — an MCTS Environment."""

    def __init__(self, sim: Simulator, *, max_stages: int = 64, boundary_radius: int = 2) -> None:
        self.sim = sim
        self._subsets: dict[tuple[int, ...], tuple[Cluster, tuple[int, ...]]] = {}
        self._partitions: dict[tuple[tuple[int, ...], int], list[Partition]] = {}
        self._depths: dict[tuple[int, ...], list[int]] = {}
        self._shares: dict[tuple[tuple[int, ...], int, int, bool], tuple[int, ...] | None] = {}
        self._degrees: dict[tuple[int, ...], list[int]] = {}
        self.layers = len(sim.model.layers)
        self.max_stages = min(max_stages, self.layers, sim.cluster.num_devices)
        self.radius = boundary_radius
        self._speeds: dict[tuple[int, ...], float] = {}
        self._capacities: dict[tuple[Partition | None, tuple[int, ...], int | None], Capacity | None] = {}

    @cached_property
    def layer_flops(self) -> list[float]:
        """Forward FLOPs per sample of each layer (plus a small floor so empty layers still weigh)."""
        return [max(self.sim.model.block_of(i).flops, 1.0) for i in range(self.layers)]

    def on_every_node(self) -> PlanState:
        """The state with the node decision taken: every node (where the other decisions start)."""
        return PlanState(nodes=tuple(range(len(self.sim.cluster.nodes))))

    def subset(self, nodes: tuple[int, ...]) -> tuple[Cluster, tuple[int, ...]]:
        """The cluster of just `nodes` (in cluster order) and, per device of it, its id in the whole cluster."""
        hit = self._subsets.get(nodes)
        if hit is None:
            full = self.sim.cluster
            ids = tuple(d for n in nodes for d in full.node_devices(n))
            sub = full if len(nodes) == len(full.nodes) else full.model_copy(
                update={"nodes": tuple(full.nodes[n] for n in nodes)})
            hit = self._subsets[nodes] = (sub, ids)
        return hit

    @cached_property
    def node_subsets(self) -> list[tuple[int, ...]]:
        """Node sets a plan may use, most natural first; only those on which some plan gives whole samples
        (empty when none does: the batch is too small for any placement).

        Every node; the nodes of the k fastest GPU types (k = 1 .. types - 1: slow nodes can cost more
        than they add); then the fastest half, quarter and eighth of each of those sets (its fastest nodes,
        in cluster order among equals), where their memory holds the training state, last (under
        progressive widening the search reaches them after the natural sets): fewer nodes can be faster
        (a small model over a slow network) and use fewer GPUs (the GPU objective).
        """
        full = self.sim.cluster
        dtype = self.sim.workload.dtype
        speed = {n.device.name: n.device.sustained_peak_flops(dtype) for n in full.nodes}
        ranked = sorted(speed, key=lambda t: -speed[t])
        sets = [tuple(range(len(full.nodes)))]
        sets += [tuple(i for i, n in enumerate(full.nodes) if n.device.name in ranked[:k])
                 for k in range(1, len(ranked))]
        node_speed = [speed[n.device.name] for n in full.nodes]
        fastest_first = [sorted(s, key=lambda i: -node_speed[i]) for s in sets]
        halves = [tuple(sorted(s[: len(s) // d])) for s in fastest_first for d in (2, 4, 8) if len(s) // d >= 1]
        feasible = [s for s in dict.fromkeys(sets) if self._stage_counts(s)]
        feasible += [s for s in dict.fromkeys(halves)
                     if s not in feasible and self._holds_the_training_state(s) and self._stage_counts(s)]
        return feasible

    def _holds_the_training_state(self, nodes: tuple[int, ...]) -> bool:
        """Whether `nodes` have the memory for the model's weights, gradients and optimizer state sharded over
        every device (ZeRO-3) beside each device's framework overhead: a subset without it runs no plan, and is
        not offered."""
        cluster, _ = self.subset(nodes)
        state = sum(model_state_bytes(self.sim.model.params, self.sim.workload, zero=3, dp=1))
        overhead = FRAMEWORK_OVERHEAD_BYTES * cluster.num_devices
        return state + overhead <= sum(d.spec.mem_bytes for d in cluster.devices)

    def _stage_counts(self, nodes: tuple[int, ...]) -> list[int]:
        """Pipeline depths on `nodes` with at least one partition that gives every replica a sample (memoised)."""
        hit = self._depths.get(nodes)
        if hit is None:
            cluster, _ = self.subset(nodes)
            hit = self._depths[nodes] = [s for s in stage_counts(cluster, min(self.max_stages, cluster.num_devices))
                                         if self._feasible_partitions(nodes, s)]
        return hit

    def _feasible_partitions(self, nodes: tuple[int, ...], stages: int) -> list[Partition]:
        """Partitions of `nodes` into `stages` groups (whole-cluster device ids) in which every group can
        take a TP degree that leaves it at most `global_batch` replicas."""
        key = (nodes, stages)
        hit = self._partitions.get(key)
        if hit is None:
            cluster, ids = self.subset(nodes)
            batch = self.sim.workload.global_batch
            hit = []
            for part in partitions(cluster, stages, self.sim.workload.dtype):
                mapped = tuple(tuple(ids[d] for d in group) for group in part)
                if all(self._tps(group, batch) for group in mapped):
                    hit.append(mapped)
            self._partitions[key] = hit
        return hit

    def _tps(self, group: tuple[int, ...], batch: int) -> list[int]:
        """TP degrees for `group` that leave at most `batch` data-parallel replicas (each needs a sample)."""
        degrees = self._degrees.get(group)
        if degrees is None:
            degrees = self._degrees[group] = tp_options(self.sim.cluster, group)
        return [t for t in degrees if len(group) // t <= batch]

    def _chunk_candidates(self, state: PlanState) -> list[int]:
        """1 (plain 1F1B), and 2 chunks per device when every stage has 2+ layers and M fills the pipe."""
        stages = state.stages or 1
        bounds = [0, *state.bounds, self.layers]
        enough = all(bounds[i + 1] - bounds[i] >= 2 for i in range(stages))
        if stages > 1 and enough and state.micro_batches and state.micro_batches % stages == 0:
            return [1, 2]
        return [1]

    @cached_property
    def cumulative_flops(self) -> list[float]:
        """Prefix sums of `layer_flops` (cumulative[i] = FLOPs of layers 0..i-1)."""
        return [0.0, *accumulate(self.layer_flops)]

    def actions(self, state: PlanState) -> list[Action]:
        """Legal actions from `state`, most natural first; empty when the plan is complete."""
        if state.nodes is None:
            return [Action("nodes", n) for n in self.node_subsets]
        if state.stages is None:
            return [Action("stages", s) for s in self._stage_counts(state.nodes)]
        if state.groups is None:
            return [Action("groups", g) for g in self._feasible_partitions(state.nodes, state.stages)]
        if len(state.tps) < state.stages:
            group = state.groups[len(state.tps)]
            return [Action("tps", t) for t in reversed(self._tps(group, self.sim.workload.global_batch))]
        if state.cp is None:
            return [Action("cp", c) for c in self._cp_candidates(state)]
        if len(state.bounds) < state.stages - 1:
            return [Action("bounds", b) for b in self._boundary_candidates(state)]
        if state.balanced_shares is None:
            return [Action("balanced_shares", v) for v in ((True, False) if self._unequal(state) else (False,))]
        if state.micro_batches is None:
            return [Action("micro_batches", m) for m in self._micro_batch_candidates(state)]
        if state.chunks is None:
            return [Action("chunks", v) for v in self._chunk_candidates(state)]
        if state.memory is None:
            return [Action("memory", m) for m in MEMORY_OPTIONS]
        return []

    def step(self, state: PlanState, action: Action) -> PlanState:
        """The state with `action`'s decision filled in."""
        changes: dict[str, Any] = {action.field: action.value}
        if action.field in ("tps", "bounds"):
            changes[action.field] = (*getattr(state, action.field), action.value)
        return replace(state, **changes)

    def is_terminal(self, state: PlanState) -> bool:
        """Whether every decision is taken."""
        return state.memory is not None

    def complete(self, state: PlanState) -> PlanState:
        """The default policy: take each remaining decision's first (most natural) candidate; a
        stage's TP just large enough for its weights (`_default_tp`), and the first memory option
        whose plan fits (`_default_memory`): a rollout is a plan that runs wherever one of the
        options makes it fit."""
        while not self.is_terminal(state):
            options = self.actions(state)
            if not options:
                raise RuntimeError(f"dead end in the decision process at {state}")
            state = self.step(state, self._default(state, options))
        return state

    def decisions(self, state: PlanState) -> list[Action]:
        """The actions that lead from the root to the terminal `state`, in the order `actions` asks them."""
        head = [Action("nodes", state.nodes), Action("stages", state.stages), Action("groups", state.groups)]
        tail = [Action("balanced_shares", state.balanced_shares), Action("micro_batches", state.micro_batches),
                Action("chunks", state.chunks), Action("memory", state.memory)]
        return [*head, *(Action("tps", t) for t in state.tps), Action("cp", state.cp),
                *(Action("bounds", b) for b in state.bounds), *tail]

    def region(self, state: PlanState) -> tuple[object, ...]:
        """The pipeline's shape (node set, depth): plans of one shape are one local-search basin."""
        return (state.nodes, state.stages)

    def neighbours(self, state: PlanState) -> Iterator[PlanState]:
        """Terminal states whose plans are one decision away from the terminal `state`'s plan, later
        decisions first (`search.polish`'s neighbourhood).

        A neighbour takes another legal value for one decision (a node set, a depth, a partition, a
        stage's TP degree, a layer boundary, the batch split, the micro-batches, the chunks, the
        memory options) and keeps every later decision where it is still legal, else takes the legal
        value nearest to it, else the default policy's. A decision that does not change the plan (the
        batch split when every replica gets one sample anyway, ZeRO without data parallelism) is no
        step: the neighbours of every such encoding of the same plan follow. One state per distinct
        plan, never `state`'s plan; generated lazily, so a climb that moves early pays for few.
        """
        own = self.plan_key(state)
        seen, encodings = {own}, []
        for move in self._one_decision_away(state):
            key = self.plan_key(move)
            if key == own:
                encodings.append(move)
            elif key not in seen:
                seen.add(key)
                yield move
        for encoding in encodings:
            for move in self._one_decision_away(encoding):
                key = self.plan_key(move)
                if key not in seen:
                    seen.add(key)
                    yield move

    def plan_key(self, state: PlanState) -> tuple[object, ...]:
        """What `to_plan(state)` is made of, without building it: equal keys, equal plans."""
        assert state.groups is not None and state.micro_batches is not None and state.memory is not None
        recompute, zero = state.memory
        micro = self.sim.workload.global_batch // state.micro_batches
        cp = state.cp or 1
        meshes = tuple((group, tp, self._samples(group, tp * cp, micro, by_speed=bool(state.balanced_shares))
                        if len(group) > tp * cp else None, zero if len(group) > tp else 0)
                       for group, tp in zip(state.groups, state.tps, strict=True))
        return (meshes, cp, state.bounds, state.micro_batches, state.chunks or 1, recompute)

    def _one_decision_away(self, state: PlanState) -> Iterator[PlanState]:
        """The terminals that differ from `state` in one decision (the later ones kept or repaired),
        later decisions first; lazily."""
        path = self.decisions(state)
        prefixes = [PlanState()]
        for taken in path[:-1]:
            prefixes.append(self.step(prefixes[-1], taken))
        for prefix, taken in reversed(list(zip(prefixes, path, strict=True))):
            for other in self.actions(prefix):
                if other != taken:
                    yield self._follow(self.step(prefix, other), path)

    def _follow(self, state: PlanState, path: list[Action]) -> PlanState:
        """`state` completed by keeping `path`'s decisions: each the same value if legal, else the
        nearest legal number, else the default policy's choice."""
        wanted: dict[tuple[str, int], object] = {}
        seen: dict[str, int] = {}
        for action in path:
            seen[action.field] = seen.get(action.field, -1) + 1
            wanted[(action.field, seen[action.field])] = action.value
        while not self.is_terminal(state):
            options = self.actions(state)
            name = options[0].field
            index = len(getattr(state, name)) if name in ("tps", "bounds") else 0
            state = self.step(state, self._nearest(state, options, wanted.get((name, index))))
        return state

    def _nearest(self, state: PlanState, options: list[Action], value: object) -> Action:
        """The option equal to `value`, else the numerically nearest (ties: the most natural), else the default."""
        for option in options:
            if option.value == value:
                return option
        if isinstance(value, int) and not isinstance(value, bool):
            target = value
            return min(options, key=lambda o: abs(o.value - target) if isinstance(o.value, int) else math.inf)
        return self._default(state, options)

    def _default(self, state: PlanState, options: list[Action]) -> Action:
        if state.groups is not None and len(state.tps) < len(state.groups):
            return self._default_tp(state, options)
        if options[0].field == "memory":
            return self._default_memory(state, options)
        return options[0]

    def _default_memory(self, state: PlanState, options: list[Action]) -> Action:
        """The first memory option, in `MEMORY_OPTIONS` order (no recompute before recompute, ZeRO-1
        first), whose plan fits by the closed-form memory check (`Simulator.fits`, no timing); each
        distinct plan checked once (without data parallelism the ZeRO stages are one plan); the first
        option when none fits."""
        checked: set[tuple[object, ...]] = set()
        for option in options:
            candidate = replace(state, memory=cast(tuple[bool, int], option.value))
            key = self.plan_key(candidate)
            if key not in checked:
                checked.add(key)
                if self.sim.fits(self.to_plan(candidate)):
                    return option
        return options[0]

    def _default_tp(self, state: PlanState, options: list[Action]) -> Action:
        """The smallest TP whose weights and optimizer state take under half a device (ZeRO-1)."""
        group = state.groups[len(state.tps)] if state.groups else ()
        share = self.sim.model.params / max(state.stages or 1, 1)
        memory = min(self.sim.cluster.devices[d].spec.mem_bytes for d in group)
        for action in reversed(options):  # options are largest-first
            tp = int(str(action.value))
            dp = len(group) // tp
            if share / tp * (4 + 12 / dp) < 0.5 * memory:
                return action
        return options[0]

    def _boundary_candidates(self, state: PlanState) -> list[int]:
        """Layer cut after the balanced point for the stages' speeds, and its neighbours; where memory forbids
        that point under every memory option, the nearest cut that can fit and its neighbours (`Capacity`)."""
        k = len(state.bounds)
        start = state.bounds[-1] if state.bounds else 0
        remaining = state.stages - k if state.stages else 1
        ideal = self._balanced_cut(start, [self._speed(g) for g in (state.groups or ())[k:]])
        low, high = start + 1, self.layers - (remaining - 1)
        capacity = self._capacity(state)
        if capacity is not None:
            floor, cap = max(low, capacity.floor(k)), min(high, capacity.cap(k, start))
            if floor <= cap:
                low, high = floor, cap
                ideal = min(max(ideal, low), high)
        cands = [min(max(ideal + d, low), high) for d in (0, 1, -1, 2, -2)[: 2 * self.radius + 1]]
        return list(dict.fromkeys(cands))

    def _balanced_cut(self, start: int, speeds: list[float]) -> int:
        """The end of the stage from layer `start` that gives it its speed's share of the remaining FLOPs."""
        cum = self.cumulative_flops
        target = cum[start] + (cum[-1] - cum[start]) * speeds[0] / sum(speeds)
        i = min(bisect.bisect_left(cum, target), self.layers)  # first cut whose prefix reaches the target
        return i if i > start and cum[i] - target < target - cum[i - 1] else max(i - 1, start + 1)

    def _capacity(self, state: PlanState) -> Capacity | None:
        """The memory limits of the state's pipeline shape where they bind (`Capacity`), else None; memoised."""
        key = (state.groups, state.tps, state.cp)
        if key not in self._capacities:
            groups = state.groups or ()
            speeds = [self._speed(g) for g in groups]
            cuts: list[int] = []
            for k in range(len(groups) - 1):
                start = cuts[-1] if cuts else 0
                cut = self._balanced_cut(start, speeds[k:])
                cuts.append(min(max(cut, start + 1), self.layers - (len(groups) - 1 - k)))
            capacity = None
            if len(groups) > 1:
                capacity = Capacity(self.sim, groups, state.tps, state.cp or 1, balanced_bounds=cuts,
                                    micro_batches=max(self._micro_batch_counts(state)), splits=self._sample_splits)
            self._capacities[key] = capacity if capacity is not None and capacity.binding else None
        return self._capacities[key]

    def _sample_splits(self, group: tuple[int, ...], width: int, micro: int) -> set[tuple[int, ...] | None]:
        """The splits of a `micro`-sample micro-batch over `group`'s replicas (`width` devices each) a stage may take:
        even, or by speed (the same where the replicas are alike)."""
        return {self._samples(group, width, micro, by_speed=False), self._samples(group, width, micro, by_speed=True)}

    def _speed(self, group: tuple[int, ...]) -> float:
        """Sum of the group's dense peaks (FLOP/s), memoised per group."""
        hit = self._speeds.get(group)
        if hit is None:
            dtype = self.sim.workload.dtype
            hit = self._speeds[group] = sum(self.sim.cluster.devices[d].spec.sustained_peak_flops(dtype)
                                            for d in group)
        return hit

    def _cp_candidates(self, state: PlanState) -> list[int]:
        """1, and from `LONG_CONTEXT_TOKENS` each degree in `CONTEXT_DEGREES` that divides every stage's
        replicas of its TP degree and splits the sequence whole for it (`context_split_whole`)."""
        seq = self.sim.workload.seq_len
        if seq < LONG_CONTEXT_TOKENS:
            return [1]
        return [c for c in CONTEXT_DEGREES if all((len(g) // t) % c == 0 and context_split_whole(seq, c, t)
                                                  for g, t in zip(state.groups or (), state.tps, strict=True))]

    def _unequal(self, state: PlanState) -> bool:
        width = state.cp or 1
        for group, tp in zip(state.groups or (), state.tps, strict=False):
            names = {self.sim.cluster.devices[group[r * tp * width]].spec.name
                     for r in range(len(group) // (tp * width))}
            if len(names) > 1:
                return True
        return False

    def _micro_batch_candidates(self, state: PlanState) -> list[int]:
        """Micro-batch counts M dividing the batch whose micro-batches give every replica a sample, near
        4 x depth; without a by-speed split, counts that split every stage evenly come first."""
        batch = self.sim.workload.global_batch
        dps = [len(g) // (t * (state.cp or 1)) for g, t in zip(state.groups or (), state.tps, strict=True)]
        valid = self._micro_batch_counts(state)
        depth = state.stages or 1

        def order(m: int) -> tuple[bool, float, int]:
            uneven = not state.balanced_shares and any((batch // m) % dp for dp in dps)
            return (uneven, abs(m - 4 * depth) / (4 * depth), m)

        return sorted(valid, key=order)[:6]

    def _micro_batch_counts(self, state: PlanState) -> list[int]:
        """Micro-batch counts M dividing the batch whose micro-batches give every replica of the state's stages a
        sample (a replica's samples are split by sequence over its context-parallel ranks)."""
        batch = self.sim.workload.global_batch
        dps = [len(g) // (t * (state.cp or 1)) for g, t in zip(state.groups or (), state.tps, strict=True)]
        return [m for m in divisors(batch) if batch // m >= max(dps)]

    def to_plan(self, state: PlanState) -> Plan:
        """The Plan a terminal state describes."""
        assert state.groups is not None and state.micro_batches is not None and state.memory is not None
        recompute, zero = state.memory
        bounds = [0, *state.bounds, self.layers]
        chunks = state.chunks or 1
        meshes = []
        micro = self.sim.workload.global_batch // state.micro_batches
        cp = state.cp or 1
        for group, tp in zip(state.groups, state.tps, strict=True):
            dp = len(group) // (tp * cp)
            samples = self._samples(group, tp * cp, micro, by_speed=bool(state.balanced_shares)) if dp > 1 else None
            meshes.append({"devices": group, "dp": dp, "cp": cp, "tp": tp, "batch_samples": samples,
                           "recompute": recompute, "zero": zero if dp * cp > 1 else 0})
        if chunks == 1:
            stages = tuple(Stage(layers=(bounds[i], bounds[i + 1]), **m) for i, m in enumerate(meshes))
            plan = Plan(micro_batches=state.micro_batches, schedule=Schedule.ONE_F_ONE_B, stages=stages)
        else:
            plan = Plan(micro_batches=state.micro_batches, schedule=Schedule.INTERLEAVED_1F1B,
                        stages=self._interleave(bounds, meshes, chunks))
        # each stage recomputes only what its memory needs
        return fewest_recomputed(self.sim, plan, per_stage=True) if recompute else plan

    def _interleave(self, bounds: list[int], meshes: list[dict[str, Any]], chunks: int) -> tuple[Stage, ...]:
        """Each device group's layers cut into `chunks` parts, laid out round-robin (Megatron's virtual stages)."""
        sizes = [[(bounds[s + 1] - bounds[s]) * (c + 1) // chunks - (bounds[s + 1] - bounds[s]) * c // chunks
                  for c in range(chunks)] for s in range(len(meshes))]
        stages, start = [], 0
        for c in range(chunks):
            for s, mesh in enumerate(meshes):
                stages.append(Stage(layers=(start, start + sizes[s][c]), **mesh))
                start += sizes[s][c]
        return tuple(stages)

    def _samples(self, group: tuple[int, ...], tp: int, micro: int, *, by_speed: bool) -> tuple[int, ...] | None:
        """Whole samples per replica (`tp` consecutive devices: a replica's tp x cp) of a `micro`-sample
        micro-batch: in proportion to the replicas' speeds (`by_speed`), else as even as whole samples
        allow; None when that is the exact even split (so a by-speed split that comes out even is the
        same plan as the even one). Memoised."""
        key = (group, tp, micro, by_speed)
        if key not in self._shares:
            self._shares[key] = self._split(group, tp, micro, by_speed=by_speed)
        return self._shares[key]

    def _split(self, group: tuple[int, ...], tp: int, micro: int, *, by_speed: bool) -> tuple[int, ...] | None:
        dp = len(group) // tp
        even = apportion(micro, [1.0] * dp)
        shares = apportion(micro, [self._speed(group[r * tp:(r + 1) * tp]) for r in range(dp)]) if by_speed else even
        return None if shares == even and micro % dp == 0 else shares


def apportion(total: int, weights: list[float]) -> tuple[int, ...]:
    """`total` whole units over `len(weights)` parts, at least 1 each, in proportion to the weights
    (largest remainder). Needs total >= len(weights)."""
    spare, weight = total - len(weights), sum(weights)
    exact = [spare * w / weight for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: spare - sum(counts)]:
        counts[i] += 1
    return tuple(1 + c for c in counts)


def divisors(n: int) -> list[int]:
    """The divisors of `n` in increasing order (trial division to sqrt(n), never a walk to n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
