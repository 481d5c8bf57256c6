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

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MAX_EVALUATIONS", "Objective", "PlanProblem", "Scorer"]


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
    ablation); `comm_mode`: `BYTES_ONLY` ignores the topology (an ablation).
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

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise SpecError(f"budget_s={self.budget_s}: must be a positive number of seconds")
        if self.max_evaluations < 1:
            raise SpecError(f"max_evaluations={self.max_evaluations}: must be at least 1")
        if self.time_bound_s is not None and not self.time_bound_s > 0:
            raise SpecError(f"time_bound_s={self.time_bound_s}: must be a positive number of seconds")
