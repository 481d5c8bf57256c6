"""Fixtures of the service tests: a fresh database per test (SQLite; PostgreSQL too when
`TAGPLAN_TEST_DATABASE_URL` is set), settings rooted in `tmp_path`, worker processes, and the
HTTP API in-process (`TestClient`) with three tenants' keys."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from tagplan.service.app import create_app
from tagplan.service.db import make_engine
from tagplan.service.keys import create_key
from tagplan.service.settings import Settings
from tagplan.service.store import JobStore, JobView
from tagplan.service.vocabulary import TERMINAL, JobStatus
from tagplan.service.worker import run_worker

PG_ENV = "TAGPLAN_TEST_DATABASE_URL"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of its own for one test: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'service.db'}"
        return
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} not set")
    schema = f"test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def settings(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings rooted in `tmp_path` (also `TAGPLAN_HOME`, so nothing touches ~/.tagplan)."""
    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path))
    return Settings.from_env(environ={}, home=tmp_path, database_url=database_url)


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    """An engine on the test's database, tables created."""
    engine = make_engine(settings.database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def store(engine: Engine, settings: Settings) -> JobStore:
    """A JobStore on the test's database."""
    return JobStore(engine, settings)


WaitFor = Callable[..., JobView]


def _wait_for(store: JobStore, tenant_id: int, job_id: str, done: Callable[[JobView], bool] | None = None, *,
              timeout_s: float = 120.0) -> JobView:
    """Poll the job until `done(job)` (default: it finished); fails the test after `timeout_s`."""
    done = done or (lambda job: job.status in TERMINAL)
    deadline = time.monotonic() + timeout_s
    while True:
        job = store.get(tenant_id, job_id)
        assert job is not None
        if done(job):
            return job
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still {job.status} ({job.message}) after {timeout_s:.0f} s")
        time.sleep(0.1)


@pytest.fixture
def wait_for() -> WaitFor:
    """`wait_for(store, tenant_id, job_id, done=finished, timeout_s=120) -> JobView`."""
    return _wait_for


class Workers:
    """Worker processes started by one test; all stopped (SIGKILL if need be) at its end."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings, self.log_dir = settings, log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, settings: Settings | None = None) -> subprocess.Popen[bytes]:
        """One more `python -m tagplan.service.worker` on the test's database (with `settings`' limits)."""
        env = {**os.environ, **(settings or self.settings).to_env()}
        log = (self.log_dir / f"worker-{len(self.procs)}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "tagplan.service.worker"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        """Every worker's log, for a failing assertion's message."""
        return "\n".join(p.read_text() for p in sorted(self.log_dir.glob("worker-*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def workers(settings: Settings, tmp_path: Path) -> Iterator[Workers]:
    """Starts worker processes on demand; stops them after the test."""
    pool = Workers(settings, tmp_path)
    yield pool
    pool.stop()


# -- the HTTP API in-process -----------------------------------------------------------------------

TINY = {"model": "gpt?layers=4&hidden=256&heads=4&vocab=100", "cluster": "p3.8xlarge",
        "workload": {"global_batch": 8, "seq_len": 64}, "max_evaluations": 20, "budget_s": 20}


@pytest.fixture
def make_settings(tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Settings]:
    """`make_settings(**limits) -> Settings` on the test's database and home."""
    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path))

    def make(**overrides: Any) -> Settings:
        return Settings(database_url=database_url, home=tmp_path, **overrides)

    return make


@dataclass
class Keys:
    """API keys of two tenants and an admin."""

    a: str
    b: str
    admin: str
    tenant_a: str


@pytest.fixture
def keys(make_settings: Callable[..., Settings]) -> Iterator[Keys]:
    engine = make_engine(make_settings().database_url)
    suffix = uuid.uuid4().hex[:8]
    yield Keys(a=create_key(engine, f"acme-{suffix}"), b=create_key(engine, f"globex-{suffix}"),
               admin=create_key(engine, f"ops-{suffix}", admin=True), tenant_a=f"acme-{suffix}")
    engine.dispose()


class Api:
    """Helpers of the API tests (a fixture, since test modules import nothing from conftest)."""

    TINY = TINY

    @staticmethod
    def client_for(settings: Settings) -> TestClient:
        return TestClient(create_app(settings))

    @staticmethod
    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    @staticmethod
    def submit(client: TestClient, key: str, body: dict[str, Any] | None = None, path: str = "/v1/plans") -> Any:
        """POST a plan (default `TINY`); asserts the 202 and returns the job."""
        answer = client.post(path, json=body or TINY, headers=Api.auth(key))
        assert answer.status_code == 202, answer.text
        return answer.json()

    @staticmethod
    def run_until_finished(settings: Settings, job_id: str, client: TestClient, key: str) -> dict[str, Any]:
        """Run queued jobs in this process until `job_id` has finished (on a shared database, jobs
        left queued by earlier tests may come first)."""
        while True:
            job = client.get(f"/v1/jobs/{job_id}", headers=Api.auth(key)).json()
            if job["status"] in {s.value for s in TERMINAL}:
                return dict(job)
            assert run_worker(settings, once=True, poll_s=0.05) == 1, f"no job to run, yet {job_id} is {job['status']}"


@pytest.fixture
def api() -> type[Api]:
    """`Api`: auth, submit, run_until_finished, client_for, TINY."""
    return Api


@pytest.fixture
def client(make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    """The app on the test's settings."""
    with Api.client_for(make_settings()) as c:
        yield c


@pytest.fixture
def finished(make_settings: Callable[..., Settings], client: TestClient, keys: Keys) -> dict[str, Any]:
    """A TINY plan of tenant a, run to success by an in-process worker: its job JSON."""
    job = Api.submit(client, keys.a)
    done = Api.run_until_finished(make_settings(), job["id"], client, keys.a)
    assert done["status"] == JobStatus.SUCCEEDED, done
    return done
