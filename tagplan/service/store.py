"""`JobStore`: the only code that changes a job, each change one conditional UPDATE.

Every transition names the state it expects in its WHERE clause (`status`, `lease_owner`, and for
a claim the `attempts` it read) and checks the row count. The database serialises UPDATEs of one
row (SQLite: one writer at a time; PostgreSQL: a row lock, after which the WHERE is re-checked), so
of two workers racing for a job exactly one matches, and a worker whose lease was taken over
matches nothing: it gets `LeaseLost` and cannot overwrite the job. No SELECT ... FOR UPDATE, so the
same code is correct on both backends.
"""

from __future__ import annotations

import builtins
import datetime as dt
import hashlib
import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, and_, case, cast, delete, func, insert, literal, or_, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from tagplan.errors import SpecError
from tagplan.service.db import IdempotencyKey, Job, Trace, UTCDateTime, utcnow
from tagplan.service.requests import LimitError
from tagplan.service.settings import Settings
from tagplan.service.vocabulary import TERMINAL, JobKind, JobStatus

CLAIM_ROUNDS = 10  # candidate lists read per claim before giving up (each lost race moves on)
CLAIM_CANDIDATES = 8
PURGE_BATCH = 500  # finished jobs deleted per transaction by `JobStore.purge`


class LeaseLost(Exception):  # noqa: N818 (the name docs/SERVICE.md promises)
    """The worker no longer owns the job (its lease expired and another worker claimed it)."""


class IdempotencyConflictError(SpecError):
    """An `Idempotency-Key` the tenant already used for a different request (another body or route)."""


class TraceInUseError(Exception):
    """A trace a queued or running training run reads cannot be deleted (the API answers 409)."""


@dataclass(frozen=True)
class Idempotency:
    """A request's `Idempotency-Key`, the route it was sent to and the sha256 of its canonical body."""

    key: str
    route: str
    body_sha256: str

    @classmethod
    def of(cls, key: str | None, route: str, body: Any) -> Idempotency | None:
        """None without a key; `body` is bytes (hashed as sent) or JSON data (hashed with sorted keys,
        so a retry that orders its keys differently is still the same request)."""
        if key is None:
            return None
        raw = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return cls(key=key, route=route, body_sha256=hashlib.sha256(raw).hexdigest())


@dataclass(frozen=True)
class JobView:
    """A job as the API shows it, plus its tenant and request. Times are timezone-aware UTC."""

    id: str
    tenant_id: int
    kind: JobKind
    status: JobStatus
    progress: float
    message: str
    error: str | None
    attempts: int
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    eta_s: float | None
    request: dict[str, Any]
    iteration_time_s: float | None = None  # a succeeded plan's predicted iteration time; set by `list` only

    def to_json(self) -> dict[str, Any]:
        """The `Job` JSON of the API: `{id, kind, status, progress, message, error, attempts,
        created_at, started_at, finished_at, eta_s}`, times as ISO 8601 strings."""
        def iso(t: dt.datetime | None) -> str | None:
            return None if t is None else t.isoformat()

        return {"id": self.id, "kind": self.kind.value, "status": self.status.value, "progress": self.progress,
                "message": self.message, "error": self.error, "attempts": self.attempts,
                "created_at": iso(self.created_at), "started_at": iso(self.started_at),
                "finished_at": iso(self.finished_at), "eta_s": self.eta_s}


_VIEW_COLUMNS = (Job.id, Job.tenant_id, Job.kind, Job.status, Job.progress, Job.message, Job.error, Job.attempts,
                 Job.created_at, Job.started_at, Job.finished_at, Job.request)


def _view(row: Any, now: dt.datetime, iteration_time_s: float | None = None,
          request: dict[str, Any] | None = None) -> JobView:
    """A row as a JobView; `request`: what stands for the stored request where the row does not carry it (a job
    list's `_summary`)."""
    status = JobStatus(row.status)
    return JobView(id=row.id, tenant_id=row.tenant_id, kind=JobKind(row.kind), status=status, progress=row.progress,
                   message=row.message, error=row.error, attempts=row.attempts, created_at=row.created_at,
                   started_at=row.started_at, finished_at=row.finished_at,
                   eta_s=_eta_s(status, row.progress, row.started_at, now),
                   request=request if request is not None else json.loads(row.request),
                   iteration_time_s=iteration_time_s)


