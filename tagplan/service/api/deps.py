"""Dependencies of the routes: the app's services, the caller's tenant, the rate limit, a tenant's job."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, Header, HTTPException, Path, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from tagplan.service.api.limits import RateLimiter, retry_after
from tagplan.service.api.metrics import ServiceMetrics
from tagplan.service.keys import Principal, authenticate
from tagplan.service.settings import Settings
from tagplan.service.store import JobStore, JobView

ID_PATTERN = re.compile(r"[0-9a-f]{32}")  # uuid4 hex: jobs and traces
MAX_KEY_CHARS = 512
MAX_IDEMPOTENCY_KEY_CHARS = 200
REPLAYED_HEADER = "Idempotent-Replayed"

IdempotencyKeyHeader = Annotated[str | None, Header(
    alias="Idempotency-Key", min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS, pattern=r"^[\x21-\x7e]+$",
    description=("any 1-200 printable ASCII characters (a UUID, say), chosen by the client: a retry with the "
                 "same key and body gets the first request's answer (same id) instead of a second one; the "
                 "same key with a different body is a 422. Kept in the database, per tenant."))]


@dataclass(frozen=True)
class Services:
    """What the routes share, built once by `create_app` and kept in `app.state.services`."""

    settings: Settings
    engine: sa.Engine
    store: JobStore
    limiter: RateLimiter
    metrics: ServiceMetrics


def get_services(request: Request) -> Services:
    """The app's services."""
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>` (from `tagplan admin create-key`)")
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="the same key in an `X-API-Key` header")


def request_key(bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                api_key: Annotated[str | None, Depends(_api_key)]) -> str:
    """The API key the request was sent with ("" for none): `Authorization: Bearer`, else `X-API-Key`. A
    long-lived response checks it again (`jobs._events`: a key revoked meanwhile ends the stream)."""
    return (bearer.credentials if bearer is not None else api_key) or ""


RequestKeyDep = Annotated[str, Depends(request_key)]


def current_principal(services: ServicesDep, key: RequestKeyDep) -> Principal:
    """The tenant of the request's API key; 401 without a valid one."""
    if not key:
        raise HTTPException(401, "missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`",
                            headers={"WWW-Authenticate": "Bearer"})
    principal = authenticate(services.engine, key) if len(key) <= MAX_KEY_CHARS else None
    if principal is None:
        raise HTTPException(401, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    return principal


PrincipalDep = Annotated[Principal, Depends(current_principal)]



def optional_principal(services: ServicesDep, key: RequestKeyDep) -> Principal | None:
    """The tenant of the request's API key, or None without a valid one (never 401)."""
    return authenticate(services.engine, key) if key and len(key) <= MAX_KEY_CHARS else None


MaybePrincipalDep = Annotated[Principal | None, Depends(optional_principal)]


def admin_principal(principal: PrincipalDep) -> Principal:
    """The caller, who must hold an admin key (403 otherwise)."""
    if not principal.admin:
        raise HTTPException(403, f"tenant {principal.tenant!r}: this needs an admin key "
                                 "(`tagplan admin create-key --tenant NAME --admin`)")
    return principal


AdminDep = Annotated[Principal, Depends(admin_principal)]


def rate_limited(principal: PrincipalDep, services: ServicesDep) -> None:
    """Spend one of the tenant's submissions; 429 with `Retry-After` when none are left."""
    wait_s = services.limiter.take(principal.tenant_id)
    if wait_s > 0:
        limit = services.settings.rate_per_minute
        raise HTTPException(429, f"tenant {principal.tenant!r}: more than {limit} submissions per minute "
                                 f"(TAGPLAN_RATE_PER_MINUTE); retry in {wait_s:.1f} s",
                            headers={"Retry-After": retry_after(wait_s)})


RateLimitDep = Depends(rate_limited)


def tenant_job(job_id: Annotated[str, Path(max_length=64, description="a job id")],
               principal: PrincipalDep, services: ServicesDep) -> JobView:
    """The caller's job `job_id`; 404 if there is none (another tenant's jobs are not there either)."""
    job = services.store.get(principal.tenant_id, job_id) if ID_PATTERN.fullmatch(job_id) else None
    if job is None:
        raise HTTPException(404, f"no job {job_id!r} for tenant {principal.tenant!r}")
    return job


JobDep = Annotated[JobView, Depends(tenant_job)]
