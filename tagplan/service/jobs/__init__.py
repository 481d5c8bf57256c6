"""What a job does, by kind: `run_job(kind, request, settings, progress)` -> the result JSON.

`plan.run_plan` (a `PlanRequest` -> the planner's JSON with the best plan's timeline) and
`train.run_train` (a `TrainRequest` -> the model card of a new GNN version). Each reads its stored
request with the model the API validated it with (`service.requests`). `progress(fraction 0..1,
message)` is called as the work advances; the worker's raises `Cancelled` to stop a job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tagplan.errors import SpecError
from tagplan.service.requests import LimitError
from tagplan.service.settings import Settings
from tagplan.service.vocabulary import JobKind

Progress = Callable[[float, str], None]

__all__ = ["Cancelled", "LimitError", "Progress", "finite", "run_job"]


class Cancelled(Exception):  # noqa: N818 (the name docs/SERVICE.md promises)
    """Raised by a job's progress callback when its worker was asked to stop it."""


def run_job(kind: JobKind | str, request: dict[str, Any], settings: Settings, progress: Progress, *,
            tenant_id: int | None = None) -> dict[str, Any]:
    """Run a job of `kind` for `tenant_id` and return its result JSON (strict: no NaN or infinities);
    SpecError (LimitError over a limit) for a bad request, which a retry cannot fix. The tenant's
    GNN registry is the one a plan uses and a training run registers into (`requests.tenant_registry`)."""
    if kind == JobKind.PLAN:
        from tagplan.service.jobs.plan import run_plan

        return dict(finite(run_plan(request, settings, progress, tenant_id=tenant_id)))
    if kind == JobKind.TRAIN:
        from tagplan.service.jobs.train import run_train

        return dict(finite(run_train(request, settings, progress, tenant_id=tenant_id)))
    raise SpecError(f"job kind {str(kind)[:40]!r} is not accepted; accepted: {', '.join(JobKind)}")


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: strict JSON (what browsers and Starlette accept)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
