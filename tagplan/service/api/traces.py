"""Routes of measurements: upload a trace bundle, start a training run on uploaded traces.

An upload is validated whole (the manifest and every record) before anything is written, so a
malformed line is a 422 naming it and leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from tagplan.datasets.traces.bundle import (
    Fingerprint,
    IterationRecord,
    Manifest,
    TraceRecord,
    now_iso,
    parse_record,
    write_bundle,
)
from tagplan.errors import SpecError, from_validation
from tagplan.service.api.deps import (
    ID_PATTERN,
    REPLAYED_HEADER,
    IdempotencyKeyHeader,
    PrincipalDep,
    RateLimitDep,
    Services,
    ServicesDep,
)
from tagplan.service.api.schemas import Error, JobOut, TraceBundleIn, TraceCreated, TrainingRunRequest, job_out
from tagplan.service.keys import Principal
from tagplan.service.requests import (
    MAX_NESTING,
    CalibrationChoice,
    LimitError,
    TrainRequest,
    calibration_of,
    check_iteration,
    clipped,
    nesting,
    non_finite,
    traces_root,
)
from tagplan.service.settings import Settings
from tagplan.service.store import Idempotency, TraceInUseError
from tagplan.service.vocabulary import JobKind

log = logging.getLogger(__name__)
router = APIRouter(tags=["traces"])

PRINTABLE = r"^[^\x00-\x1f\x7f]*$"  # no control characters (PostgreSQL refuses NUL in text)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_NAME_CHARS = 200
JSON_TYPES = ("application/json",)
LINES_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines", "text/plain")
_ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": Error}, 413: {"model": Error}, 415: {"model": Error},
                                            422: {"model": Error}, 429: {"model": Error}}
NameQuery = Annotated[str | None, Query(max_length=MAX_NAME_CHARS, pattern=PRINTABLE,
                                                 description="what the trace is")]
DeviceQuery = Annotated[str | None, Query(min_length=1, max_length=200, pattern=PRINTABLE, description=(
    "records.jsonl only: the device type measured (default: the records' device)"))]
_RECORD_EXAMPLE = {"record": "op", "device": "cpu-amd-epyc", "kind": "matmul", "dtype": "fp32", "flops": 4194304.0,
                   "bytes_read": 131072.0, "bytes_written": 65536.0, "time_s": 0.000126}
_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "application/json": {
        "schema": TraceBundleIn.model_json_schema(),
        "example": {"manifest": {"created": "2026-01-05T10:00:00+00:00", "source": "tagplan profile --device cpu",
                                 "fingerprint": {"device_type": "cpu-amd-epyc"}},
                    "records": [_RECORD_EXAMPLE]}},
    "application/x-ndjson": {"schema": {"type": "string"}, "example": json.dumps(_RECORD_EXAMPLE) + "\n"},
    "text/plain": {"schema": {"type": "string"}, "example": json.dumps(_RECORD_EXAMPLE) + "\n"},
}}}


@router.post("/v1/traces", status_code=201, response_model=TraceCreated, responses=_ERRORS, openapi_extra=_BODY,
             dependencies=[RateLimitDep], summary="Upload a trace bundle")
async def upload_trace(request: Request, response: Response, principal: PrincipalDep, services: ServicesDep,
                       name: NameQuery = None, device: DeviceQuery = None,
                       idempotency_key: IdempotencyKeyHeader = None) -> TraceCreated:
    """A `tagplan-traces/1` bundle as JSON `{manifest, records}`, or `records.jsonl` text
    (`application/x-ndjson` or `text/plain`) with `?name=` and `?device=`; 201 with its id.
    With an `Idempotency-Key`, a retry of the same upload gets the first one's id back."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body = await request.body()
    settings = services.settings
    once = Idempotency.of(idempotency_key, "POST /v1/traces",
                          json.dumps([media, name, device]).encode() + b"\n" + body)
    if once is not None:
        earlier = await run_in_threadpool(services.store.earlier_trace, principal.tenant_id, once)
        if earlier is not None:
            response.headers[REPLAYED_HEADER] = "true"
            return TraceCreated(id=earlier[0], records=earlier[1])
    # the records are parsed and checked in a worker thread: seconds for a 2 MB upload, off the event loop
    if media in JSON_TYPES:
        manifest, records = await run_in_threadpool(_from_json, body, settings)
    elif media in LINES_TYPES:
        manifest, records = await run_in_threadpool(_from_lines, _text(body), device, principal, settings)
    else:
        raise HTTPException(415, f"Content-Type {media or '(none)'!r}: send application/json (a bundle "
                                 f"{{manifest, records}}) or one of {', '.join(LINES_TYPES)} (records.jsonl)")
    label = _CONTROL.sub(" ", name or manifest.fingerprint.device_type)[:MAX_NAME_CHARS]  # fits `traces.name`
    root = traces_root(services.settings) / str(principal.tenant_id)
    trace_id = await run_in_threadpool(_store, services, principal, root, label, manifest, records, once)
    return TraceCreated(id=trace_id, records=len(records))


