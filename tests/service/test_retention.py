"""Retention: finished jobs past `job_retention_s`, or beyond a tenant's `max_finished_jobs_per_tenant`, are
deleted with their idempotency keys; queued and running jobs never are (SQLite and PostgreSQL)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from tagplan.cli.main import main
from tagplan.service import store as store_module
from tagplan.service.db import IdempotencyKey, Job, make_engine, utcnow
from tagplan.service.keys import ensure_tenant
from tagplan.service.settings import Settings
from tagplan.service.store import Idempotency, JobStatus, JobStore
from tagplan.service.worker import run_worker

REQUEST = {"model": "gpt3-125m", "cluster": "p3.8xlarge"}
DAY = dt.timedelta(days=1)


def finished_job(store: JobStore, tenant: int, ended: dt.datetime, status: JobStatus = JobStatus.SUCCEEDED,
                 idempotency: Idempotency | None = None, request: dict[str, Any] | None = None) -> str:
    """A job of `tenant` that finished (through the store's own transitions) at `ended`."""
    job, _ = store.submit_once(tenant, "plan", request or REQUEST, idempotency)
    if status is JobStatus.CANCELLED:
        store.cancel(tenant, job.id)
    else:
        claimed = store.claim("w")
        assert claimed is not None and claimed.id == job.id
        if status is JobStatus.SUCCEEDED:
            store.complete(job.id, "w", {"best": {}})
        else:
            store.fail(job.id, "w", "boom", retry=False)
    with store.engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == job.id).values(finished_at=ended, created_at=ended))
    view = store.get(tenant, job.id)
    assert view is not None and view.status is status
    return job.id


def job_ids(store: JobStore) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.execute(select(Job.id)).scalars())


def test_finished_jobs_past_their_retention_go_with_their_keys(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    now = utcnow()
    key = Idempotency.of("retry-1", "POST /v1/plans", REQUEST)
    old = [finished_job(store, tenant, now - 31 * DAY, status, key if status is JobStatus.SUCCEEDED else None)
           for status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)]
    recent = finished_job(store, tenant, now - 29 * DAY)
    running = store.submit(tenant, "plan", REQUEST)
    assert store.claim("w2") is not None
    queued = store.submit(tenant, "plan", REQUEST)
    with store.engine.begin() as conn:  # submitted long ago, not finished: never the purge's
        conn.execute(update(Job).where(Job.id.in_([running.id, queued.id])).values(created_at=now - 400 * DAY))

    assert store.purge(now) == 3
    assert job_ids(store) == {recent, running.id, queued.id}
    for job_id in old:
        assert store.get(tenant, job_id) is None and store.result(tenant, job_id) is None
    with store.engine.connect() as conn:
        assert conn.execute(select(IdempotencyKey.key)).scalars().all() == []
    assert store.purge(now) == 0

    again, existed = store.submit_once(tenant, "plan", REQUEST, key)  # the key went with its job: a new job
    assert not existed and again.id not in old and again.status is JobStatus.QUEUED


def test_a_tenant_keeps_its_newest_finished_jobs(store: JobStore) -> None:
    crowded = JobStore(store.engine, store.settings.model_copy(update={"max_finished_jobs_per_tenant": 3}))
    a, b = ensure_tenant(store.engine, "a"), ensure_tenant(store.engine, "b")
    now = utcnow()
    a_jobs = [finished_job(store, a, now - i * dt.timedelta(minutes=1)) for i in range(5)]  # newest first
    b_jobs = [finished_job(store, b, now - 10 * DAY - i * dt.timedelta(minutes=1)) for i in range(3)]
    a_queued = store.submit(a, "plan", REQUEST)

    assert crowded.purge(now) == 2
    assert job_ids(store) == {*a_jobs[:3], *b_jobs, a_queued.id}
    listed, total = store.list(a, 0, 10)
    assert total == 4 and [j.id for j in listed][1:] == a_jobs[:3]


def test_purge_deletes_past_one_batch(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "PURGE_BATCH", 2)
    tenant = ensure_tenant(store.engine, "acme")
    now = utcnow()
    old = {finished_job(store, tenant, now - (40 + i) * DAY) for i in range(5)}
    kept = finished_job(store, tenant, now)
    assert store.purge(now) == 5
    assert job_ids(store) == {kept} and not old & job_ids(store)


def test_workers_purge_as_they_start_and_then_every_purge_every_s(settings: Settings) -> None:
    short = settings.model_copy(update={"job_retention_s": 3600.0})
    store = JobStore(make_engine(short.database_url), short)
    tenant = ensure_tenant(store.engine, "acme")
    now = utcnow()
    stale = finished_job(store, tenant, now - dt.timedelta(hours=2))
    fresh = finished_job(store, tenant, now - dt.timedelta(minutes=30))
    assert run_worker(short, once=True) == 0  # nothing to run, but the purge ran first
    assert job_ids(store) == {fresh} and stale not in job_ids(store)


def test_admin_purge_jobs(settings: Settings, store: JobStore, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAGPLAN_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("TAGPLAN_JOB_RETENTION_S", "86400")
    tenant = ensure_tenant(store.engine, "acme")
    now = utcnow()
    stale = finished_job(store, tenant, now - 2 * DAY)
    fresh = finished_job(store, tenant, now)
    assert main(["admin", "purge-jobs"]) == 0
    assert "deleted 1 finished jobs" in capsys.readouterr().err
    assert job_ids(store) == {fresh} and stale not in job_ids(store)


def test_retention_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="job_retention_s"):
        Settings(home=tmp_path, job_retention_s=0)
    with pytest.raises(ValidationError, match="max_finished_jobs_per_tenant"):
        Settings(home=tmp_path, max_finished_jobs_per_tenant=0)


def test_retention_for_ever_is_a_century_not_infinity(tmp_path: Path) -> None:
    for forever in (float("inf"), float("nan"), 1e11):
        with pytest.raises(ValidationError, match="job_retention_s"):
            Settings(home=tmp_path, job_retention_s=forever)
    century = Settings(home=tmp_path, job_retention_s=100 * 365 * 86_400.0)
    assert century.job_retention_s > 3e9
