"""Worker processes against a real database: plans run to the end, survive `kill -9`, are not run
twice under 50 concurrent submissions, fail cleanly on bad requests, stop when cancelled; and the
request validation the worker and the API share."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tagplan.errors import SpecError
from tagplan.service.execute import LimitError, parse_plan_request, run_job, validate_plan_request
from tagplan.service.keys import ensure_tenant
from tagplan.service.settings import Settings
from tagplan.service.store import JobStatus, JobStore, JobView
from tagplan.service.worker import WorkerPool

# Worker processes share one SQLite file here; PostgreSQL's share of the races is in test_store.py.
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

TINY_PLAN = {"model": "gpt?layers=2&hidden=64&heads=4&vocab=100", "cluster": "p3.8xlarge",
             "workload": {"global_batch": 8, "seq_len": 16}, "max_evaluations": 20}
LONG_PLAN = {"model": "gpt3-1.3b", "cluster": "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1",
             "workload": {"global_batch": 8}, "max_evaluations": 400, "budget_s": 120}


@pytest.fixture
def fast_settings(settings: Settings) -> Settings:
    """A 2 s lease renewed every 0.25 s: a dead worker's job is taken over within seconds."""
    return dataclasses.replace(settings, lease_s=2.0, heartbeat_s=0.25)