_ITERATION_TIME_PATH = ("best", "report", "iteration_time_s")
_SUMMARY_FIELDS = ("model", "cluster")  # what a job list shows of a request, with its objective


def _summary_columns(dialect: str) -> list[ColumnElement[Any]] | None:
    """Per summary field: its SPEC string (NULL for an object), whether it is an object, the object's `name`;
    then the objective. Read inside the database: a request holding a 2 MB inline graph is not loaded and parsed
    for a table cell (a page of them took the API a second and more). None on a backend without JSON functions."""
    columns: list[ColumnElement[Any]] = []
    if dialect == "sqlite":
        valid = func.json_valid(Job.request) == 1
        for field in _SUMMARY_FIELDS:
            kind = func.json_type(Job.request, f"$.{field}")
            columns += [case((and_(valid, kind == "text"), func.json_extract(Job.request, f"$.{field}")), else_=None),
                        case((and_(valid, kind == "object"), literal(True)), else_=literal(False)),
                        case((and_(valid, kind == "object"), func.json_extract(Job.request, f"$.{field}.name")),
                             else_=None)]
        return [*columns, case((valid, func.json_extract(Job.request, "$.objective")), else_=None)]
    if dialect == "postgresql":
        request = cast(Job.request, JSONB)
        for field in _SUMMARY_FIELDS:
            kind = func.jsonb_typeof(request[field])
            columns += [case((kind == "string", request[field].astext), else_=None), kind == "object",
                        case((kind == "object", request[field]["name"].astext), else_=None)]
        return [*columns, request["objective"].astext]
    return None


def _summary(values: Sequence[Any]) -> dict[str, Any]:
    """The request as a job list reads it, from `_summary_columns`' values: a SPEC string, or an object with only
    its name (`api.schemas.job_list_item` labels it), and the objective."""
    out: dict[str, Any] = {}
    for i, field in enumerate(_SUMMARY_FIELDS):
        text, is_object, name = values[3 * i: 3 * i + 3]
        out[field] = text if isinstance(text, str) else ({"name": name} if is_object else None)
    if isinstance(values[-1], str):
        out["objective"] = values[-1]
    return out


def _iteration_time_column(dialect: str) -> ColumnElement[Any] | None:
    """`result.best.report.iteration_time_s` of a succeeded plan, read inside the database (the result,
    with its timeline, never leaves it); None on a backend without a JSON path function."""
    succeeded_plan = and_(Job.status == JobStatus.SUCCEEDED.value, Job.kind == JobKind.PLAN.value)
    if dialect == "sqlite":
        value: ColumnElement[Any] = func.json_extract(Job.result, "$." + ".".join(_ITERATION_TIME_PATH))
        return case((and_(succeeded_plan, func.json_valid(Job.result) == 1), value), else_=None)
    if dialect == "postgresql":
        value = func.jsonb_extract_path_text(cast(Job.result, JSONB), *_ITERATION_TIME_PATH)
        return case((succeeded_plan, value), else_=None)
    return None


def _seconds(value: Any) -> float | None:
    """A finite, non-negative number of seconds, or None (whatever the JSON held)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _iteration_time_of(result_text: str | None) -> float | None:
    """The same path read in Python (backends without JSON functions)."""
    try:
        value: Any = json.loads(result_text) if result_text else None
        for key in _ITERATION_TIME_PATH:
            value = value.get(key) if isinstance(value, dict) else None
    except ValueError:
        return None
    return _seconds(value)


def _eta_s(status: JobStatus, progress: float, started_at: dt.datetime | None, now: dt.datetime) -> float | None:
    """Seconds left if the rest goes as fast as the part done; None unless running with progress."""
    if status is not JobStatus.RUNNING or started_at is None or not 0.0 < progress <= 1.0:
        return None
    elapsed_s = max(0.0, (now - started_at).total_seconds())
    return elapsed_s * (1.0 - progress) / progress


def _remember(conn: Connection, tenant_id: int, idempotency: Idempotency | None, **made: str) -> None:
    """Store the key with what its request made (`job_id=` or `trace_id=`), in the caller's transaction."""
    if idempotency is not None:
        conn.execute(insert(IdempotencyKey).values(tenant_id=tenant_id, key=idempotency.key, route=idempotency.route,
                                                   body_sha256=idempotency.body_sha256, created_at=utcnow(), **made))