@router.delete("/v1/traces/{trace_id}", status_code=204, responses={401: {"model": Error}, 404: {"model": Error},
               409: {"model": Error}}, summary="Delete an uploaded trace bundle")
async def delete_trace(trace_id: str, principal: PrincipalDep, services: ServicesDep) -> Response:
    """Forget one of the tenant's traces and remove its bundle (it then counts no more against
    `TAGPLAN_MAX_TRACES_PER_TENANT`); 404 for another tenant's or an unknown id; 409 while a queued or
    running training run reads it."""
    if not ID_PATTERN.fullmatch(trace_id):
        raise HTTPException(404, f"no trace {clipped(repr(trace_id))} of this tenant")
    try:
        path = await run_in_threadpool(services.store.delete_trace, principal.tenant_id, trace_id)
    except TraceInUseError as err:
        raise HTTPException(409, str(err)) from None
    if path is None:
        raise HTTPException(404, f"no trace {trace_id!r} of this tenant")
    tenant_root = (traces_root(services.settings) / str(principal.tenant_id)).resolve()
    if Path(path).resolve().parent == tenant_root:  # only ever a bundle the service wrote for this tenant
        await run_in_threadpool(shutil.rmtree, path, False, _log_left_behind)
    else:
        log.warning("trace %s: its path %s is not under %s; the record is gone, the files are left", trace_id, path,
                    tenant_root)
    return Response(status_code=204)


def _log_left_behind(_function: Any, path: str, exc_info: tuple[type[BaseException], BaseException, Any]) -> None:
    """`shutil.rmtree`'s onerror: a file it could not remove is logged, the rest removed."""
    log.warning("a deleted trace's file %s could not be removed: %s", path, exc_info[1])


def _store(services: Services, principal: Principal, root: Path, label: str, manifest: Manifest,
           records: list[TraceRecord], once: Idempotency | None) -> str:
    """Write the bundle and record it; a concurrent upload with the same key that won gives its id."""
    directory = root / uuid.uuid4().hex
    write_bundle(directory, manifest, records)
    try:
        return str(services.store.add_trace(principal.tenant_id, label, str(directory), len(records), once))
    except IntegrityError:
        shutil.rmtree(directory, ignore_errors=True)
        earlier = services.store.earlier_trace(principal.tenant_id, once) if once is not None else None
        if earlier is None:
            raise
        return earlier[0]
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"records.jsonl: not UTF-8 text (byte {err.start})") from None


def _from_json(body: bytes, settings: Settings) -> tuple[Manifest, list[TraceRecord]]:
    try:
        bundle = TraceBundleIn.model_validate_json(body)
    except ValidationError as err:
        raise from_validation("trace bundle", err) from None
    try:
        manifest = Manifest.model_validate(bundle.manifest)
    except ValidationError as err:
        raise from_validation("manifest", err) from None
    _finite(manifest.model_dump(), "manifest")
    records = [_record(json.dumps(r), f"records[{i}]", settings) for i, r in enumerate(bundle.records)]
    return manifest, _nonempty(records)


def _from_lines(text: str, device: str | None, principal: Principal,
                settings: Settings) -> tuple[Manifest, list[TraceRecord]]:
    records = [_record(line, f"line {n}", settings) for n, line in enumerate(text.splitlines(), start=1)
               if line.strip()]
    device_type = device or next((str(d) for r in records if (d := getattr(r, "device", None))), None)
    if device_type is None:
        raise SpecError("records.jsonl: no record names its device; give ?device=TYPE")
    fingerprint = Fingerprint(device_type=device_type)
    manifest = Manifest(created=now_iso(), source=f"POST /v1/traces by tenant {principal.tenant}",
                        fingerprint=fingerprint)
    return manifest, _nonempty(records)


