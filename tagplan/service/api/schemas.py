"""The HTTP API's wire formats besides the job requests (`service.requests.PlanRequest`): responses,
the trace bundle and training-run bodies, and JSON that never fails on infinities.

Bodies reject unknown keys (`extra="forbid"`) so a typo is a 422 naming the key, not a silently
ignored option. Job kinds and statuses are `service.vocabulary`'s enums.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tagplan.service.jobs import finite
from tagplan.service.requests import CalibrationChoice
from tagplan.service.store import JobView
from tagplan.service.vocabulary import JobKind, JobStatus


class JobOut(BaseModel):
    """A job as clients see it."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "3f2b9c1e0a6d4e8f9b7a5c3d1e2f4a6b", "kind": "plan", "status": "running", "progress": 0.4,
        "message": "160/400 plans", "error": None, "attempts": 1, "created_at": "2026-01-05T10:00:00Z",
        "started_at": "2026-01-05T10:00:01Z", "finished_at": None, "eta_s": 12.5}]})

    id: str
    kind: JobKind
    status: JobStatus
    progress: float = Field(ge=0, le=1)
    message: str = ""
    error: str | None = None
    attempts: int = 0
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    eta_s: float | None = Field(default=None, description="seconds left, estimated from the progress so far")


def job_out(job: JobView) -> JobOut:
    """The client's view of a stored job."""
    return JobOut.model_validate(job.to_json())


MAX_LABEL_CHARS = 120


class JobListItem(JobOut):
    """A job in the list: the `Job` fields plus what it plans (read from its stored request) and, once a
    plan succeeded, its predicted iteration time."""

    model: str | None = Field(default=None, description="the model SPEC, or the inline graph's name or \"inline\"")
    cluster: str | None = Field(default=None, description="the cluster SPEC, or the inline cluster's name or "
                                                          "\"inline\"")
    objective: str | None = Field(default=None, description="what `best` means (a plan's default: time)")
    iteration_time_s: float | None = Field(default=None, description=(
        "a succeeded plan's predicted iteration time, seconds (`result.best.report.iteration_time_s`)"))


def _label(value: Any) -> str | None:
    """A SPEC string as given, an inline object's `name` (else "inline"), shortened for a table cell."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, dict):
        name = value.get("name")
        text = name if isinstance(name, str) and name.strip() else "inline"
    else:
        return None
    return text if len(text) <= MAX_LABEL_CHARS else text[:MAX_LABEL_CHARS - 1] + "…"


def job_list_item(job: JobView) -> JobListItem:
    """A stored job as the job list shows it (nothing but the stored row is read)."""
    request = job.request if isinstance(job.request, dict) else {}
    objective = request.get("objective")
    if job.kind is JobKind.PLAN and objective is None:
        objective = "time"
    return JobListItem.model_validate({
        **job.to_json(), "model": _label(request.get("model")), "cluster": _label(request.get("cluster")),
        "objective": objective if isinstance(objective, str) else None, "iteration_time_s": job.iteration_time_s})


class JobList(BaseModel):
    """One page of a tenant's jobs, newest first."""

    jobs: list[JobListItem]
    total: int
    offset: int
    limit: int


class TraceBundleIn(BaseModel):
    """A `tagplan-traces/1` bundle as one JSON document (what `manifest.json` and `records.jsonl` hold)."""

    model_config = ConfigDict(extra="forbid")

    manifest: dict[str, Any]
    records: list[Any]


class TraceCreated(BaseModel):
    """An uploaded trace bundle."""

    id: str
    records: int


class TrainingRunRequest(BaseModel):
    """Retrain the GNN on uploaded traces."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"traces": ["0d5c8e4f2a1b4c6d8e0f1a2b3c4d5e6f"], "calibration": None}]})

    traces: list[Annotated[str, Field(max_length=64)]] = Field(min_length=1, max_length=256,
                                                               description="trace ids from POST /v1/traces")
    calibration: CalibrationChoice = Field(default=None, description=(
        "a calibration object, or a registry version with one pinned (default: the active version's)"))


class ModelVersion(BaseModel):
    """One registered GNN version and its model card."""

    version: str
    active: bool
    card: dict[str, Any]


class ModelsOut(BaseModel):
    """The GNN registry: its versions, the active one, and the fallback when none is active."""

    active: str | None = Field(description="the service-wide active version (admins activate it)")
    default: str | None = Field(description="the packaged checkpoint used while no version is active")
    versions: list[ModelVersion]
    tenant_active: str | None = Field(default=None, description="the caller's own active version, if any")
    tenant_versions: list[ModelVersion] = Field(default_factory=list, description="versions the caller's "
                                                "training runs registered")
    in_use: str = Field(default="packaged", description="what the caller's plans use: tenant:vNNNN, vNNNN "
                                                        "or packaged")


class Error(BaseModel):
    """Every error answer: what was wrong, which value, and what is accepted."""

    detail: str


class SafeJSONResponse(JSONResponse):
    """JSON that never fails on infinities or NaN (a result may hold them): they become null."""

    def render(self, content: Any) -> bytes:
        """Strict JSON bytes of `content`."""
        try:
            text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except ValueError:
            text = json.dumps(finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
