"""The service's tables (SQLAlchemy 2.0 ORM) and `make_engine`.

Portable on purpose: JSON is stored as text and timestamps as timezone-aware UTC datetimes
(`UTCDateTime`), so one code path runs on SQLite (a laptop, the tests) and PostgreSQL (a shared
deployment). SQLite runs in WAL mode with a busy timeout, so readers never block the writer and
concurrent writers from several worker processes wait for the lock instead of failing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Boolean,
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
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 30_000  # a writer waits this long for another process's write lock


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
                      Index("ix_jobs_tenant_created", "tenant_id", "created_at"))

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


def make_engine(url: str, *, timeout_s: float = SQLITE_BUSY_TIMEOUT_MS / 1000) -> Engine:
    """An engine for `url` with the tables created (SQLite: a 0600 file, WAL journal, any thread).

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
    engine = create_engine(parsed, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", functools.partial(_sqlite_pragmas, busy_ms=round(timeout_s * 1000)))
    _create_tables(engine)
    return engine


def _private_file(path: Path) -> None:
    """Create the SQLite file (and its directory) readable by this user only (0600; SQLite gives its
    -wal and -shm files the database file's mode), before SQLite creates it with the umask's."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _sqlite_pragmas(dbapi_connection: Any, _record: Any, *, busy_ms: int) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL mode
    cursor.close()


def _create_tables(engine: Engine, tries: int = 5) -> None:
    # Several worker processes start at once: two CREATE TABLEs can race; the loser retries.
    for attempt in range(tries):
        try:
            Base.metadata.create_all(engine)
            return
        except DatabaseError:
            if attempt == tries - 1:
                raise
            log.info("creating the service tables raced another process; retrying")
            time.sleep(0.2 * (attempt + 1))
