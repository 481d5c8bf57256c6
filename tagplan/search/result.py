"""What the planner returns: the best plan, the frontier, the baselines, and search statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tagplan.cost.report import Report
from tagplan.cost.simulator import Simulation
from tagplan.cost.timeline import chrome_trace
from tagplan.ir.plan import Plan
from tagplan.ir.workload import Workload
from tagplan.search.problem import Objective


@dataclass(frozen=True)
class Candidate:
    """A simulated plan and where it came from (search, a baseline, exhaustive)."""

    plan: Plan
    report: Report
    source: str = "search"
    corrected_time_s: float | None = None  # the learned correction's prediction, where it re-ranked this plan

    @property
    def objectives(self) -> tuple[float, float, float]:
        """(iteration seconds, peak bytes per device, GPUs used), all minimised."""
        return (self.report.iteration_time_s, self.report.peak_memory_bytes, float(self.report.devices_used))

    def to_json(self) -> dict[str, Any]:
        """`{plan, report, source}` as plain JSON values."""
        return {"plan": self.plan.model_dump(mode="json"), "report": self.report.model_dump(mode="json"),
                "source": self.source, "predicted_time_s": {"simulator": self.report.iteration_time_s,
                                                            "corrected": self.corrected_time_s}}


@dataclass(frozen=True)
class Predictor:
    """What predicted the times: the calibration, the GNN version whose correction re-ranked the
    final candidates (None: none did), and whether it applied."""

    calibration: str
    gnn: str | None = None
    correction_applied: bool = False


@dataclass(frozen=True)
class Baseline:
    """A baseline's simulated plan, or None with the reason it does not apply or fit."""

    name: str
    candidate: Candidate | None
    reason: str = ""
    config: str = ""  # the configuration, as a practitioner would write it


@dataclass(frozen=True)
class SearchInfo:
    """Search statistics."""

    wall_s: float
    evaluations: int
    cache_hits: int
    simulations: int
    stopped_by: str
    intra_solves: int = 0
    intra_cache_hits: int = 0
    baseline_evaluations: int = 0  # plans the baselines simulated before the search
    local_evaluations: int = 0  # of `evaluations`, those the hill climbing interleaved with MCTS asked for


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer; `simulation` is the best plan's, with the task times of its timeline."""

    best: Candidate
    pareto: tuple[Candidate, ...]
    baselines: dict[str, Baseline]
    search: SearchInfo
    simulation: Simulation
    cluster_devices: int
    predictor: Predictor
    objective: Objective = Objective.TIME
    notes: tuple[str, ...] = field(default=())
    workload: Workload | None = None  # as every plan was costed (`plan --exportable` may have filled it in)
    reduce_overlap: dict[int, bool] = field(default_factory=dict)  # the best plan's dp > 1 stages: overlapped?
    exporters: dict[str, str | None] = field(default_factory=dict)
    """Per export format, None when it runs the best plan, else why not; empty when nobody asked
    (the CLI and the service fill it in with `export.capability.verdicts`)."""
    pareto_exporters: tuple[dict[str, str | None], ...] = ()
    """The same for each plan of `pareto` (in its order); empty when nobody asked."""
    baseline_exporters: dict[str, dict[str, str | None]] = field(default_factory=dict)
    """The same for each baseline that has a plan, by name; empty when nobody asked."""

    @property
    def idle_devices(self) -> list[int]:
        """Devices of the cluster the best plan leaves idle (it may use a subset of the nodes)."""
        used = set(self.best.plan.devices)
        return [d for d in range(self.cluster_devices) if d not in used]

    def timeline(self) -> dict[str, Any]:
        """The best plan's iteration as a Chrome trace document (`cost.timeline.chrome_trace`)."""
        return chrome_trace(self.simulation)

    def to_json(self) -> dict[str, Any]:
        """`{best, pareto, baselines, baseline_reasons, search}` (the CLI's and service's contract)."""
        return {
            "objective": self.objective.value,
            "best": self.best.to_json(),
            "pareto": [_with_exporters(c.to_json(), e)
                       for c, e in zip(self.pareto, self.pareto_exporters or [None] * len(self.pareto), strict=True)],
            "baselines": {name: (_with_exporters(b.candidate.to_json(), self.baseline_exporters.get(name))
                                 if b.candidate else None) for name, b in self.baselines.items()},
            "baseline_reasons": {name: b.reason for name, b in self.baselines.items() if b.candidate is None},
            "baseline_configs": {name: b.config for name, b in self.baselines.items() if b.candidate is not None},
            "idle_devices": self.idle_devices,
            "predictor": vars(self.predictor),
            "search": vars(self.search),
            "notes": list(self.notes),
            "workload": self.workload.model_dump(mode="json") if self.workload is not None else None,
            "reduce_overlap": {str(i): hidden for i, hidden in self.reduce_overlap.items()},
            "exporters": dict(self.exporters),
        }


def _with_exporters(plan_json: dict[str, Any], exporters: dict[str, str | None] | None) -> dict[str, Any]:
    """A reported plan's JSON with its `exporters` verdicts (None for a format that runs it, else why not),
    where they were asked for."""
    return plan_json if exporters is None else {**plan_json, "exporters": dict(exporters)}
