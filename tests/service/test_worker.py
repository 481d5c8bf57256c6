"""Worker processes against a real database: plans run to the end, survive `kill -9`, are not run
twice under 50 concurrent submissions, fail cleanly on bad requests, stop when cancelled.
(What a job does is in tests/service/jobs/, the request model in test_requests.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from tagplan.service.keys import ensure_tenant
from tagplan.service.settings import Settings
from tagplan.service.store import JobStore, JobView
from tagplan.service.vocabulary import JobKind, JobStatus
from tagplan.service.worker import WorkerPool

# Worker processes share one SQLite file here; PostgreSQL's share of the races is in test_store.py.
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

TINY_PLAN = {"model": "gpt?layers=2&hidden=64&heads=4&vocab=100", "cluster": "p3.8xlarge",
             "workload": {"global_batch": 8, "seq_len": 16}, "max_evaluations": 20}
# long enough to be stopped mid-search (5000 evaluations take minutes here), bounded by its 10 s budget where a
# test lets it finish
LONG_PLAN = {"model": "gpt3-1.3b", "cluster": "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1",
             "workload": {"global_batch": 8}, "max_evaluations": 5000, "budget_s": 10}


@pytest.fixture
def fast_settings(settings: Settings) -> Settings:
    """A 2 s lease renewed every 0.25 s: a dead worker's job is taken over within seconds."""
    return settings.model_copy(update={"lease_s": 2.0, "heartbeat_s": 0.25})


def test_worker_runs_a_plan(store: JobStore, workers: Any, wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, JobKind.PLAN, TINY_PLAN)
    workers.start()
    done = wait_for(store, tenant, job.id)
    assert done.status == JobStatus.SUCCEEDED, workers.logs()
    assert (done.attempts, done.progress, done.error) == (1, 1.0, None)
    result = store.result(tenant, job.id)
    assert result is not None
    assert {"best", "pareto", "baselines", "timeline", "search", "request"} <= set(result)
    assert result["best"]["report"]["iteration_time_s"] > 0
    assert result["timeline"]["traceEvents"]
    assert result["request"]["workload"] == {"global_batch": 8, "seq_len": 16, "dtype": "bf16", "optimizer": "adam",
                                             "grad_reduce_dtype": "bf16", "grad_reduce_overlap": True,
                                             "tp_comm_overlap": False, "fused_attention": None,
                                             "loss": "eager", "eager": None}  # fused kernels


def searching(job: JobView) -> bool:
    """A heartbeat has reported the search's progress."""
    return job.status == JobStatus.RUNNING and job.progress > 0


@pytest.mark.slow
def test_a_killed_worker_s_job_is_finished_by_another(fast_settings: Settings, store: JobStore, workers: Any,
                                                      wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, JobKind.PLAN, LONG_PLAN)
    first = workers.start(fast_settings)
    wait_for(store, tenant, job.id, searching)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    workers.start(fast_settings)
    done = wait_for(store, tenant, job.id, timeout_s=180)
    assert done.status == JobStatus.SUCCEEDED, workers.logs()
    assert done.attempts == 2
    assert store.result(tenant, job.id) is not None
    assert store.counts()["succeeded"] == 1


@pytest.mark.slow
def test_fifty_concurrent_submissions_two_workers(store: JobStore, workers: Any, wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    request = {**TINY_PLAN, "max_evaluations": 5}
    ids: list[str] = []
    lock = threading.Lock()

    def submit(n: int) -> None:
        job = store.submit(tenant, JobKind.PLAN, {**request, "seed": n})
        with lock:
            ids.append(job.id)

    threads = [threading.Thread(target=submit, args=(n,)) for n in range(50)]
    workers.start()
    workers.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 50
    views = [wait_for(store, tenant, job_id, timeout_s=180) for job_id in ids]
    assert [v.status for v in views] == [JobStatus.SUCCEEDED] * 50, workers.logs()
    assert all(v.attempts == 1 for v in views)  # no job was claimed twice
    seeds = sorted(store.result(tenant, i)["request"]["seed"] for i in ids)  # type: ignore[index]
    assert seeds == list(range(50))
    assert store.counts() == {"queued": 0, "running": 0, "succeeded": 50, "failed": 0, "cancelled": 0}


def test_a_bad_request_fails_without_retry(store: JobStore, workers: Any, wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, JobKind.PLAN, {**TINY_PLAN, "model": "gpt5-huge"})
    workers.start()
    done = wait_for(store, tenant, job.id)
    assert (done.status, done.attempts) == (JobStatus.FAILED, 1), workers.logs()
    assert done.error is not None and "gpt5-huge" in done.error
    assert done.error.startswith("plan request: model: ")  # the API's model, read back by the worker


@pytest.mark.slow
def test_cancel_reaches_the_search(fast_settings: Settings, store: JobStore, workers: Any, wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, JobKind.PLAN, LONG_PLAN)
    workers.start(fast_settings)
    wait_for(store, tenant, job.id, searching)
    store.cancel(tenant, job.id)
    done = wait_for(store, tenant, job.id, timeout_s=30)
    assert done.status == JobStatus.CANCELLED, workers.logs()
    assert done.progress < 0.99  # stopped inside the search, not after it
    assert store.result(tenant, job.id) is None


@pytest.mark.slow
def test_sigterm_hands_the_running_job_back(fast_settings: Settings, store: JobStore, workers: Any,
                                            wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, JobKind.PLAN, LONG_PLAN)
    worker = workers.start(fast_settings)
    wait_for(store, tenant, job.id, searching)
    worker.terminate()
    assert worker.wait(30) == 0, workers.logs()
    back = store.get(tenant, job.id)
    assert back is not None and (back.status, back.attempts) == (JobStatus.QUEUED, 0), workers.logs()


@pytest.mark.slow
def test_a_job_cancelled_as_its_worker_stops_ends_cancelled(fast_settings: Settings, store: JobStore, workers: Any,
                                                            wait_for: Any) -> None:
    # DELETE and SIGTERM at once: the stopping worker hands the job back before it sees the cancel
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, JobKind.PLAN, LONG_PLAN)
    worker = workers.start(fast_settings)
    wait_for(store, tenant, job.id, searching)
    store.cancel(tenant, job.id)
    worker.terminate()
    assert worker.wait(30) == 0, workers.logs()
    final = store.get(tenant, job.id)
    assert final is not None and final.status == JobStatus.CANCELLED, (final, workers.logs())
    assert store.claim("w2") is None


def test_pool_restarts_a_dead_worker_and_stops(settings: Settings) -> None:
    pool = WorkerPool(settings, 2)
    pool.start()
    try:
        first = pool.pids()
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (now := pool.pids()) == first or len(now) < 2:
            assert time.monotonic() < deadline, "the pool did not restart its dead worker"
            time.sleep(0.2)
        assert first[1] in now and first[0] not in now
    finally:
        pool.stop()
    assert pool.pids() == []


def test_errors_a_tenant_reads_do_not_say_where_the_server_keeps_its_files(settings: Settings) -> None:
    from tagplan.service.worker import redacted

    folder = settings.home / "tenants" / "1" / "registry" / "versions" / "v0007"
    text = redacted(f"FileExistsError: [Errno 17] File exists: '{folder}' and '{folder.resolve()}'", settings)
    assert text == ("FileExistsError: [Errno 17] File exists: '$TAGPLAN_HOME/tenants/1/registry/versions/v0007' "
                    "and '$TAGPLAN_HOME/tenants/1/registry/versions/v0007'")
