"""Routes of plans and jobs: submit (optionally waiting), list, get, result, events, cancel."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from tagplan.errors import SpecError
from tagplan.service.api.deps import (
    REPLAYED_HEADER,
    IdempotencyKeyHeader,
    JobDep,
    PrincipalDep,
    RateLimitDep,
    RequestKeyDep,
    Services,
    ServicesDep,
)
from tagplan.service.api.schemas import Error, JobList, JobOut, SafeJSONResponse, job_list_item, job_out
from tagplan.service.keys import authenticate
from tagplan.service.requests import (
    PLAN_EXAMPLE,
    TINY_PLAN_EXAMPLE,
    LimitError,
    PlanRequest,
    calibration_of,
    check_inline,
    check_limits,
)
from tagplan.service.settings import Settings
from tagplan.service.store import Idempotency, JobStore, JobView
from tagplan.service.vocabulary import TERMINAL, JobKind, JobStatus

log = logging.getLogger(__name__)
router = APIRouter(tags=["jobs"])

MAX_WAIT_S = 60.0
WAIT_POLL_S = 0.25
EVENTS_POLL_S = 0.5
KEEPALIVE_S = 15.0
KEY_RECHECK_S = 5.0  # an open event stream checks its API key again this often
MAX_PAGE = 100
PLAN_EXAMPLES: dict[str, Any] = {
    "gpt3-1.3b": {"summary": "GPT-3 1.3B on two p3.8xlarge nodes", "value": PLAN_EXAMPLE},
    "tiny": {"summary": "a 4-layer GPT on one node, 20 plans (seconds)", "value": TINY_PLAN_EXAMPLE}}


def plan_body(raw: Annotated[dict[str, Any], Body(openapi_examples=PLAN_EXAMPLES)]) -> PlanRequest:
    """The body as a PlanRequest, validated in a worker thread (a `def` dependency): its validators parse an
    inline cluster's YAML and walk inline graphs, seconds for a 2 MB body, which must not stall the event loop
    every other request is answered on. Errors are the 422 a body model's would be (`loc` from "body")."""
    try:
        return PlanRequest.model_validate(raw)
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from None


PlanBody = Annotated[PlanRequest, Depends(plan_body)]
PLAN_PATHS = ("/v1/plans", "/plan")


def document_plan_bodies(schema: dict[str, Any]) -> None:
    """Give the OpenAPI `schema` the plan routes' body as PlanRequest (validated by `plan_body`, not by FastAPI,
    which documents it as any object): its components, and each route's body schema a reference to it."""
    found = PlanRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = found.pop("$defs", {})
    schema.setdefault("components", {}).setdefault("schemas", {}).update({**defs, "PlanRequest": found})
    for path in PLAN_PATHS:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        body["schema"] = {"$ref": "#/components/schemas/PlanRequest"}
WaitQuery = Annotated[float | None, Query(ge=0, allow_inf_nan=False, description=(
    "seconds to wait for the result (at most 60): 200 with the result if the job succeeded by then, "
    "else 202 with the job"))]
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Error}, 404: {"model": Error}, 413: {"model": Error}, 422: {"model": Error}}


def _job_json(job: JobView) -> dict[str, Any]:
    return job_out(job).model_dump(mode="json")


def validate(request: PlanRequest, settings: Settings) -> None:
    """What the body's model cannot know: the service's limits and the calibration's registry version.

    Read off the parsed request (`requests.check_limits`), then an inline graph or cluster file parsed
    (`requests.check_inline`): no SPEC is built here. Any failure to understand the input is a 422, never a 500.
    """
    try:
        check_limits(request, settings)
        check_inline(request)
        calibration_of(request.calibration, settings)
    except (SpecError, LimitError):
        raise
    except Exception as err:  # the request could not be read: bad input, reported, never a 500
        log.warning("plan request validation raised %s", type(err).__name__, exc_info=err)
        raise SpecError(f"invalid plan request: {type(err).__name__}") from None


@router.post("/v1/plans", status_code=202, response_model=JobOut, dependencies=[RateLimitDep],
             responses={**_ERRORS, 200: {"description": "`?wait=`: the job finished in time; its result"},
                        429: {"model": Error}}, summary="Submit a planning job")
@router.post("/plan", status_code=202, response_model=JobOut, dependencies=[RateLimitDep],
             responses={**_ERRORS, 200: {"description": "`?wait=`: the job finished in time; its result"},
                        429: {"model": Error}}, summary="Submit a planning job (alias of POST /v1/plans)")
async def submit_plan(body: PlanBody, principal: PrincipalDep, services: ServicesDep,
                      wait: WaitQuery = None, idempotency_key: IdempotencyKeyHeader = None) -> Response:
    """Validate the problem (a bad one is a 422, never a job) and queue it; 202 with the job.

    With an `Idempotency-Key`, a retry of the same body gets the first request's job back
    (header `Idempotent-Replayed: true`); the key with a different body is a 422.
    """
    request = body.to_request()
    once = Idempotency.of(idempotency_key, "POST /v1/plans", request)
    earlier = await run_in_threadpool(services.store.replay, principal.tenant_id, once)
    if earlier is not None:
        job, replayed = earlier, True
    else:
        await run_in_threadpool(validate, body, services.settings)
        job, replayed = await run_in_threadpool(services.store.submit_once, principal.tenant_id, JobKind.PLAN,
                                                request, once)
    headers = {REPLAYED_HEADER: "true"} if replayed else None
    if wait:
        job, result = await _wait(services.store, principal.tenant_id, job.id, min(wait, MAX_WAIT_S))
        if result is not None:
            return SafeJSONResponse(result, status_code=200, headers=headers)
    return SafeJSONResponse(_job_json(job), status_code=202, headers=headers)