def _when(value: dt.datetime) -> ColumnElement[dt.datetime]:
    """A bound UTC time usable inside CASE (where no column lends it its type)."""
    return literal(value, type_=UTCDateTime())


class JobStore:
    """Jobs and traces in the service's database; safe to share between threads and processes."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine, self.settings = engine, settings

    # -- tenants' side -------------------------------------------------------------------------

    def submit(self, tenant_id: int, kind: JobKind, request: dict[str, Any]) -> JobView:
        """Store a new `queued` job of `kind` and return it (SpecError for a kind that is not a JobKind)."""
        return self.submit_once(tenant_id, kind, request, None)[0]

    def submit_once(self, tenant_id: int, kind: JobKind, request: dict[str, Any],
                    idempotency: Idempotency | None) -> tuple[JobView, bool]:
        """(the job, whether it already existed): with `idempotency`, the job an earlier request with
        the same key and body made, else a new one stored with the key in the same transaction.

        IdempotencyConflictError when the key was used for a different request. Two racing requests with
        one key make one job: the loser's INSERT of the key fails and it reads the winner's.
        """
        if kind not in set(JobKind):
            raise SpecError(f"job kind {str(kind)[:40]!r} is not accepted; accepted: {', '.join(JobKind)}")
        for _ in range(3):
            if idempotency is not None:
                earlier = self._earlier(tenant_id, idempotency)
                if earlier is not None and earlier.job_id is not None:
                    view = self._get(earlier.job_id, tenant_id)
                    if view is not None:
                        return view, True
                    continue  # purged since the key was read (the key went with it): store a new job
            try:
                return self._insert_job(tenant_id, kind, request, idempotency), False
            except IntegrityError:
                if idempotency is None:
                    raise
        raise RuntimeError(f"Idempotency-Key {idempotency!r}: could not store or find its job")

    def replay(self, tenant_id: int, idempotency: Idempotency | None) -> JobView | None:
        """The job an earlier request with this key and body made, if it still exists (None without a key);
        IdempotencyConflictError when the key was used for a different request. Routes ask before they check a
        request again: a retry gets its job back even where the check would now fail (its trace since deleted)."""
        if idempotency is None:
            return None
        earlier = self._earlier(tenant_id, idempotency)
        if earlier is None or earlier.job_id is None:
            return None
        return self._get(earlier.job_id, tenant_id)

    def _insert_job(self, tenant_id: int, kind: JobKind, request: dict[str, Any],
                    idempotency: Idempotency | None) -> JobView:
        job_id = uuid.uuid4().hex
        now = utcnow()
        with self.engine.begin() as conn:
            waiting = conn.execute(select(func.count()).select_from(Job).where(
                Job.tenant_id == tenant_id, Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]))).scalar()
            if int(waiting or 0) >= self.settings.max_queued_per_tenant:
                raise LimitError(f"this tenant has {waiting} jobs queued or running, the service's limit "
                                 f"(TAGPLAN_MAX_QUEUED_PER_TENANT={self.settings.max_queued_per_tenant}); "
                                 "wait for some to finish or cancel some", limit="max_queued_per_tenant", status=429)
            conn.execute(insert(Job).values(
                id=job_id, tenant_id=tenant_id, kind=JobKind(kind).value, status=JobStatus.QUEUED.value,
                request=json.dumps(request),
                progress=0.0, message="queued", attempts=0, max_attempts=self.settings.max_attempts,
                cancel_requested=False, created_at=now))
            _remember(conn, tenant_id, idempotency, job_id=job_id)
        view = self._get(job_id, tenant_id)
        assert view is not None
        return view

    def get(self, tenant_id: int, job_id: str) -> JobView | None:
        """The job, or None when it does not exist or belongs to another tenant."""
        return self._get(job_id, tenant_id)

    def list(self, tenant_id: int, offset: int, limit: int) -> tuple[list[JobView], int]:
        """The tenant's jobs, newest first, from `offset` (at most `limit`), and how many it has.

        Each succeeded plan carries its predicted `iteration_time_s`, read out of the stored result
        by the database's JSON functions (SQLite, PostgreSQL), so the page never loads whole results.
        """
        now = utcnow()
        extract = _iteration_time_column(self.engine.dialect.name)
        summary = extract if extract is not None else case(
            (and_(Job.status == JobStatus.SUCCEEDED.value, Job.kind == JobKind.PLAN.value), Job.result), else_=None)
        labels = _summary_columns(self.engine.dialect.name)
        columns = [c for c in _VIEW_COLUMNS if labels is None or c is not Job.request]
        query = (select(*columns, summary.label("summary"), *(labels or ())).where(Job.tenant_id == tenant_id)
                 .order_by(Job.created_at.desc(), Job.id.desc()).offset(max(0, offset)).limit(max(0, limit)))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
            total = conn.execute(select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id)).scalar_one()
        read = _seconds if extract is not None else _iteration_time_of
        if labels is None:
            return [_view(r, now, read(r.summary)) for r in rows], int(total)
        first = len(columns) + 1  # the label columns follow the view's and the summary
        return [_view(r, now, read(r.summary), request=_summary(tuple(r)[first:])) for r in rows], int(total)

    def cancel(self, tenant_id: int, job_id: str) -> JobView | None:
        """Cancel: a queued job at once, a running one at its worker's next heartbeat; None if unknown.

        A finished job is returned unchanged.
        """
        mine = and_(Job.id == job_id, Job.tenant_id == tenant_id)
        for _ in range(3):  # the job may move between the two UPDATEs (claimed, requeued): try again
            with self.engine.begin() as conn:
                queued = conn.execute(update(Job).where(mine, Job.status == JobStatus.QUEUED.value).values(
                    status=JobStatus.CANCELLED.value, finished_at=utcnow(), message="cancelled"))
                if queued.rowcount:
                    break
                running = conn.execute(update(Job).where(mine, Job.status == JobStatus.RUNNING.value).values(
                    cancel_requested=True, message="cancelling"))
                if running.rowcount:
                    break
            view = self._get(job_id, tenant_id)
            if view is None or view.status in TERMINAL:
                return view
        return self._get(job_id, tenant_id)

    def result(self, tenant_id: int, job_id: str) -> dict[str, Any] | None:
        """The result JSON of the tenant's succeeded job; None otherwise."""
        query = select(Job.result).where(Job.id == job_id, Job.tenant_id == tenant_id,
                                         Job.status == JobStatus.SUCCEEDED.value)
        with self.engine.connect() as conn:
            text = conn.execute(query).scalar()
        return None if text is None else dict(json.loads(text))

    def counts(self) -> dict[str, int]:
        """Jobs by status, every status present (for /metrics)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(Job.status, func.count()).group_by(Job.status)).all()
        found = {str(status): int(n) for status, n in rows}
        return {s.value: found.get(s.value, 0) for s in JobStatus}

    # -- workers' side -------------------------------------------------------------------------

    def claim(self, worker_id: str) -> JobView | None:
        """Take the oldest runnable job for `worker_id`: queued, or running with an expired lease.

        Sets `running`, the lease and `attempts + 1` in one UPDATE conditional on the status and
        attempts read, so of racing workers exactly one wins; the others move on to the next job.
        Jobs whose worker died on their last attempt are failed first (cancelled if asked to).
        """
        for _ in range(CLAIM_ROUNDS):
            now = utcnow()
            self._reap(now)
            candidates = self._candidates(now)
            if not candidates:
                return None
            for job_id, status, attempts in candidates:
                if self._try_claim(job_id, status, attempts, worker_id, now):
                    return self._get(job_id)
        return None

    def heartbeat(self, job_id: str, worker_id: str, progress: float, message: str = "") -> bool:
        """Renew the lease and record progress (0..1); True when cancellation was requested.

        LeaseLost when `worker_id` no longer owns the job.
        """
        with self.engine.begin() as conn:
            done = conn.execute(update(Job).where(*self._owned(job_id, worker_id)).values(
                lease_expires_at=utcnow() + dt.timedelta(seconds=self.settings.lease_s),
                progress=min(1.0, max(0.0, float(progress))), message=message))
            if done.rowcount != 1:
                raise LeaseLost(job_id)
            return bool(conn.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar())

    def cancel_requested(self, job_id: str) -> bool:
        """Whether the job was asked to stop (a cheap read the worker makes between heartbeats)."""
        with self.engine.connect() as conn:
            return bool(conn.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar())

    def complete(self, job_id: str, worker_id: str, result: dict[str, Any]) -> None:
        """Record the result and `succeeded`; LeaseLost (nothing written) if `worker_id` lost the job."""
        self._finish(job_id, worker_id, status=JobStatus.SUCCEEDED.value, result=json.dumps(result), error=None,
                     progress=1.0, message="done", finished_at=utcnow())

    def fail(self, job_id: str, worker_id: str, error: str, *, retry: bool) -> None:
        """Record `error`: requeue (`retry` and attempts left), else `failed`; cancelled if asked to.

        LeaseLost (nothing written) if `worker_id` lost the job.
        """
        now = utcnow()
        status = case((Job.cancel_requested, JobStatus.CANCELLED.value),
                      (and_(literal(retry), Job.attempts < Job.max_attempts), JobStatus.QUEUED.value),
                      else_=JobStatus.FAILED.value)
        requeue = and_(literal(retry), ~Job.cancel_requested, Job.attempts < Job.max_attempts)
        self._finish(job_id, worker_id, status=status, error=error,
                     message=case((Job.cancel_requested, "cancelled"), (requeue, "queued again after an error"),
                                  else_="failed"),
                     finished_at=case((requeue, None), else_=_when(now)))

    def mark_cancelled(self, job_id: str, worker_id: str) -> None:
        """The worker stopped the job because cancellation was requested; LeaseLost if not its own."""
        self._finish(job_id, worker_id, status=JobStatus.CANCELLED.value, message="cancelled", finished_at=utcnow())

    def release(self, job_id: str, worker_id: str) -> None:
        """Hand a job back to the queue without counting the attempt (the worker is shutting down);
        `cancelled` instead when its cancellation was requested, decided inside the one UPDATE, so a
        cancel that lands while the worker stops is never lost (a queued job with `cancel_requested`
        would never be claimed nor end). LeaseLost if `worker_id` lost the job."""
        asked = Job.cancel_requested
        self._finish(job_id, worker_id,
                     status=case((asked, JobStatus.CANCELLED.value), else_=JobStatus.QUEUED.value),
                     attempts=case((asked, Job.attempts), else_=Job.attempts - 1),
                     message=case((asked, "cancelled"), else_="queued again: its worker stopped"),
                     progress=case((asked, Job.progress), else_=0.0),
                     finished_at=case((asked, _when(utcnow())), else_=None))

    # -- traces --------------------------------------------------------------------------------

    def add_trace(self, tenant_id: int, name: str, path: str, records: int,
                  idempotency: Idempotency | None = None) -> str:
        """Record an uploaded trace bundle at `path`; returns its id (IntegrityError when another
        request stored `idempotency`'s key first: see `earlier_trace`)."""
        trace_id = uuid.uuid4().hex
        with self.engine.begin() as conn:
            stored = conn.execute(select(func.count()).select_from(Trace).where(Trace.tenant_id == tenant_id)).scalar()
            if int(stored or 0) >= self.settings.max_traces_per_tenant:
                raise LimitError(f"this tenant has stored {stored} traces, the service's limit "
                                 f"(TAGPLAN_MAX_TRACES_PER_TENANT={self.settings.max_traces_per_tenant})",
                                 limit="max_traces_per_tenant", status=429)
            conn.execute(insert(Trace).values(id=trace_id, tenant_id=tenant_id, name=name, path=path, records=records,
                                              created_at=utcnow()))
            _remember(conn, tenant_id, idempotency, trace_id=trace_id)
        return trace_id

    def earlier_trace(self, tenant_id: int, idempotency: Idempotency) -> tuple[str, int] | None:
        """(id, records) of the trace an earlier upload with this key and body stored; None if none did.

        IdempotencyConflictError when the key was used for a different request.
        """
        earlier = self._earlier(tenant_id, idempotency)
        if earlier is None or earlier.trace_id is None:
            return None
        with self.engine.connect() as conn:
            records = conn.execute(select(Trace.records).where(Trace.id == earlier.trace_id)).scalar_one_or_none()
        return None if records is None else (earlier.trace_id, int(records))  # None: deleted meanwhile

    def delete_trace(self, tenant_id: int, trace_id: str) -> str | None:
        """Forget the tenant's trace `trace_id` (its record and the idempotency keys that name it); returns the
        directory its bundle is in, for the caller to remove, or None where the tenant has no such trace.
        TraceInUseError while a queued or running training run of the tenant reads it.

        The row is deleted before the runs are read, in one transaction: a training run queued meanwhile either
        committed first (and is seen here: 409) or finds the trace gone when it checks again (`traces_held`)."""
        with self.engine.begin() as conn:
            path = conn.execute(select(Trace.path).where(Trace.tenant_id == tenant_id, Trace.id == trace_id)
                                ).scalar_one_or_none()
            if path is None:
                return None
            conn.execute(delete(IdempotencyKey).where(IdempotencyKey.tenant_id == tenant_id,
                                                      IdempotencyKey.trace_id == trace_id))
            conn.execute(delete(Trace).where(Trace.tenant_id == tenant_id, Trace.id == trace_id))
            live = conn.execute(select(Job.id, Job.request).where(
                Job.tenant_id == tenant_id, Job.kind == JobKind.TRAIN.value,
                Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)))).all()
            readers = [row.id for row in live if path in (json.loads(row.request).get("traces") or [])]
            if readers:  # raising rolls the deletes back
                raise TraceInUseError(f"trace {trace_id} is read by training run(s) {', '.join(readers[:5])}, "
                                      "queued or running; delete it once they end (or cancel them)")
        return str(path)

    def traces_held(self, tenant_id: int, ids: builtins.list[str]) -> bool:
        """Whether the tenant still has every trace `ids`, read after a training run naming them was queued; the
        rows are read FOR SHARE (PostgreSQL), so a deletion in flight is waited for, not missed. SQLite has one
        writer at a time: a deletion committed before the run's insert is seen."""
        with self.engine.begin() as conn:
            found = conn.execute(select(Trace.id).where(Trace.tenant_id == tenant_id, Trace.id.in_(ids))
                                 .with_for_update(read=True)).scalars().all()
        return set(found) == set(ids)

    def trace_records(self, tenant_id: int, ids: builtins.list[str]) -> tuple[builtins.list[str], int] | None:
        """(the paths of the tenant's traces `ids` in order, how many records they hold together); None if any is
        unknown or another tenant's."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(Trace.id, Trace.path, Trace.records).where(Trace.tenant_id == tenant_id,
                                                                                Trace.id.in_(ids))).all()
        found = {r.id: r for r in rows}
        if not all(i in found for i in ids):
            return None
        return [found[i].path for i in ids], sum(int(found[i].records) for i in ids)

    def traces(self, tenant_id: int, ids: builtins.list[str]) -> builtins.list[str] | None:
        """The paths of the tenant's traces `ids`, in order; None if any is unknown or another tenant's."""
        found = self.trace_records(tenant_id, ids)
        return None if found is None else found[0]

    # -- retention -----------------------------------------------------------------------------

    def purge(self, now: dt.datetime | None = None) -> int:
        """Delete finished jobs (succeeded, failed, cancelled) the service no longer keeps; returns how many.

        A finished job is kept `job_retention_s` after it finished, and a tenant's newest
        `max_finished_jobs_per_tenant` finished jobs at most: older ones go with their request, result
        and the idempotency keys that name them (a retry with such a key then makes a new job). Queued
        and running jobs are never touched: a finished job never changes status again, and each DELETE
        re-checks the status. Deletes run in batches of `PURGE_BATCH` jobs, one short transaction each.
        """
        now = now or utcnow()
        finished = Job.status.in_(sorted(s.value for s in TERMINAL))  # each of which sets finished_at
        cutoff = now - dt.timedelta(seconds=self.settings.job_retention_s)
        purged = self._purge_where(and_(finished, Job.finished_at < _when(cutoff)))
        keep = self.settings.max_finished_jobs_per_tenant
        with self.engine.connect() as conn:
            crowded = conn.execute(select(Job.tenant_id).where(finished).group_by(Job.tenant_id)
                                   .having(func.count() > keep)).scalars().all()
        for tenant_id in crowded:
            newest = (select(Job.id).where(finished, Job.tenant_id == tenant_id)
                      .order_by(Job.finished_at.desc(), Job.id.desc()).limit(keep).scalar_subquery())
            purged += self._purge_where(and_(finished, Job.tenant_id == tenant_id, Job.id.not_in(newest)))
        return purged

    def _purge_where(self, which: ColumnElement[bool]) -> int:
        """Delete the finished jobs `which` selects, and their idempotency keys, a batch per transaction."""
        purged = 0
        while True:
            with self.engine.begin() as conn:
                ids = conn.execute(select(Job.id).where(which).limit(PURGE_BATCH)).scalars().all()
                if not ids:
                    return purged
                conn.execute(delete(IdempotencyKey).where(IdempotencyKey.job_id.in_(ids)))
                purged += conn.execute(delete(Job).where(Job.id.in_(ids), which)).rowcount
            if len(ids) < PURGE_BATCH:
                return purged

    # -- internals -----------------------------------------------------------------------------

    def _earlier(self, tenant_id: int, idempotency: Idempotency) -> Any:
        """The stored row of the tenant's key (None if new); IdempotencyConflictError if it was another request's."""
        query = select(IdempotencyKey.route, IdempotencyKey.body_sha256, IdempotencyKey.job_id,
                       IdempotencyKey.trace_id).where(IdempotencyKey.tenant_id == tenant_id,
                                                      IdempotencyKey.key == idempotency.key)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        if row is None:
            return None
        if (row.route, row.body_sha256) != (idempotency.route, idempotency.body_sha256):
            made = f"job {row.job_id}" if row.job_id else f"trace {row.trace_id}"
            what = "a different body" if row.route == idempotency.route else f"{row.route}"
            raise IdempotencyConflictError(
                f"Idempotency-Key {idempotency.key[:80]!r} was already used with {what} (it made {made}); "
                "a retry must send the same request; use a new key for a new request")
        return row

    def _get(self, job_id: str, tenant_id: int | None = None) -> JobView | None:
        query = select(*_VIEW_COLUMNS).where(Job.id == job_id)
        if tenant_id is not None:
            query = query.where(Job.tenant_id == tenant_id)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else _view(row, utcnow())

    @staticmethod
    def _owned(job_id: str, worker_id: str) -> tuple[ColumnElement[bool], ...]:
        return Job.id == job_id, Job.status == JobStatus.RUNNING.value, Job.lease_owner == worker_id

    def _finish(self, job_id: str, worker_id: str, **values: Any) -> None:
        """Leave `running` with `values`, only if `worker_id` still owns the job."""
        values.update(lease_owner=None, lease_expires_at=None)
        with self.engine.begin() as conn:
            done = conn.execute(update(Job).where(*self._owned(job_id, worker_id)).values(**values))
        if done.rowcount != 1:
            raise LeaseLost(job_id)

    def _candidates(self, now: dt.datetime) -> builtins.list[tuple[str, str, int]]:
        """Runnable jobs in fair order: a tenant's k-th oldest runnable job takes its turn after the
        jobs it already has running (`turn` = running + k), ties by age; so one tenant's backlog
        never holds another's first job back, and a tenant at `max_running_per_tenant` waits."""
        runnable = or_(Job.status == JobStatus.QUEUED.value,
                       and_(Job.status == JobStatus.RUNNING.value, Job.lease_expires_at < now))
        running = (select(Job.tenant_id, func.count().label("n"))
                   .where(Job.status == JobStatus.RUNNING.value, Job.lease_expires_at >= now)
                   .group_by(Job.tenant_id).subquery())
        busy = func.coalesce(running.c.n, 0)
        rank = func.row_number().over(partition_by=Job.tenant_id, order_by=(Job.created_at, Job.id))
        ranked = (select(Job.id, Job.status, Job.attempts, Job.created_at, (rank + busy).label("turn"))
                  .outerjoin(running, running.c.tenant_id == Job.tenant_id)
                  .where(runnable, Job.attempts < Job.max_attempts, ~Job.cancel_requested,
                         busy < self.settings.max_running_per_tenant)
                  .subquery())
        query = (select(ranked.c.id, ranked.c.status, ranked.c.attempts)
                 .order_by(ranked.c.turn, ranked.c.created_at, ranked.c.id).limit(CLAIM_CANDIDATES))
        with self.engine.connect() as conn:
            return [(r.id, r.status, r.attempts) for r in conn.execute(query)]

    def _try_claim(self, job_id: str, status: str, attempts: int, worker_id: str, now: dt.datetime) -> bool:
        expected = [Job.id == job_id, Job.status == status, Job.attempts == attempts,
                    Job.attempts < Job.max_attempts, ~Job.cancel_requested]
        if status == JobStatus.RUNNING.value:  # re-checked at UPDATE time: a late heartbeat keeps its job
            expected.append(Job.lease_expires_at < now)
        stmt = update(Job).where(*expected).values(
            status=JobStatus.RUNNING.value, lease_owner=worker_id,
            lease_expires_at=now + dt.timedelta(seconds=self.settings.lease_s), attempts=Job.attempts + 1,
            started_at=now, progress=0.0, message=f"running (attempt {attempts + 1})")
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def _reap(self, now: dt.datetime) -> None:
        """Finish jobs whose worker died and that may not run again: failed, or cancelled if asked;
        and cancel queued jobs asked to stop (handed back by a stopping worker before `release`
        honoured the request: nothing else would ever end them)."""
        dead = and_(Job.status == JobStatus.RUNNING.value, Job.lease_expires_at < now,
                    or_(Job.attempts >= Job.max_attempts, Job.cancel_requested))
        stranded = and_(Job.status == JobStatus.QUEUED.value, Job.cancel_requested)
        with self.engine.connect() as conn:
            rows = conn.execute(select(Job.id, Job.status, Job.attempts, Job.lease_owner, Job.cancel_requested)
                                .where(or_(dead, stranded))).all()
        for row in rows:
            if row.status == JobStatus.QUEUED.value:
                with self.engine.begin() as conn:
                    conn.execute(update(Job).where(Job.id == row.id, stranded).values(
                        status=JobStatus.CANCELLED.value, message="cancelled", finished_at=now))
                continue
            values: dict[str, Any] = {"status": JobStatus.CANCELLED.value, "message": "cancelled"}
            if not row.cancel_requested:
                values = {"status": JobStatus.FAILED.value, "message": "failed",
                          "error": f"worker died {row.attempts} times"}
            stmt = update(Job).where(Job.id == row.id, Job.status == JobStatus.RUNNING.value,
                                     Job.attempts == row.attempts, Job.lease_expires_at < now).values(
                **values, lease_owner=None, lease_expires_at=None, finished_at=now)
            with self.engine.begin() as conn:
                conn.execute(stmt)
