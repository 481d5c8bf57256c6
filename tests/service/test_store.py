"""JobStore and API keys: the state machine of a job, its races, tenant isolation (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import Engine, select, update

from tagplan.errors import SpecError
from tagplan.service.db import ApiKey, Job, make_engine
from tagplan.service.keys import authenticate, create_key, ensure_tenant, hash_key, revoke_key
from tagplan.service.requests import MAX_NESTING, PlanRequest
from tagplan.service.settings import Settings
from tagplan.service.store import JobStatus, JobStore, LeaseLost

REQUEST = {"model": "gpt3-125m", "cluster": "p3.8xlarge"}


def expire(store: JobStore) -> None:
    """Sleep past the store's lease."""
    time.sleep(store.settings.lease_s + 0.05)


def short_lease(store: JobStore, lease_s: float = 0.2, **changes: int) -> JobStore:
    """Another store on the same database with a short lease (and other settings changed)."""
    return JobStore(store.engine, store.settings.model_copy(update={"lease_s": lease_s, **changes}))


def test_submit_claim_heartbeat_complete(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", REQUEST)
    assert (job.status, job.attempts, job.request, job.eta_s) == (JobStatus.QUEUED, 0, REQUEST, None)
    assert job.created_at.tzinfo is not None

    claimed = store.claim("w1")
    assert claimed is not None and claimed.id == job.id
    assert (claimed.status, claimed.attempts) == (JobStatus.RUNNING, 1)
    assert store.claim("w2") is None  # the lease is live: nobody else gets it

    assert store.heartbeat(job.id, "w1", 0.5, "evaluations 10/20") is False
    running = store.get(tenant, job.id)
    assert running is not None and (running.progress, running.message) == (0.5, "evaluations 10/20")
    assert running.eta_s is not None and running.eta_s >= 0.0

    store.complete(job.id, "w1", {"best": {"x": 1}})
    done = store.get(tenant, job.id)
    assert done is not None and (done.status, done.progress, done.eta_s) == (JobStatus.SUCCEEDED, 1.0, None)
    assert done.finished_at is not None and done.started_at is not None
    assert store.result(tenant, job.id) == {"best": {"x": 1}}
    assert store.claim("w1") is None
    with pytest.raises(LeaseLost):  # completing twice is refused
        store.complete(job.id, "w1", {"best": {"x": 2}})
    assert store.result(tenant, job.id) == {"best": {"x": 1}}
    json_view = done.to_json()
    assert set(json_view) == {"id", "kind", "status", "progress", "message", "error", "attempts", "created_at",
                              "started_at", "finished_at", "eta_s"}
    assert json_view["status"] == "succeeded"


def test_unknown_kind_is_refused(store: JobStore) -> None:
    with pytest.raises(SpecError, match="kind 'sleep'"):
        store.submit(ensure_tenant(store.engine, "acme"), "sleep", {})


def test_jobs_are_claimed_oldest_first(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    ids = [store.submit(tenant, "plan", {"n": i}).id for i in range(3)]
    assert [store.claim("w").id for _ in ids] == ids  # type: ignore[union-attr]


def test_concurrent_claims_from_two_stores_never_share_a_job(store: JobStore, settings: Settings) -> None:
    """Two engines on one database (as two worker processes), four threads each, 40 jobs."""
    tenant = ensure_tenant(store.engine, "acme")
    jobs = {store.submit(tenant, "plan", {"n": i}).id for i in range(40)}
    other = JobStore(make_engine(settings.database_url), settings)
    claimed: list[tuple[str, str]] = []
    lock, start = threading.Lock(), threading.Barrier(8)

    def claim_all(s: JobStore, worker: str) -> None:
        start.wait()
        while (job := s.claim(worker)) is not None:
            with lock:
                claimed.append((job.id, worker))

    threads = [threading.Thread(target=claim_all, args=(s, f"{name}-{i}"))
               for name, s in (("a", store), ("b", other)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    other.engine.dispose()
    counts = Counter(job_id for job_id, _ in claimed)
    assert set(counts) == jobs and max(counts.values()) == 1
    for job_id, worker in claimed:  # each job is owned by the worker that claimed it, on its first attempt
        view = store.get(tenant, job_id)
        assert view is not None and (view.status, view.attempts) == (JobStatus.RUNNING, 1)
        store.complete(job_id, worker, {})


def test_lost_lease_cannot_overwrite(store: JobStore) -> None:
    fast = short_lease(store)
    tenant = ensure_tenant(store.engine, "acme")
    job = fast.submit(tenant, "plan", REQUEST)
    assert fast.claim("slow-worker") is not None
    expire(fast)
    again = fast.claim("new-worker")
    assert again is not None and (again.id, again.attempts) == (job.id, 2)
    for late in (lambda: fast.heartbeat(job.id, "slow-worker", 0.9),
                 lambda: fast.complete(job.id, "slow-worker", {"from": "slow"}),
                 lambda: fast.fail(job.id, "slow-worker", "boom", retry=True)):
        with pytest.raises(LeaseLost):
            late()
    fast.complete(job.id, "new-worker", {"from": "new"})
    assert fast.result(tenant, job.id) == {"from": "new"}


def test_heartbeat_keeps_the_lease(store: JobStore) -> None:
    fast = short_lease(store, lease_s=0.6)
    tenant = ensure_tenant(store.engine, "acme")
    job = fast.submit(tenant, "plan", REQUEST)
    assert fast.claim("w1") is not None
    for _ in range(4):  # 1.2 s in all: twice the lease, renewed every 0.3 s
        time.sleep(0.3)
        fast.heartbeat(job.id, "w1", 0.1)
    assert fast.claim("w2") is None


def test_worker_dying_on_every_attempt_fails_the_job(store: JobStore) -> None:
    fast = short_lease(store, max_attempts=2)
    tenant = ensure_tenant(store.engine, "acme")
    job = fast.submit(tenant, "plan", REQUEST)
    for attempt in (1, 2):
        claimed = fast.claim(f"w{attempt}")
        assert claimed is not None and claimed.attempts == attempt
        expire(fast)
    assert fast.claim("w3") is None
    dead = fast.get(tenant, job.id)
    assert dead is not None and (dead.status, dead.error, dead.attempts) == (JobStatus.FAILED, "worker died 2 times", 2)
    assert dead.finished_at is not None


def test_fail_retries_while_attempts_remain(store: JobStore) -> None:
    limited = short_lease(store, lease_s=30.0, max_attempts=2)
    tenant = ensure_tenant(store.engine, "acme")
    job = limited.submit(tenant, "plan", REQUEST)
    assert limited.claim("w1") is not None
    limited.fail(job.id, "w1", "flaky", retry=True)
    requeued = limited.get(tenant, job.id)
    assert requeued is not None and (requeued.status, requeued.error) == (JobStatus.QUEUED, "flaky")
    assert requeued.finished_at is None
    assert limited.claim("w2") is not None
    limited.fail(job.id, "w2", "flaky again", retry=True)  # attempts exhausted: failed for good
    failed = limited.get(tenant, job.id)
    assert failed is not None and (failed.status, failed.error, failed.attempts) == (JobStatus.FAILED, "flaky again", 2)


def test_fail_without_retry(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", REQUEST)
    assert store.claim("w1") is not None
    store.fail(job.id, "w1", "unknown model 'x'", retry=False)
    failed = store.get(tenant, job.id)
    assert failed is not None and (failed.status, failed.attempts) == (JobStatus.FAILED, 1)
    assert store.claim("w1") is None


def test_release_hands_the_job_back_without_an_attempt(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", REQUEST)
    assert store.claim("w1") is not None
    store.release(job.id, "w1")
    back = store.get(tenant, job.id)
    assert back is not None and (back.status, back.attempts) == (JobStatus.QUEUED, 0)
    assert store.claim("w2").attempts == 1  # type: ignore[union-attr]


def test_a_job_cancelled_while_its_worker_stops_is_cancelled_not_requeued(store: JobStore) -> None:
    # DELETE and SIGTERM at once: the worker hands back a job whose cancellation was already requested
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", REQUEST)
    assert store.claim("w1") is not None
    asked = store.cancel(tenant, job.id)
    assert asked is not None and asked.status == JobStatus.RUNNING
    store.release(job.id, "w1")
    final = store.get(tenant, job.id)
    assert final is not None and (final.status, final.message) == (JobStatus.CANCELLED, "cancelled")
    assert final.finished_at is not None and final.attempts == 1
    assert store.claim("w2") is None


def test_a_queued_job_left_with_a_cancel_request_is_reaped(store: JobStore) -> None:
    # such a row was left by workers that handed a cancelled job back to the queue: never claimed, never ended
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", REQUEST)
    with store.engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == job.id).values(cancel_requested=True))
    assert store.claim("w1") is None
    final = store.get(tenant, job.id)
    assert final is not None and final.status == JobStatus.CANCELLED and final.finished_at is not None


def test_cancel_queued_and_running(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    queued = store.submit(tenant, "plan", REQUEST)
    running = store.submit(tenant, "plan", REQUEST)
    cancelled = store.cancel(tenant, queued.id)
    assert cancelled is not None and cancelled.status == JobStatus.CANCELLED and cancelled.finished_at is not None
    claimed = store.claim("w1")
    assert claimed is not None and claimed.id == running.id  # the cancelled job is never claimed
    assert store.heartbeat(running.id, "w1", 0.2) is False
    asked = store.cancel(tenant, running.id)
    assert asked is not None and asked.status == JobStatus.RUNNING
    assert store.heartbeat(running.id, "w1", 0.3) is True
    store.mark_cancelled(running.id, "w1")
    final = store.get(tenant, running.id)
    assert final is not None and final.status == JobStatus.CANCELLED
    assert store.cancel(tenant, running.id).status == JobStatus.CANCELLED  # type: ignore[union-attr]


def test_cancel_of_a_running_job_whose_worker_died(store: JobStore) -> None:
    fast = short_lease(store)
    tenant = ensure_tenant(store.engine, "acme")
    job = fast.submit(tenant, "plan", REQUEST)
    assert fast.claim("w1") is not None
    fast.cancel(tenant, job.id)
    expire(fast)
    assert fast.claim("w2") is None
    assert fast.get(tenant, job.id).status == JobStatus.CANCELLED  # type: ignore[union-attr]


def test_fail_after_cancel_request_is_cancelled(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", REQUEST)
    assert store.claim("w1") is not None
    store.cancel(tenant, job.id)
    store.fail(job.id, "w1", "interrupted", retry=True)
    assert store.get(tenant, job.id).status == JobStatus.CANCELLED  # type: ignore[union-attr]


def test_tenants_see_only_their_own(store: JobStore) -> None:
    mine, theirs = ensure_tenant(store.engine, "acme"), ensure_tenant(store.engine, "globex")
    job = store.submit(mine, "plan", REQUEST)
    assert store.claim("w1") is not None
    store.complete(job.id, "w1", {"best": 1})
    assert store.get(theirs, job.id) is None
    assert store.result(theirs, job.id) is None
    assert store.cancel(theirs, job.id) is None
    assert store.list(theirs, 0, 10) == ([], 0)
    assert store.result(mine, job.id) == {"best": 1}
    trace = store.add_trace(mine, "a100 run", "/srv/traces/1", 12)
    assert store.traces(mine, [trace]) == ["/srv/traces/1"]
    assert store.traces(theirs, [trace]) is None
    assert store.traces(mine, [trace, "0" * 32]) is None


def test_list_pages_newest_first_and_counts(store: JobStore) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    ids = [store.submit(tenant, "plan", {"n": i}).id for i in range(5)]
    page, total = store.list(tenant, 1, 2)
    assert total == 5 and [j.id for j in page] == [ids[3], ids[2]]
    store.cancel(tenant, ids[0])
    assert store.claim("w") is not None
    assert store.counts() == {"queued": 3, "running": 1, "succeeded": 0, "failed": 0, "cancelled": 1}


def test_keys(engine: Engine) -> None:
    key = create_key(engine, "acme")
    admin_key = create_key(engine, "acme", admin=True)
    assert key.startswith("tp_") and len(key) == 35 and key != admin_key
    user, admin = authenticate(engine, key), authenticate(engine, admin_key)
    assert user is not None and (user.tenant, user.admin) == ("acme", False)
    assert admin is not None and admin.admin and admin.tenant_id == user.tenant_id
    with engine.connect() as conn:
        stored = conn.execute(select(ApiKey.key_hash, ApiKey.prefix)).all()
    assert {h for h, _ in stored} == {hash_key(key), hash_key(admin_key)}  # only hashes are kept
    assert {p for _, p in stored} == {key[:8], admin_key[:8]}
    assert authenticate(engine, key + "x") is None
    assert authenticate(engine, "not-a-key") is None
    assert revoke_key(engine, key) is True
    assert authenticate(engine, key) is None
    assert revoke_key(engine, key) is False
    assert authenticate(engine, admin_key) is not None
    other = authenticate(engine, create_key(engine, "globex"))
    assert other is not None and other.tenant_id != user.tenant_id


def test_tenant_names_are_checked(engine: Engine) -> None:
    with pytest.raises(SpecError, match="tenant"):
        create_key(engine, "")
    with pytest.raises(SpecError, match="tenant"):
        ensure_tenant(engine, "a b")
    assert ensure_tenant(engine, "acme") == ensure_tenant(engine, "acme")


def test_settings_from_env(tmp_path: Path) -> None:
    env = {"TAGPLAN_HOME": str(tmp_path), "TAGPLAN_MAX_EVALUATIONS": "10", "TAGPLAN_LEASE_S": "2.5"}
    settings = Settings.from_env(environ=env)
    assert settings.database_url == f"sqlite:///{tmp_path}/service.db"
    assert (settings.max_evaluations, settings.lease_s, settings.max_attempts) == (10, 2.5, 3)
    assert Settings.from_env(environ=settings.to_env()) == settings
    assert Settings.from_env(environ=env, max_attempts=5).max_attempts == 5
    with pytest.raises(SpecError, match="TAGPLAN_MAX_DEVICES='many'"):
        Settings.from_env(environ={**env, "TAGPLAN_MAX_DEVICES": "many"})
    with pytest.raises(SpecError, match="TAGPLAN_LEASE_S=0"):
        Settings.from_env(environ={**env, "TAGPLAN_LEASE_S": "0"})


def test_the_nesting_limit_is_fixed_not_a_setting(tmp_path: Path) -> None:
    # checked inside the body's validators, where no settings reach: a TAGPLAN_MAX_NESTING would change nothing
    assert "max_nesting" not in Settings.model_fields
    assert not any("NESTING" in name for name in Settings.from_env(environ={"TAGPLAN_HOME": str(tmp_path)}).to_env())
    deep: dict[str, Any] = {"name": "lab"}
    for _ in range(MAX_NESTING):
        deep = {"x": deep}
    with pytest.raises(ValidationError, match=f"nested deeper than {MAX_NESTING} levels"):
        PlanRequest.model_validate({"model": "gpt3-125m", "cluster": deep})


def test_get_settings_reads_the_environment_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tagplan.service.app import create_app
    from tagplan.service.settings import get_settings

    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path))
    monkeypatch.delenv("TAGPLAN_DATABASE_URL", raising=False)
    monkeypatch.setenv("TAGPLAN_MAX_LAYERS", "7")
    get_settings.cache_clear()
    try:
        assert get_settings() is get_settings() and get_settings().max_layers == 7
        app = create_app()  # what `uvicorn --factory` calls: the cached settings
        assert app.state.services.settings is get_settings()
        monkeypatch.setenv("TAGPLAN_MAX_LAYERS", "8")
        assert get_settings().max_layers == 7  # cached until cleared
        app.state.services.engine.dispose()
    finally:
        get_settings.cache_clear()