def test_worker_runs_a_plan(store: JobStore, workers: Any, wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", TINY_PLAN)
    workers.start()
    done = wait_for(store, tenant, job.id)
    assert done.status == JobStatus.SUCCEEDED, workers.logs()
    assert (done.attempts, done.progress, done.error) == (1, 1.0, None)
    result = store.result(tenant, job.id)
    assert result is not None
    assert {"best", "pareto", "baselines", "timeline", "search", "request"} <= set(result)
    assert result["best"]["report"]["iteration_time_s"] > 0
    assert result["timeline"]["traceEvents"]
    assert result["request"]["workload"] == {"global_batch": 8, "seq_len": 16, "dtype": "bf16", "optimizer": "adam"}


def searching(job: JobView) -> bool:
    """A heartbeat has reported the search's progress."""
    return job.status == JobStatus.RUNNING and job.progress > 0


@pytest.mark.slow
def test_a_killed_worker_s_job_is_finished_by_another(fast_settings: Settings, store: JobStore, workers: Any,
                                                      wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", LONG_PLAN)
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
        job = store.submit(tenant, "plan", {**request, "seed": n})
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
    job = store.submit(tenant, "plan", {**TINY_PLAN, "model": "gpt5-huge"})
    workers.start()
    done = wait_for(store, tenant, job.id)
    assert (done.status, done.attempts) == (JobStatus.FAILED, 1), workers.logs()
    assert done.error is not None and "gpt5-huge" in done.error


@pytest.mark.slow
def test_cancel_reaches_the_search(fast_settings: Settings, store: JobStore, workers: Any, wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "acme")
    job = store.submit(tenant, "plan", LONG_PLAN)
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
    job = store.submit(tenant, "plan", LONG_PLAN)
    worker = workers.start(fast_settings)
    wait_for(store, tenant, job.id, searching)
    worker.terminate()
    assert worker.wait(30) == 0, workers.logs()
    back = store.get(tenant, job.id)
    assert back is not None and (back.status, back.attempts) == (JobStatus.QUEUED, 0), workers.logs()


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


# -- the request checks the API runs at submit time and the worker again ----------------------------


def limit_error(request: dict[str, Any], settings: Settings) -> LimitError:
    with pytest.raises(LimitError) as caught:
        validate_plan_request(request, settings)
    return caught.value


def test_limits_name_the_limit(settings: Settings) -> None:
    small = dataclasses.replace(settings, max_budget_s=10.0, max_evaluations=50, max_layers=6, max_devices=8)
    cases = {"max_budget_s": {**TINY_PLAN, "budget_s": 11},
             "max_evaluations": {**TINY_PLAN, "max_evaluations": 51},
             "max_layers": {**TINY_PLAN, "model": "gpt?layers=7&hidden=64&heads=4&vocab=100"},
             "max_devices": {**TINY_PLAN, "cluster": "p3.8xlarge:nodes=3"}}
    for limit, request in cases.items():
        err = limit_error(request, small)
        assert (err.limit, err.status) == (limit, 422)
        assert str(getattr(small, limit)).rstrip("0").rstrip(".") in str(err)
    huge_spec = {**TINY_PLAN, "cluster": "p3.8xlarge:nodes=1000000000"}  # refused before building a node
    assert limit_error(huge_spec, small).limit == "max_devices"
    graph = {"blocks": {"b": {"kind": "mlp", "ops": [{"kind": "matmul", "flops": 1}], "output_bytes": 1}},
             "layers": [{"block": "b", "repeat": 10**9}]}
    assert limit_error({**TINY_PLAN, "model": graph}, small).limit == "max_layers"
    validate_plan_request(TINY_PLAN, small)


@pytest.mark.parametrize(("change", "names"), [
    ({"model": "gpt5-huge"}, "gpt5-huge"),
    ({"model": "/etc/passwd"}, "file path"),
    ({"cluster": "../cluster.yaml"}, "file path"),
    ({"cluster": "p3.8xlarge:gpu=/tmp/gpu.yaml"}, "file path"),
    ({"cluster": 7}, "cluster: int"),
    ({"workload": {"global_batch": 0}}, "global_batch"),
    ({"workload": {"batch": 8}}, "batch"),
    ({"objective": "fastest"}, "fastest"),
    ({"budget_s": -1}, "budget_s"),
    ({"max_evaluations": 2.5}, "max_evaluations"),
    ({"calibration": "/etc/calibration.json"}, "calibration"),
    ({"colour": "red"}, "colour"),
])
def test_bad_requests_are_spec_errors(settings: Settings, change: dict[str, Any], names: str) -> None:
    with pytest.raises(SpecError, match=names):
        validate_plan_request({**TINY_PLAN, **change}, settings)


def test_inline_cluster_object_and_yaml_text(settings: Settings) -> None:
    cluster = {"name": "lab", "node_groups": [{"preset": "p3.8xlarge", "nodes": 2}]}
    as_object = parse_plan_request({**TINY_PLAN, "cluster": cluster}, settings)
    text = "name: lab\nnode_groups:\n  - {preset: p3.8xlarge, nodes: 2}\n"
    as_yaml = parse_plan_request({**TINY_PLAN, "cluster": text}, settings)
    assert as_object.cluster.num_devices == as_yaml.cluster.num_devices == 8
    defaults = parse_plan_request({"model": "gpt3-125m", "cluster": "p3.8xlarge"}, settings).request
    assert (defaults["budget_s"], defaults["max_evaluations"], defaults["objective"]) == (30.0, 400, "time")


def test_run_job_reports_progress_and_stops_when_cancelled(settings: Settings) -> None:
    seen: list[tuple[float, str]] = []

    class StopError(Exception):
        pass

    def progress(fraction: float, message: str) -> None:
        seen.append((fraction, message))
        if message.startswith("evaluations 3/"):
            raise StopError

    with pytest.raises(StopError):
        run_job("plan", {**TINY_PLAN, "max_evaluations": 20}, settings, progress)
    assert seen[-1][1] == "evaluations 3/20" and 0 < seen[-1][0] < 1
    with pytest.raises(SpecError, match="kind"):
        run_job("sleep", {}, settings, progress)


BUNDLE = Path(__file__).parents[1] / "fixtures" / "traces" / "cpu-quick"


@pytest.mark.slow
def test_training_job_registers_a_version_in_the_service_home(settings: Settings) -> None:
    uploaded = settings.home / "traces" / "1" / "cpu-quick"
    shutil.copytree(BUNDLE, uploaded)
    messages: list[str] = []
    card = run_job("train", {"traces": [str(uploaded)]}, settings, lambda _f, m: messages.append(m))
    assert card["version"] == "v0001" and (settings.home / "registry" / "versions" / "v0001" / "model.pt").exists()
    assert messages[-1] == "registered"
    with pytest.raises(SpecError, match="not a trace bundle uploaded"):
        run_job("train", {"traces": [str(BUNDLE)]}, settings, lambda _f, _m: None)
    with pytest.raises(SpecError, match="traces"):
        run_job("train", {"traces": []}, settings, lambda _f, _m: None)
