"""Baseline plans as constructors: pure data parallel, and the Megatron-LM heuristic.

They are what users run today; the planner reports them beside its own plan. Each returns a
`BaselinePlan` with the plan, or `plan=None` and the reason it does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass

from tagplan.cost.simulator import Simulator
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Schedule, Stage

MAX_TP = 8  # Megatron keeps tensor parallelism inside a node, up to 8 GPUs


@dataclass(frozen=True)
class BaselinePlan:
    """A baseline plan, or None with the reason it does not apply or does not fit."""

    name: str
    plan: Plan | None
    reason: str = ""


def data_parallel(sim: Simulator) -> BaselinePlan:
    """Every device a replica of the whole model, with the least ZeRO stage that fits (0-3).

    The batch is split evenly; gradient accumulation (micro-batches) is used only when one
    replica's share does not fit at any ZeRO stage.
    """
    n = sim.cluster.num_devices
    batch = sim.workload.global_batch
    if batch % n:
        return BaselinePlan("data_parallel", None, f"global batch {batch} does not split into whole samples over "
                                                   f"the {n} devices")
    devices = tuple(range(n))
    plan: Plan | None = None
    for micro in _divisors(batch // n):  # micro-batch counts: each holds a multiple of n samples
        for zero in range(4):
            stage = Stage(layers=(0, len(sim.model.layers)), devices=devices, dp=n, tp=1, zero=zero)
            plan = Plan(micro_batches=micro, schedule=Schedule.ONE_F_ONE_B, stages=(stage,))
            if sim.simulate(plan).fits:
                return BaselinePlan("data_parallel", plan)
    return BaselinePlan("data_parallel", None, "does not fit in memory at any ZeRO stage or micro-batch count")


def megatron(sim: Simulator) -> BaselinePlan:
    """Megatron-LM as its users configure it.

    TP = the node's GPU count up to 8 (the smallest node's, on mixed clusters); PP = the fewest
    node groups for which the model fits, layers split evenly with the embedding on the first
    stage and the head on the last; DP = the rest; 1F1B; ZeRO-1 (distributed optimizer) when
    DP > 1. Micro-batch size 1, as the Megatron-LM GPT examples set it (the most micro-batches,
    the smallest bubble and activation footprint); the rest of a replica's share is gradient
    accumulation.
    """
    cluster = sim.cluster
    if len({node.gpus for node in cluster.nodes}) > 1:
        return BaselinePlan("megatron", None, "nodes differ in GPU count; Megatron-LM needs equal nodes")
    per_node = cluster.nodes[0].gpus
    tp = max(t for t in (1, 2, 4, 8) if t <= min(per_node, MAX_TP) and per_node % t == 0)
    nodes = len(cluster.nodes)
    last_reason = "no configuration fits in memory"
    for pp, degree in [(p, tp) for p in range(1, nodes + 1) if nodes % p == 0] + _intra_node_pp(nodes, per_node, tp):
        result = megatron_plan(sim, tp=degree, pp=pp)
        if result.plan is not None:
            return result
        last_reason = result.reason
    return BaselinePlan("megatron", None, last_reason)


def megatron_plan(sim: Simulator, *, tp: int, pp: int) -> BaselinePlan:
    """Megatron's plan for given TP and PP degrees (DP is the rest): even layer split, 1F1B, ZeRO-1
    when DP > 1, micro-batch size by the users' rule. `plan=None` if it cannot apply or fit."""
    n = sim.cluster.num_devices
    if n % (tp * pp):
        return BaselinePlan("megatron", None, f"{n} devices are not divisible by tp * pp = {tp} * {pp}")
    stages = _megatron_stages(sim.model, n, tp, pp)
    if isinstance(stages, str):
        return BaselinePlan("megatron", None, stages)
    plan = _megatron_micro_batches(sim, stages)
    if plan is None:
        return BaselinePlan("megatron", None, f"tp={tp}, pp={pp}: the batch does not divide or the plan does not fit")
    return BaselinePlan("megatron", plan)


def _intra_node_pp(nodes: int, per_node: int, tp: int) -> list[tuple[int, int]]:
    """(pp, tp) for deeper pipelines that split each node into k stages of per_node / k devices."""
    return [(nodes * k, min(tp, per_node // k)) for k in (2, 4, 8) if per_node % k == 0 and per_node // k >= 1]


def _megatron_stages(model: ModelGraph, devices: int, tp: int, pp: int) -> list[Stage] | str:
    blocks = len(model.layers) - 2
    if blocks < pp:
        return f"{blocks} transformer layers cannot fill {pp} pipeline stages"
    per_stage_devices = devices // pp
    dp = per_stage_devices // tp
    bounds = [1 + (blocks * s) // pp for s in range(pp + 1)]
    bounds[0], bounds[-1] = 0, len(model.layers)
    return [Stage(layers=(bounds[s], bounds[s + 1]), devices=tuple(range(s * per_stage_devices,
                                                                         (s + 1) * per_stage_devices)),
                  dp=dp, tp=tp, zero=1 if dp > 1 else 0) for s in range(pp)]


def _megatron_micro_batches(sim: Simulator, stages: list[Stage]) -> Plan | None:
    dp = stages[0].dp
    batch = sim.workload.global_batch
    if batch % dp:
        return None
    plan = Plan(micro_batches=batch // dp, schedule=Schedule.ONE_F_ONE_B, stages=tuple(stages))
    return plan if sim.simulate(plan).fits else None


def _divisors(n: int) -> list[int]:
    """Divisors of `n` in increasing order (micro-batch counts that split a share evenly)."""
    return [m for m in range(1, n + 1) if n % m == 0]
