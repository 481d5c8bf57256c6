"""A plan job: a stored `PlanRequest` -> one `PlanProblem` -> `search.planner.plan` -> the result JSON.

The request is read with the model the API validated it with and its limits checked again (the
worker's settings may be stricter). Then the model and the cluster are built, once each, here
and never in the API process; the planner runs once, and the timeline is the best plan's
simulation the planner already recorded (`PlanResult.timeline()`), not a second simulation.
"""

from __future__ import annotations

import time
from typing import Any

from tagplan.cost.calibration import Calibration
from tagplan.errors import SpecError
from tagplan.export.capability import with_verdicts
from tagplan.frontends import cluster_spec, model_spec
from tagplan.frontends.cluster_file import parse_cluster_data
from tagplan.frontends.cluster_spec import ClusterSpec
from tagplan.frontends.json_graph import graph_from_dict
from tagplan.frontends.model_spec import ModelSpec
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.summary import cluster_summary
from tagplan.ir.workload import DType, LossKernel, Workload, eager_fields, eager_runtime
from tagplan.search.planner import plan
from tagplan.search.problem import (
    DEFAULT_BUDGET_S,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MAX_EVALUATIONS,
    Objective,
    PlanProblem,
)
from tagplan.search.result import PlanResult
from tagplan.service.jobs import Progress
from tagplan.service.requests import (
    LimitError,
    PlanRequest,
    WorkloadRequest,
    calibration_of,
    check_limits,
    gnn_version,
    read_request,
    tenant_registry,
)
from tagplan.service.settings import Settings
from tagplan.training.registry import correction, prior_factory


def run_plan(data: Any, settings: Settings, progress: Progress, *, tenant_id: int | None = None) -> dict[str, Any]:
    """The planner's JSON for a stored plan request, plus `timeline`, `request` (every default
    filled in), `cluster` (the web view's stage map) and `gnn` (the GNN version the search used:
    the tenant's active one, else the service's); `exporters` says which export formats run the
    best plan and why the others do not. SpecError for a bad request."""
    request = read_request(PlanRequest, data, "plan request")
    check_limits(request, settings)
    calibration = calibration_of(request.calibration, settings)
    progress(0.0, "building the model and the cluster")
    problem = plan_problem(request, settings, calibration)
    start = time.monotonic()

    def tick(done: int, total: int) -> None:
        # The search stops at its evaluation count or its budget, whichever comes first.
        elapsed = (time.monotonic() - start) / problem.budget_s
        progress(min(0.99, max(done / max(total, 1), elapsed)), f"evaluations {done}/{total}")

    registry = tenant_registry(settings, tenant_id)
    factory = prior_factory(problem.scorer, registry, problem.cluster.num_devices,
                            heterogeneous=len({d.spec.name for d in problem.cluster.devices}) > 1)
    fix = correction(registry, problem.model, problem.cluster, problem.workload, calibration=problem.calibration)
    result = plan(problem, prior_factory=factory, progress=tick, correction=fix)
    result = with_exporters(request, problem, result)
    progress(0.99, "writing the result")
    return {**result.to_json(), "timeline": result.timeline(), "request": echo(request, problem),
            "cluster": cluster_summary(problem.cluster, dtype=problem.workload.dtype), "gnn": gnn_version(registry)}


INLINE_GRAPH_REFUSAL = ("torch: the program builds the model from its SPEC (a zoo name, FAMILY?key=value or "
                        "hf:...); an inline graph has none")


def with_exporters(request: PlanRequest, problem: PlanProblem, result: PlanResult) -> PlanResult:
    """`result` with the export formats that run each plan it reports (`export.capability.with_verdicts`); an
    inline graph names no model the torch program could build, so torch refuses it whatever the graph's
    family says."""
    if isinstance(request.model, ModelSpec):
        return with_verdicts(result, problem.model, problem.workload, spec=request.model, cluster=problem.cluster,
                             calibration=problem.calibration)
    return with_verdicts(result, problem.model, problem.workload, cluster=problem.cluster,
                         refusals={"torch": INLINE_GRAPH_REFUSAL}, calibration=problem.calibration)


def plan_problem(request: PlanRequest, settings: Settings, calibration: Calibration) -> PlanProblem:
    """The problem a request describes: its model and cluster built (once each), every default filled in."""
    asked = request.workload or WorkloadRequest()
    dtype = asked.dtype or DType.BF16
    model = build_model(request.model, asked.seq_len, dtype)
    cluster = build(request.cluster)
    if cluster.num_devices > settings.max_devices:  # the request's count said otherwise: refuse all the same
        raise LimitError(f"cluster: {cluster.num_devices} devices is over this service's limit of "
                         f"{settings.max_devices} (TAGPLAN_MAX_DEVICES)", limit="max_devices")
    workload = Workload(global_batch=asked.global_batch or DEFAULT_GLOBAL_BATCH, seq_len=model.seq_len, dtype=dtype,
                        grad_reduce_dtype=asked.grad_reduce_dtype,
                        grad_reduce_overlap=asked.grad_reduce_overlap is not False,
                        tp_comm_overlap=asked.tp_comm_overlap is True, fused_attention=asked.fused_attention,
                        loss=asked.loss or LossKernel.EAGER, **eager_fields(asked.eager),
                        **({"optimizer": asked.optimizer} if asked.optimizer is not None else {}))
    return PlanProblem(
        model=model, cluster=cluster, workload=workload, objective=request.objective or Objective.TIME,
        budget_s=request.budget_s if request.budget_s is not None else min(DEFAULT_BUDGET_S, settings.max_budget_s),
        max_evaluations=request.max_evaluations if request.max_evaluations is not None
        else min(DEFAULT_MAX_EVALUATIONS, settings.max_evaluations),
        seed=request.seed or 0, time_bound_s=request.time_bound_s, calibration=calibration)


def build_model(model: ModelSpec | dict[str, Any], seq_len: int | None, dtype: DType) -> ModelGraph:
    """The ModelGraph of a request's model: a parsed SPEC built, or an inline graph read."""
    if isinstance(model, ModelSpec):
        return model_spec.build_model(model, seq_len=seq_len, dtype=dtype)
    graph = graph_from_dict(dict(model), "model")
    if seq_len is not None and seq_len != graph.seq_len:
        raise SpecError(f"workload.seq_len: the inline graph is fixed at seq_len={graph.seq_len}; got {seq_len}")
    return graph


def build(cluster: ClusterSpec | dict[str, Any]) -> Cluster:
    """The Cluster of a request's cluster: a parsed SPEC built, or an inline cluster file read."""
    if isinstance(cluster, ClusterSpec):
        return cluster_spec.build_cluster(cluster)
    return parse_cluster_data(dict(cluster))


def echo(request: PlanRequest, problem: PlanProblem) -> dict[str, Any]:
    """The request as planned: the same PlanRequest with every default the problem took filled in."""
    w = problem.workload
    filled = request.model_copy(update={
        "workload": WorkloadRequest(global_batch=w.global_batch, seq_len=w.seq_len, dtype=w.dtype,
                                    optimizer=w.optimizer,
                                    grad_reduce_dtype=w.grad_reduce_dtype or w.dtype.elementwise,
                                    grad_reduce_overlap=w.grad_reduce_overlap, tp_comm_overlap=w.tp_comm_overlap,
                                    fused_attention=w.fused_attention, loss=w.loss, eager=eager_runtime(w)),
        "objective": problem.objective, "budget_s": problem.budget_s, "max_evaluations": problem.max_evaluations,
        "seed": problem.seed, "time_bound_s": problem.time_bound_s})
    return filled.model_dump(mode="json")

