"""The ideal iteration time and the scale-free value the planner and the GNN share.

T_lb is one iteration's training FLOPs (3x forward: backward costs twice the forward) over the
sum of every device's dense peak in the workload's dtype: no plan on this cluster can be faster.
A plan's value is T_lb / T, in (0, 1] for plans that fit; a plan that does not fit is worth
`INFEASIBLE_FACTOR` of that, so the search still prefers infeasible plans closer to fitting.
"""

from __future__ import annotations

from collections.abc import Sequence

from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph, OpKind
from tagplan.ir.workload import Workload

INFEASIBLE_FACTOR = 0.01


def lower_bound_s(model: ModelGraph, cluster: Cluster, workload: Workload, *, devices: Sequence[int] | None = None,
                  matmuls_only: bool = False) -> float:
    """T_lb in seconds: 3 * global batch * forward FLOPs per sample / sum of every device's peak. `devices`: those
    of a plan only; `matmuls_only`: the matrix multiplications' FLOPs only, a bound no run beats whatever its
    attention kernel skips (the graph counts a causal attention's FLOPs over every key)."""
    chosen = cluster.devices if devices is None else [cluster.devices[d] for d in devices]
    peak = sum(d.spec.peak_flops(workload.dtype) for d in chosen)
    if matmuls_only:
        per_block = {b.hash: sum(op.flops for op in b.ops if op.kind is OpKind.MATMUL) for b in model.blocks}
        flops = sum(per_block[layer.block] for layer in model.layers)
    else:
        flops = model.flops_per_sample
    return 3.0 * workload.global_batch * flops / peak


def plan_value(lower_bound: float, iteration_time_s: float, *, fits: bool) -> float:
    """T_lb / T for a plan that fits, `INFEASIBLE_FACTOR` times that otherwise."""
    value = lower_bound / iteration_time_s
    return value if fits else value * INFEASIBLE_FACTOR
