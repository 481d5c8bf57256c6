"""The decision process: a state is a partial plan; each action fills one small decision.

Order of decisions: pipeline depth -> device groups of the stages -> tensor-parallel degree of
each stage (data parallel is the rest of its group) -> each layer boundary, among candidates
near the compute-balanced split for the stages' real speeds -> batch shares across unequal
replicas (even or by speed) -> micro-batches -> recomputation and ZeRO. Every action is legal
by construction, so every terminal state is a valid Plan.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import Any

from tagplan.cost.simulator import Simulator
from tagplan.ir.cluster import Cluster
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.search.groups import Partition, partitions, stage_counts, tp_options

MEMORY_OPTIONS: tuple[tuple[bool, int], ...] = ((False, 1), (False, 0), (False, 2), (False, 3), (True, 1), (True, 3))


@dataclass(frozen=True)
class PlanState:
    """A partial plan; None (or a short tuple) marks decisions not taken yet."""

    stages: int | None = None
    groups: Partition | None = None
    tps: tuple[int, ...] = ()
    bounds: tuple[int, ...] = ()  # end layer of each stage but the last
    balanced_shares: bool | None = None
    micro_batches: int | None = None
    chunks: int | None = None  # virtual pipeline chunks per device: 1 is 1F1B, more is interleaved 1F1B
    memory: tuple[bool, int] | None = None  # (recompute, ZeRO stage)
    nodes: int | None = None  # for the GPU objective: use only the first `nodes` nodes


@dataclass(frozen=True)
class Action:
    """One decision: which field it fills and the value."""

    field: str
    value: object


class PlanSpace:
    """The decision process over plans of one (model, cluster, workload) — an MCTS Environment."""

    def __init__(self, sim: Simulator, *, max_stages: int = 64, boundary_radius: int = 2,
                 subsets: bool = False) -> None:
        """`subsets=True` adds a first decision: how many of the cluster's nodes to use (GPU objective)."""
        self.sim = sim
        self.subsets = subsets
        self._clusters: dict[int, Cluster] = {}
        self.layers = len(sim.model.layers)
        self.max_stages = min(max_stages, self.layers, sim.cluster.num_devices)
        self.radius = boundary_radius
        self._speeds: dict[tuple[int, ...], float] = {}

    @cached_property
    def layer_flops(self) -> list[float]:
        """Forward FLOPs per sample of each layer (plus a small floor so empty layers still weigh)."""
        return [max(self.sim.model.block_of(i).flops, 1.0) for i in range(self.layers)]

    def cluster(self, state: PlanState) -> Cluster:
        """The cluster the plan may use: all of it, or its first `state.nodes` nodes (same device ids)."""
        if state.nodes is None or state.nodes == len(self.sim.cluster.nodes):
            return self.sim.cluster
        hit = self._clusters.get(state.nodes)
        if hit is None:
            hit = self._clusters[state.nodes] = self.sim.cluster.model_copy(
                update={"nodes": self.sim.cluster.nodes[: state.nodes]})
        return hit

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
        if self.subsets and state.nodes is None:
            n = len(self.sim.cluster.nodes)
            return [Action("nodes", k) for k in sorted({n, *(n // d for d in (2, 4, 8) if n // d >= 1)}, reverse=True)]
        cluster = self.cluster(state)
        if state.stages is None:
            return [Action("stages", s) for s in stage_counts(cluster, min(self.max_stages, cluster.num_devices))]
        if state.groups is None:
            return [Action("groups", g) for g in partitions(cluster, state.stages, self.sim.workload.dtype)]
        if len(state.tps) < state.stages:
            group = state.groups[len(state.tps)]
            return [Action("tps", t) for t in reversed(tp_options(self.sim.cluster, group))]
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
        """The default policy: take each remaining decision's first (most natural) candidate."""
        while not self.is_terminal(state):
            options = self.actions(state)
            if not options:
                raise RuntimeError(f"dead end in the decision process at {state}")
            state = self.step(state, self._default(state, options))
        return state

    def _default(self, state: PlanState, options: list[Action]) -> Action:
        if state.groups is not None and len(state.tps) < len(state.groups):
            return self._default_tp(state, options)
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
        """Layer cut after the balanced point for the stages' speeds, and its neighbours."""
        k = len(state.bounds)
        start = state.bounds[-1] if state.bounds else 0
        remaining = state.stages - k if state.stages else 1
        speeds = [self._speed(g) for g in (state.groups or ())[k:]]
        cum = self.cumulative_flops
        target = cum[start] + (cum[-1] - cum[start]) * speeds[0] / sum(speeds)
        i = min(bisect.bisect_left(cum, target), self.layers)  # first cut whose prefix reaches the target
        ideal = i if i > start and cum[i] - target < target - cum[i - 1] else max(i - 1, start + 1)
        low, high = start + 1, self.layers - (remaining - 1)
        cands = [min(max(ideal + d, low), high) for d in (0, 1, -1, 2, -2)[: 2 * self.radius + 1]]
        return list(dict.fromkeys(cands))

    def _speed(self, group: tuple[int, ...]) -> float:
        """Sum of the group's dense peaks (FLOP/s), memoised per group."""
        hit = self._speeds.get(group)
        if hit is None:
            hit = self._speeds[group] = sum(self.sim.cluster.devices[d].spec.peak_flops(self.sim.workload.dtype)
                                            for d in group)
        return hit

    def _unequal(self, state: PlanState) -> bool:
        for group, tp in zip(state.groups or (), state.tps, strict=False):
            names = {self.sim.cluster.devices[group[r * tp]].spec.name for r in range(len(group) // tp)}
            if len(names) > 1:
                return True
        return False

    def _micro_batch_candidates(self, state: PlanState) -> list[int]:
        """Micro-batch counts that split the batch evenly over every stage's replicas, near 4 x depth."""
        batch = self.sim.workload.global_batch
        dps = [len(g) // t for g, t in zip(state.groups or (), state.tps, strict=True)]
        valid = [m for m in range(1, batch + 1)
                 if batch % m == 0 and all((batch // m) % dp == 0 or state.balanced_shares for dp in dps)]
        if not valid:
            valid = [m for m in range(1, batch + 1) if batch % m == 0 and batch // m >= max(dps)] or [1]
        depth = state.stages or 1
        return sorted(valid, key=lambda m: (abs(m - 4 * depth) / (4 * depth), m))[:6]

    def to_plan(self, state: PlanState) -> Plan:
        """The Plan a terminal state describes."""
        assert state.groups is not None and state.micro_batches is not None and state.memory is not None
        recompute, zero = state.memory
        bounds = [0, *state.bounds, self.layers]
        chunks = state.chunks or 1
        meshes = []
        for group, tp in zip(state.groups, state.tps, strict=True):
            dp = len(group) // tp
            shares = self._shares(group, tp) if state.balanced_shares and dp > 1 else None
            meshes.append({"devices": group, "dp": dp, "tp": tp, "batch_shares": shares, "recompute": recompute,
                           "zero": zero if dp > 1 else 0})
        if chunks == 1:
            stages = tuple(Stage(layers=(bounds[i], bounds[i + 1]), **m) for i, m in enumerate(meshes))
            return Plan(micro_batches=state.micro_batches, schedule=Schedule.ONE_F_ONE_B, stages=stages)
        return Plan(micro_batches=state.micro_batches, schedule=Schedule.INTERLEAVED_1F1B,
                    stages=self._interleave(bounds, meshes, chunks))

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

    def _shares(self, group: tuple[int, ...], tp: int) -> tuple[float, ...] | None:
        speeds = [self._speed(group[r * tp:(r + 1) * tp]) for r in range(len(group) // tp)]
        if len(set(speeds)) == 1:
            return None
        return tuple(s / sum(speeds) for s in speeds)
