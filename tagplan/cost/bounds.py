"""The ideal iteration time and the scale-free value the planner and the GNN share.

T_lb is one iteration's training FLOPs (3x forward: backward costs twice the forward) over the
sum of every device's dense peak in the workload's dtype: no plan on this cluster can be faster.
A plan's value is T_lb / T, in (0, 1] for plans that fit; a plan that does not fit is worth
`INFEASIBLE_FACTOR` of that, so the search still prefers infeasible plans closer to fitting.
"""

from __future__ import annotations

from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import Workload

INFEASIBLE_FACTOR = 0.01


def lower_bound_s(model: ModelGraph, cluster: Cluster, workload: Workload) -> float:
    """T_lb in seconds: 3 * global batch * forward FLOPs per sample / sum of every device's peak."""
    peak = sum(d.spec.peak_flops(workload.dtype) for d in cluster.devices)
    return 3.0 * workload.global_batch * model.flops_per_sample / peak


def plan_value(lower_bound: float, iteration_time_s: float, *, fits: bool) -> float:
    """T_lb / T for a plan that fits, `INFEASIBLE_FACTOR` times that otherwise."""
    value = lower_bound / iteration_time_s
    return value if fits else value * INFEASIBLE_FACTOR
