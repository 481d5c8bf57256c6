"""The schema's Alembic migrations (`service/db.py` `migrate`, `service/migrations/`): a database at
the old schema keeps its jobs through the upgrade; a pre-migration `create_all` database is
upgraded too; the newest revision is exactly the ORM's tables; processes starting at once agree."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient

from tagplan.service import db
from tagplan.service.app import create_app
from tagplan.service.settings import Settings


def _old_database(url: str) -> tuple[str, str]:
    """A database at revision 0001 (before idempotency keys) holding one tenant, its key and a job."""
    from tagplan.service.keys import create_key

    engine = sa.create_engine(url)
    db.migrate(engine, db.INITIAL_REVISION)
    key = create_key(engine, "acme")
    job_id = "0" * 31 + "1"
    with engine.begin() as conn:
        tenant = conn.execute(sa.text("SELECT id FROM tenants WHERE name = 'acme'")).scalar_one()
        conn.execute(sa.text(
            "INSERT INTO jobs (id, tenant_id, kind, status, request, progress, message, attempts, max_attempts, "
            "cancel_requested, created_at) VALUES (:id, :tenant, 'plan', 'queued', :request, 0, 'queued', 0, 3, "
            ":no, :now)"), {"id": job_id, "tenant": tenant, "request": json.dumps({"model": "gpt3-125m"}),
                            "no": False, "now": db.utcnow()})
    engine.dispose()
    return key, job_id


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_the_service_upgrades_an_old_database_and_keeps_its_jobs(settings: Settings) -> None:
    key, job_id = _old_database(settings.database_url)
    assert "idempotency_keys" not in _tables(settings.database_url)
    with TestClient(create_app(settings)) as client:  # the service starts: it migrates
        job = client.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
        assert job.status_code == 200 and job.json()["status"] == "queued", job.text
        retried = [client.post("/v1/plans", json={"model": "gpt3-125m", "cluster": "p3.8xlarge"},
                               headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "k1"}) for _ in "ab"]
        assert retried[0].json()["id"] == retried[1].json()["id"]
    assert "idempotency_keys" in _tables(settings.database_url)
    engine = sa.create_engine(settings.database_url)
    assert db.schema_revision(engine) == db.head_revision()
    engine.dispose()


def test_a_database_made_before_migrations_is_upgraded(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'service.db'}"
    engine = sa.create_engine(url)
    old = [t for name, t in db.Base.metadata.tables.items() if name != "idempotency_keys"]
    db.Base.metadata.create_all(engine, tables=old)  # what make_engine did before migrations
    with engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_jobs_status_finished"))  # revision 0003's: not there yet
        conn.execute(sa.text("INSERT INTO tenants (name, created_at) VALUES ('acme', :now)"), {"now": db.utcnow()})
    engine.dispose()
    engine = db.make_engine(url)
    assert db.schema_revision(engine) == db.head_revision()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT name FROM tenants")).scalars().all() == ["acme"]
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one() == 0
    engine.dispose()


def test_the_newest_revision_is_the_orm_s_schema(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                       db.Base.metadata)
    assert differences == []


def _open_when_told(url: str, go: Any) -> None:
    go.wait()
    db.make_engine(url).dispose()


def test_processes_starting_at_once_migrate_once(tmp_path: Path) -> None:
    """Six processes open each new database file at the same instant, forty times over. Two
    connections switching a new file to WAL at once deadlock in the rollback journal's locks and
    SQLite fails one at once ("database is locked"; before the switch was made under the file's
    lock, these forty rounds failed it in five runs of five)."""
    forked = multiprocessing.get_context("fork")
    for round_ in range(40):
        url = f"sqlite:///{tmp_path / f'service{round_}.db'}"
        go = forked.Event()
        procs = [forked.Process(target=_open_when_told, args=(url, go)) for _ in range(6)]
        for p in procs:
            p.start()
        go.set()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0] * 6, f"round {round_}"
        engine = sa.create_engine(url)
        assert db.schema_revision(engine) == db.head_revision()
        engine.dispose()


def test_the_migrations_ship_with_the_package() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"**/*.mako"' in pyproject and '"**/*.ini"' in pyproject
    assert (db.MIGRATIONS_DIR / "env.py").is_file() and (db.MIGRATIONS_DIR / "script.py.mako").is_file()
