"""Service settings, read once from the environment into a frozen dataclass.

Every limit has a `TAGPLAN_<FIELD>` variable (`TAGPLAN_MAX_EVALUATIONS`, `TAGPLAN_LEASE_S`, ...),
so an operator or a test tunes the service without code; worker processes get the pool's
settings back through `to_env()`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError

_PREFIX = "TAGPLAN_"


@dataclass(frozen=True)
class Settings:
    """Where the service keeps its state and how much one tenant or job may ask for."""

    database_url: str
    home: Path
    max_body_bytes: int = 2_000_000
    max_layers: int = 4096
    max_devices: int = 4096
    max_evaluations: int = 5000
    max_budget_s: float = 600.0
    max_global_batch: int = 65_536
    max_seq_len: int = 131_072
    max_spec_chars: int = 1000
    max_nesting: int = 32
    rate_per_minute: int = 60
    max_attempts: int = 3
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    job_timeout_s: float = 1800.0
    job_memory_bytes: int = 4 * 2**30
    max_queued_per_tenant: int = 1000
    max_running_per_tenant: int = 64
    max_traces_per_tenant: int = 200
    db_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, int | float) and not value > 0:
                raise SpecError(f"{_PREFIX}{name.upper()}={value}: must be positive")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `environ` (default `os.environ`), then `overrides` (field name -> value).

        `TAGPLAN_HOME` defaults to `~/.tagplan`; the database to `sqlite:///<home>/service.db`.
        SpecError names a variable whose value is not a number.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in fields(cls):
            raw = env.get(_PREFIX + field.name.upper())
            if raw is not None and field.name not in ("database_url", "home"):
                values[field.name] = _number(field.name, raw, type(field.default))
        values.update(overrides)
        home = Path(values.get("home") or env.get(_PREFIX + "HOME") or Path.home() / ".tagplan").expanduser()
        values["home"] = home
        values["database_url"] = (values.get("database_url") or env.get(_PREFIX + "DATABASE_URL")
                                  or f"sqlite:///{home / 'service.db'}")
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """These settings as `TAGPLAN_*` variables, for a worker process to read with `from_env`."""
        return {_PREFIX + name.upper(): str(value) for name, value in asdict(self).items()}


def _number(name: str, raw: str, kind: type) -> int | float:
    try:
        return int(raw) if kind is int else float(raw)
    except ValueError:
        expected = "a whole number" if kind is int else "a number"
        raise SpecError(f"{_PREFIX}{name.upper()}={raw!r}: expected {expected}") from None
