"""The HTTP API's wire formats: request bodies (with the examples `/docs` shows) and responses.

Requests reject unknown keys (`extra="forbid"`) so a typo is a 422 naming the key, not a silently
ignored option. Limits that depend on the settings (devices, evaluations, budget) are checked by
`execute.validate_plan_request`, which names the limit; here only the shape and the signs.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tagplan.ir.workload import DType, Optimizer

if TYPE_CHECKING:
    from tagplan.service.store import JobView

JobKind = Literal["plan", "train"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

PLAN_EXAMPLE: dict[str, Any] = {
    "model": "gpt3-1.3b",
    "cluster": "p3.8xlarge:nodes=2",
    "workload": {"global_batch": 16, "seq_len": 1024, "dtype": "bf16"},
    "objective": "time",
    "budget_s": 30,
    "max_evaluations": 400,
    "seed": 0,
}
TINY_PLAN_EXAMPLE: dict[str, Any] = {"model": "gpt?layers=4&hidden=256&heads=4&vocab=100",
                                     "cluster": "p3.8xlarge", "max_evaluations": 20}


class WorkloadIn(BaseModel):
    """What one iteration processes; a field left out takes the planner's default."""

    model_config = ConfigDict(extra="forbid")

    global_batch: int | None = Field(default=None, gt=0, le=10**9, description="samples per iteration (default 8)")
    seq_len: int | None = Field(default=None, gt=0, le=10**9, description="tokens per sample (default: the model's)")
    dtype: DType | None = Field(default=None, description="default bf16")
    optimizer: Optimizer | None = Field(default=None, description="default adam")


class PlanRequest(BaseModel):
    """A planning problem: a model, a cluster and how to search."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [PLAN_EXAMPLE, TINY_PLAN_EXAMPLE]})

    model: str | dict[str, Any] = Field(
        description="a model SPEC (`gpt3-1.3b`, `gpt?layers=4&hidden=256&heads=4&vocab=100`, `hf:...`) "
                    "or an inline tagplan-graph/1 object",
        examples=["gpt3-1.3b"])
    cluster: str | dict[str, Any] = Field(
        description="a cluster SPEC (`p3.8xlarge:nodes=2`), an inline cluster-file object, or cluster-file YAML",
        examples=["p3.8xlarge:nodes=2"])
    workload: WorkloadIn | None = None
    objective: Literal["time", "memory", "gpus"] | None = Field(
        default=None, description="what `best` means (default time)")
    budget_s: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                   description="wall-clock budget of the search, seconds")
    max_evaluations: int | None = Field(default=None, ge=1, le=10**9, description="plans simulated at most")
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    time_bound_s: float | None = Field(default=None, gt=0, allow_inf_nan=False, description=(
        "objective memory|gpus: the slowest acceptable iteration, seconds (default 1.25 x the fastest)"))
    calibration: dict[str, Any] | str | None = Field(default=None, description=(
        "a cost-model calibration object (from `tagplan calibrate`) or a registry version with one pinned; "
        "default: the one pinned beside the active GNN version"))

    def to_request(self) -> dict[str, Any]:
        """The job's request: the fields given, as plain JSON."""
        return self.model_dump(mode="json", exclude_none=True)


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


class JobList(BaseModel):
    """One page of a tenant's jobs, newest first."""

    jobs: list[JobOut]
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

    traces: list[str] = Field(min_length=1, max_length=256, description="trace ids from POST /v1/traces")
    calibration: dict[str, Any] | str | None = Field(default=None, description=(
        "a calibration object, or a registry version with one pinned (default: the active version's)"))


class ModelVersion(BaseModel):
    """One registered GNN version and its model card."""

    version: str
    active: bool
    card: dict[str, Any]


class ModelsOut(BaseModel):
    """The GNN registry: its versions, the active one, and the fallback when none is active."""

    active: str | None
    default: str | None = Field(description="the packaged checkpoint used while no version is active")
    versions: list[ModelVersion]


class Error(BaseModel):
    """Every error answer: what was wrong, which value, and what is accepted."""

    detail: str


def finite(value: Any) -> Any:
    """`value` with every non-finite float (JSON has none) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class SafeJSONResponse(JSONResponse):
    """JSON that never fails on infinities or NaN (a result may hold them): they become null."""

    def render(self, content: Any) -> bytes:
        """Strict JSON bytes of `content`."""
        try:
            text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except ValueError:
            text = json.dumps(finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
