"""What the planner is asked: one `PlanProblem`, its defaults written once.

The CLI, the service and the benchmarks build a `PlanProblem` and call `search.planner.plan`.
Everything is built already (ModelGraph, Cluster, Calibration): the problem carries no SPEC
strings and no file paths, so the planner reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.comm import CommMode
from tagplan.errors import SpecError
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DEFAULT_GLOBAL_BATCH, Workload

DEFAULT_BUDGET_S = 30.0
DEFAULT_MAX_EVALUATIONS = 400
WORKERS = (1, 2, 3)
"""The planner's process counts: one; the baselines in a second process beside the search; or in two."""

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MAX_EVALUATIONS", "WORKERS", "Objective", "PlanProblem",
           "Scorer"]


class Objective(StrEnum):
    """What "best" means."""

    TIME = "time"  # minimise iteration time among plans that fit
    MEMORY = "memory"  # minimise peak memory per device, within the time bound
    GPUS = "gpus"  # minimise GPUs used, within the time bound


class Scorer(StrEnum):
    """What guides the search (plans are always ranked by the simulator)."""

    AUTO = "auto"  # the GNN prior where its checkpoint's card records that guidance pays for the problem's class
    GNN = "gnn"  # the GNN prior; an error without a checkpoint
    SIMULATOR = "simulator"  # a uniform prior


@dataclass(frozen=True)
class PlanProblem:
    """A planning problem: what to plan, for what, and how long to search.

    `budget_s`: wall-clock seconds of the search; `max_evaluations`: plans simulated at most;
    `time_bound_s`: for the memory and GPU objectives, the slowest acceptable iteration
    (default 1.25 x the fastest found); `exhaustive_limit`: also enumerate the whole space when
    it holds at most this many plans (0: never); `fold=False` costs every layer on its own (an
    ablation); `comm_mode`: `BYTES_ONLY` ignores the topology (an ablation). `workers`: the processes the
    planner runs at once: 1; 2 to run the practitioner baselines in a forked process beside the search; 3 to
    split them over two (`search.background`: the same plans judged, the same answer, sooner where cores are
    free).
    """

    model: ModelGraph
    cluster: Cluster
    workload: Workload
    objective: Objective = Objective.TIME
    budget_s: float = DEFAULT_BUDGET_S
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS
    seed: int = 0
    time_bound_s: float | None = None
    calibration: Calibration = field(default=DEFAULT_CALIBRATION)
    scorer: Scorer = Scorer.AUTO
    comm_mode: CommMode = CommMode.TOPOLOGY
    exhaustive_limit: int = 0
    fold: bool = True
    workers: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or self.workers not in WORKERS:
            raise SpecError(f"workers={self.workers!r}: must be 1 (one process), 2 (the baselines in a second "
                            "process beside the search) or 3 (the baseline families in two)")
        if not self.budget_s > 0:
            raise SpecError(f"budget_s={self.budget_s}: must be a positive number of seconds")
        if self.max_evaluations < 1:
            raise SpecError(f"max_evaluations={self.max_evaluations}: must be at least 1")
        if self.time_bound_s is not None and not self.time_bound_s > 0:
            raise SpecError(f"time_bound_s={self.time_bound_s}: must be a positive number of seconds")
