"""Routes for operators: liveness, readiness (the database answers) and Prometheus metrics."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from tagplan.service.api import metrics as job_metrics
from tagplan.service.api.deps import MaybePrincipalDep, ServicesDep

log = logging.getLogger(__name__)
router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness")
def healthz() -> dict[str, str]:
    """200 while the process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness", responses={503: {"description": "the database does not answer"}})
def readyz(services: ServicesDep) -> JSONResponse:
    """200 when the database answers `SELECT 1`, else 503."""
    try:
        with services.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as err:  # any failure to reach the database means "not ready", never a 500
        log.warning("readiness check failed: %s", err)
        return JSONResponse({"status": "unavailable", "detail": f"database: {type(err).__name__}"}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
def metrics(services: ServicesDep, principal: MaybePrincipalDep) -> PlainTextResponse:
    """HTTP answers by route and code; with an admin key also jobs by status, queue depth and
    finished jobs' durations (how busy the tenants are is not for anyone to read)."""
    admin = principal is not None and principal.admin
    return PlainTextResponse(services.metrics.exposition(admin=admin), media_type=job_metrics.CONTENT_TYPE)