async def _wait(store: JobStore, tenant_id: int, job_id: str, wait_s: float) -> tuple[JobView, dict[str, Any] | None]:
    """Poll until the job finishes or `wait_s` passes: (the job, its result if it succeeded)."""
    deadline = time.monotonic() + wait_s
    while True:
        job = await run_in_threadpool(store.get, tenant_id, job_id)
        if job is None:
            raise HTTPException(404, f"job {job_id!r} disappeared")
        if job.status is JobStatus.SUCCEEDED:
            return job, await run_in_threadpool(store.result, tenant_id, job_id)
        if job.status in TERMINAL or time.monotonic() >= deadline:
            return job, None
        await asyncio.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))


@router.get("/v1/jobs", response_model=JobList, responses=_ERRORS, summary="List the tenant's jobs")
def list_jobs(principal: PrincipalDep, services: ServicesDep,
              offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
              limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20) -> JobList:
    """One page of the tenant's jobs, newest first, with the total; each with its model, cluster,
    objective and (a succeeded plan) predicted `iteration_time_s`."""
    jobs, total = services.store.list(principal.tenant_id, offset, limit)
    return JobList(jobs=[job_list_item(j) for j in jobs], total=total, offset=offset, limit=limit)


@router.get("/v1/jobs/{job_id}", response_model=JobOut, responses=_ERRORS, summary="A job")
def get_job(job: JobDep) -> JobOut:
    """The job's status, progress and ETA."""
    return job_out(job)


@router.delete("/v1/jobs/{job_id}", status_code=202, response_model=JobOut, responses=_ERRORS,
               summary="Cancel a job")
def cancel_job(job: JobDep, principal: PrincipalDep, services: ServicesDep) -> JobOut:
    """Cancel: a queued job at once, a running one at its worker's next heartbeat."""
    cancelled = services.store.cancel(principal.tenant_id, job.id)
    return job_out(cancelled or job)


@router.get("/v1/jobs/{job_id}/result", responses={**_ERRORS, 409: {"model": Error}}, summary="A job's result",
            response_class=SafeJSONResponse)
def job_result(job: JobDep, principal: PrincipalDep, services: ServicesDep) -> SafeJSONResponse:
    """The planner's JSON (`best`, `pareto`, `baselines`, `search`, `timeline`, ...); 409 until it succeeded."""
    if job.status is not JobStatus.SUCCEEDED:
        why = f": {job.error}" if job.error else ""
        raise HTTPException(409, f"job is {job.status}{why}; the result exists once it succeeded")
    result = services.store.result(principal.tenant_id, job.id)
    if result is None:
        raise HTTPException(404, f"job {job.id!r} has no stored result")
    return SafeJSONResponse(result)


@router.get("/v1/jobs/{job_id}/events", responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
            response_class=EventSourceResponse, summary="A job's progress as server-sent events")
def job_events(job: JobDep, principal: PrincipalDep, key: RequestKeyDep, services: ServicesDep) -> EventSourceResponse:
    """`event: progress` with the job JSON at every change, then one `event: done`, and the stream
    closes; a `: ping` comment every 15 s of quiet keeps proxies from closing it (sse-starlette). The key is
    checked again every `KEY_RECHECK_S`: once revoked, one `event: error` and the stream closes."""
    return EventSourceResponse(_events(services, principal.tenant_id, job.id, key), ping=int(KEEPALIVE_S), sep="\n",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(services: Services, tenant_id: int, job_id: str, key: str) -> AsyncIterator[ServerSentEvent]:
    """The job's states as they change (polled every `EVENTS_POLL_S`), until it finished or `key` is revoked."""
    last: tuple[Any, ...] | None = None
    checked = time.monotonic()
    while True:
        if time.monotonic() - checked >= KEY_RECHECK_S:
            checked = time.monotonic()
            if await run_in_threadpool(authenticate, services.engine, key) is None:
                yield _sse("error", {"id": job_id, "detail": "invalid or revoked API key"})
                return
        job = await run_in_threadpool(services.store.get, tenant_id, job_id)
        if job is None:
            yield _sse("done", {"id": job_id, "status": "unknown"})
            return
        state = (job.status, job.progress, job.message, job.attempts)
        if state != last:
            last = state
            yield _sse("progress", _job_json(job))
        if job.status in TERMINAL:
            yield _sse("done", _job_json(job))
            return
        await asyncio.sleep(EVENTS_POLL_S)


def _sse(event: str, data: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data, separators=(",", ":")), event=event, sep="\n")
