"""The service's tables (SQLAlchemy 2.0 ORM), `make_engine` and `migrate` (Alembic, `migrations/`).

Portable on purpose: JSON is stored as text and timestamps as timezone-aware UTC datetimes
(`UTCDateTime`), so one code path runs on SQLite (a laptop, the tests) and PostgreSQL (a shared
deployment). SQLite runs in WAL mode with a busy timeout, so readers never block the writer and
concurrent writers from several worker processes wait for the lock instead of failing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import functools
import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Boolean,
    Connection,
    DateTime,
    Dialect,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 30_000  # a writer waits this long for another process's write lock
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
INITIAL_REVISION = "0001"  # the schema `create_all` made before migrations
MIGRATION_LOCK_KEY = 0x7461_6770_6C61_6E  # PostgreSQL advisory lock id ("tagplan")


def utcnow() -> dt.datetime:
    """The current time, timezone-aware UTC (what every timestamp column holds)."""
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC datetime on every backend.

    SQLite has no time zones: values are stored as naive UTC text (which sorts and compares in
    time order) and read back with `tzinfo=UTC`; PostgreSQL stores `timestamptz`.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the service stores timezone-aware UTC times")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    """Declarative base of the service's tables."""


class Tenant(Base):
    """A team sharing the service; owns keys, jobs and traces."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    """An API key, stored as its sha256 hex digest; `prefix` (its first 8 characters) identifies it."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Job(Base):
    """A plan or training request and its life: queued -> running -> succeeded | failed | cancelled.

    `request` and `result` are JSON text. `lease_owner`/`lease_expires_at` say which worker runs
    it until when; `attempts` counts claims (it doubles as a version number in claim's UPDATE).
    """

    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_created", "status", "created_at"),
                      Index("ix_jobs_tenant_created", "tenant_id", "created_at"),
                      Index("ix_jobs_status_finished", "status", "finished_at"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    request: Mapped[str] = mapped_column(Text)
    result: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    message: Mapped[str] = mapped_column(Text, default="")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Trace(Base):
    """An uploaded `tagplan-traces/1` bundle, stored on disk at `path`."""

    __tablename__ = "traces"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    path: Mapped[str] = mapped_column(Text)
    records: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class IdempotencyKey(Base):
    """A tenant's `Idempotency-Key` and what its first request made: a retried POST with the same
    key and body gets that job (or trace) back instead of a second one.

    `route` and `body_sha256` (of the canonical request) tell a retry from a different request
    reusing the key; exactly one of `job_id` and `trace_id` is set.
    """

    __tablename__ = "idempotency_keys"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    route: Mapped[str] = mapped_column(String(100))
    body_sha256: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), nullable=True)
    trace_id: Mapped[str | None] = mapped_column(ForeignKey("traces.id"), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


def make_engine(url: str, *, timeout_s: float = SQLITE_BUSY_TIMEOUT_MS / 1000) -> Engine:
    """An engine for `url` with the schema migrated to the newest revision (`migrate`; SQLite: a 0600
    file, WAL journal, any thread).

    `timeout_s` bounds how long a statement waits for the database (SQLite: another process's
    write lock; PostgreSQL: connecting, and a pooled connection); past it the statement fails and
    the API answers 503.
    """
    parsed = make_url(url)
    kwargs: dict[str, Any] = {"pool_pre_ping": True, "pool_timeout": timeout_s}
    if parsed.get_backend_name() == "postgresql":
        kwargs["connect_args"] = {"connect_timeout": max(1, round(timeout_s))}
    if parsed.get_backend_name() == "sqlite":
        kwargs = {"connect_args": {"check_same_thread": False, "timeout": timeout_s}}
        if parsed.database and parsed.database != ":memory:":
            _private_file(Path(parsed.database).expanduser())
            _journal_in_wal(Path(parsed.database).expanduser(), timeout_s)
    engine = create_engine(parsed, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", functools.partial(_sqlite_pragmas, busy_ms=round(timeout_s * 1000)))
    migrate(engine)
    return engine


def _private_file(path: Path) -> None:
    """Create the SQLite file (and its directory) readable by this user only (0600; SQLite gives its
    -wal and -shm files the database file's mode), before SQLite creates it with the umask's."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _journal_in_wal(path: Path, timeout_s: float) -> None:
    """Switch the SQLite file to the WAL journal once, under the file's lock.

    WAL mode is kept in the file; switching needs an exclusive lock, and two connections switching
    a new file at once deadlock in the rollback journal's locks, where SQLite fails one of them at
    once ("database is locked") rather than wait. Under the lock the first process switches the
    file and the others find it switched, so every connection's own `PRAGMA journal_mode=WAL`
    (`_sqlite_pragmas`) is then a no-op.
    """
    with _file_lock(path):
        conn = sqlite3.connect(path, timeout=timeout_s)
        try:
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
        finally:
            conn.close()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any, *, busy_ms: int) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL mode
    cursor.close()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the database's schema to `revision` with the Alembic migrations in `migrations/`.

    Every process that opens the database calls it (`make_engine`: the API, each worker, the CLI),
    so several start at once: the upgrade runs under a lock (PostgreSQL: an advisory lock held by
    the migration's transaction; SQLite: `flock` on `<file>-migrate.lock`), and who gets it second
    finds the schema current and does nothing. A database made by `create_all` before migrations
    existed (tables, no `alembic_version`) is taken as the initial revision and upgraded from it.
    """
    if revision == "head" and schema_revision(engine) == head_revision():
        return
    with _migration_lock(engine), engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        config = _alembic_config(conn)
        if MigrationContext.configure(conn).get_current_revision() is None and inspect(conn).has_table("jobs"):
            log.info("database made before migrations: taking it as revision %s", INITIAL_REVISION)
            command.stamp(config, INITIAL_REVISION)
        command.upgrade(config, revision)


def schema_revision(engine: Engine) -> str | None:
    """The database's Alembic revision (None: no schema, or one made before migrations)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    """The newest revision in `migrations/versions/`: what `migrate` brings a database to."""
    head = _scripts().get_current_head()
    assert head is not None, f"no migrations in {MIGRATIONS_DIR}"
    return head


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory(str(MIGRATIONS_DIR))


def _alembic_config(conn: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes.update(connection=conn, target_metadata=Base.metadata)
    return config


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """Across processes on this machine, for a SQLite file; PostgreSQL locks in `migrate` itself."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        yield
        return
    with _file_lock(Path(database).expanduser()):
        yield


@contextlib.contextmanager
def _file_lock(database: Path) -> Iterator[None]:
    """`flock` on `<file>-migrate.lock`: one process at a time on this machine changes the file."""
    fd = os.open(database.with_name(database.name + "-migrate.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