def _record(line: str, where: str, settings: Settings) -> TraceRecord:
    """One record, checked whole: nested at most `MAX_NESTING` levels inside it (a plan or an inline graph;
    a deeper one could not be stored), finite, and an iteration record names its model and cluster inline
    or as a SPEC that names no file, within the service's limits (`requests.check_iteration`)."""
    record = parse_record(line, where)
    deep = [name for name, value in record if nesting(value) > MAX_NESTING]
    if deep:
        raise SpecError(f"{where}: {deep[0]}: nested deeper than {MAX_NESTING} levels; at most {MAX_NESTING} "
                        "are accepted")
    _finite(record.model_dump(), where)
    if isinstance(record, IterationRecord):
        return _checked_iteration(record, settings, where)
    return record


def _checked_iteration(record: IterationRecord, settings: Settings, where: str) -> IterationRecord:
    """`requests.check_iteration`, whose every failure to read the record is a SpecError naming `where`."""
    try:
        return check_iteration(record, settings, where)
    except SpecError:  # check_iteration names the field (a workload beyond what a plan request accepts, too)
        raise
    except Exception as err:  # e.g. cluster YAML with an integer longer than Python converts: the tenant's input
        reason = clipped(str(err).split(";")[0])[:200]
        log.warning("%s: iteration record check raised %s: %s", where, type(err).__name__, reason)
        raise SpecError(f"{where}: its model or cluster cannot be read ({type(err).__name__}: {reason})") from None


def _finite(value: Any, where: str) -> None:
    """SpecError for an infinity or NaN (`1e999` parses as one): a bundle holds measured, finite numbers."""
    found = non_finite(value, "")
    if found is not None:
        raise SpecError(f"{where}: {found.lstrip('.') or 'value'}: not a finite number")


def _nonempty(records: list[TraceRecord]) -> list[TraceRecord]:
    if not records:
        raise SpecError("trace bundle: no records; a bundle holds at least one op, collective or iteration record")
    return records


def _calibration(value: CalibrationChoice, settings: Settings) -> CalibrationChoice:
    """The choice as given, checked now (`requests.calibration_of`), so a bad one never becomes a job."""
    if value is not None:
        calibration_of(value, settings)
    return value


@router.post("/v1/training-runs", status_code=202, response_model=JobOut, dependencies=[RateLimitDep],
             responses={**_ERRORS, 404: {"model": Error}}, summary="Retrain the GNN on uploaded traces")
def submit_training_run(body: TrainingRunRequest, principal: PrincipalDep, services: ServicesDep, response: Response,
                        idempotency_key: IdempotencyKeyHeader = None) -> JobOut:
    """Queue a training run (a job of kind `train`) on the tenant's traces; 404 if one is not theirs.
    With an `Idempotency-Key`, a retry of the same body gets the first run's job back (even once its traces
    are deleted). The traces may hold at most `max_training_records` records together."""
    once = Idempotency.of(idempotency_key, "POST /v1/training-runs", body.model_dump(mode="json"))
    earlier = services.store.replay(principal.tenant_id, once)
    if earlier is not None:
        response.headers[REPLAYED_HEADER] = "true"
        return job_out(earlier)
    ids = list(dict.fromkeys(body.traces))
    unknown = [t for t in ids if not ID_PATTERN.fullmatch(t)]
    found = None if unknown else services.store.trace_records(principal.tenant_id, ids)
    if found is None:
        raise HTTPException(404, f"unknown trace id(s) for tenant {principal.tenant!r} among {ids[:10]}; "
                                 "upload traces with POST /v1/traces")
    paths, records = found
    limit = services.settings.max_training_records
    if records > limit:  # each iteration record is rebuilt, featurized and simulated by the run
        raise LimitError(f"traces: {len(ids)} trace(s) of {records} records in all are over this service's limit "
                         f"of {limit} records per training run (TAGPLAN_MAX_TRAINING_RECORDS); name fewer traces",
                         limit="max_training_records")
    request = TrainRequest(traces=paths, calibration=_calibration(body.calibration, services.settings))
    job, replayed = services.store.submit_once(principal.tenant_id, JobKind.TRAIN,
                                               request.model_dump(exclude_none=True), once)
    if not replayed and not services.store.traces_held(principal.tenant_id, ids):  # deleted as the run was queued
        services.store.cancel(principal.tenant_id, job.id)
        raise HTTPException(404, f"trace(s) among {ids[:10]} were deleted as this training run was queued; its job "
                                 f"{job.id} is cancelled")
    if replayed:
        response.headers[REPLAYED_HEADER] = "true"
    return job_out(job)
