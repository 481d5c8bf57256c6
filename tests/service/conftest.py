"""Fixtures of the service tests: a fresh database per test (SQLite; PostgreSQL too when
`TAGPLAN_TEST_DATABASE_URL` is set), settings rooted in `tmp_path`, and worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from tagplan.service.db import make_engine
from tagplan.service.settings import Settings
from tagplan.service.store import TERMINAL, JobStore, JobView

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
