"""The planner's answer under a calibration, as the fidelity benches report it (`--fit`: defaults against fitted)."""

from __future__ import annotations

from typing import Any

from tagplan.cost.calibration import Calibration
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import Workload


def planned(model: ModelGraph, cluster_spec: str, workload: Workload, calibration: Calibration) -> dict[str, Any]:
    """The planner's best plan (one process) under `calibration`: predicted seconds, source, plan JSON, summary."""
    from tagplan.search.planner import plan  # the planner loads only when a bench plans
    from tagplan.search.problem import PlanProblem

    best = plan(PlanProblem(model, load_cluster(cluster_spec), workload, calibration=calibration, workers=1)).best
    stages = best.plan.stages
    return {"predicted_s": best.report.iteration_time_s, "source": best.source, "plan": best.plan.to_json(),
            "configuration": f"{len(stages)} stages, tp {sorted({s.tp for s in stages})}, dp "
                             f"{sorted({s.dp for s in stages})}, ZeRO {sorted({s.zero for s in stages})}, "
                             f"{best.plan.micro_batches} micro-batches, {best.plan.schedule.value}"}
