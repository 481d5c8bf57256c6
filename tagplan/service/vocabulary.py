"""The service's words, each defined once: what a job is (`JobKind`) and where it is (`JobStatus`).

The store writes them, the API's schemas validate and document them (pydantic takes StrEnums),
`/metrics` labels its gauges with them and the dispatcher routes on them. What "best" means is
`tagplan.search.problem.Objective`, the planner's own word.
"""

from __future__ import annotations

from enum import StrEnum


class JobKind(StrEnum):
    """What a job does."""

    PLAN = "plan"  # a PlanRequest -> the planner's JSON (service/jobs/plan.py)
    TRAIN = "train"  # a TrainRequest -> a new GNN version's model card (service/jobs/train.py)


class JobStatus(StrEnum):
    """Where a job is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: frozenset[JobStatus] = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
"""The statuses a job never leaves."""
