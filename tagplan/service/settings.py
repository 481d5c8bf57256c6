"""Service settings: `Settings` (pydantic-settings) from `TAGPLAN_*` variables, and `get_settings()`.

Every limit has a `TAGPLAN_<FIELD>` variable (`TAGPLAN_MAX_EVALUATIONS`, `TAGPLAN_LEASE_S`, ...),
so an operator or a test tunes the service without code; worker processes get the pool's
settings back through `to_env()`. One limit is fixed, not a setting: the nesting of an inline
object or of cluster YAML text (`requests.MAX_NESTING`, 32 levels), checked inside the request
body's validators, which no settings reach. `get_settings()` reads the environment once and
caches it (what `create_app()` and `uvicorn --factory` use); a test sets variables, then
`get_settings.cache_clear()`.
"""

from __future__ import annotations

import contextvars
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from tagplan.errors import SpecError

_PREFIX = "TAGPLAN_"
MAX_RETENTION_S = 100 * 365 * 86_400.0  # a century: "for ever", within what datetime can subtract from now
_ENVIRON: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("tagplan_environ", default=None)


def default_home() -> Path:
    """`~/.tagplan`: where the service keeps its state unless `TAGPLAN_HOME` says otherwise."""
    return Path.home() / ".tagplan"


class Settings(BaseSettings):
    """Where the service keeps its state and how much one tenant or job may ask for."""

    model_config = SettingsConfigDict(env_prefix=_PREFIX, frozen=True, extra="ignore", case_sensitive=False,
                                      allow_inf_nan=False)

    database_url: str = Field(default="", description="SQLAlchemy URL; default sqlite:///<home>/service.db")
    home: Path = Field(default_factory=default_home)
    max_body_bytes: int = Field(default=2_000_000, gt=0)
    max_layers: int = Field(default=4096, gt=0)
    max_devices: int = Field(default=4096, gt=0)
    max_evaluations: int = Field(default=5000, gt=0)
    max_budget_s: float = Field(default=600.0, gt=0)
    max_global_batch: int = Field(default=65_536, gt=0)
    max_seq_len: int = Field(default=131_072, gt=0)
    max_spec_chars: int = Field(default=1000, gt=0)
    rate_per_minute: int = Field(default=60, gt=0)
    max_attempts: int = Field(default=3, gt=0)
    lease_s: float = Field(default=30.0, gt=0)
    heartbeat_s: float = Field(default=5.0, gt=0)
    job_timeout_s: float = Field(default=1800.0, gt=0)
    job_memory_bytes: int = Field(default=4 * 2**30, gt=0)
    max_queued_per_tenant: int = Field(default=1000, gt=0)
    max_running_per_tenant: int = Field(default=64, gt=0)
    max_traces_per_tenant: int = Field(default=200, gt=0)
    max_training_records: int = Field(default=5000, gt=0, description="records a training run's traces may hold")
    job_retention_s: float = Field(default=30 * 86_400.0, gt=0, le=MAX_RETENTION_S,
                                   description="how long a finished job (request, result) is kept after it ended")
    max_finished_jobs_per_tenant: int = Field(default=10_000, gt=0,
                                              description="a tenant's newest finished jobs kept; older are deleted")
    max_versions_per_tenant: int = Field(default=20, gt=0,
                                         description="GNN versions a tenant's registry keeps (and its active one)")
    purge_every_s: float = Field(default=300.0, gt=0, description="how often each worker deletes expired jobs")
    db_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("home")
    @classmethod
    def _expand(cls, home: Path) -> Path:
        return home.expanduser()

    @model_validator(mode="before")
    @classmethod
    def _default_database(cls, data: Any) -> Any:
        """The database defaults to a SQLite file in `home`."""
        if isinstance(data, dict) and not data.get("database_url"):
            home = Path(data.get("home") or default_home()).expanduser()
            data = {**data, "database_url": f"sqlite:///{home / 'service.db'}"}
        return data

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments, then the environment (`from_env`'s mapping when it gives one); no .env files."""
        environ = _ENVIRON.get()
        return init_settings, env_settings if environ is None else _MappingSource(settings_cls, environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `environ` (default `os.environ`), then `overrides` (field name -> value).

        `TAGPLAN_HOME` defaults to `~/.tagplan`; the database to `sqlite:///<home>/service.db`.
        SpecError names a variable whose value is not a number, or not positive.
        """
        token = _ENVIRON.set(environ)
        try:
            return cls(**overrides)
        except ValidationError as err:
            raise SpecError("; ".join(_described(e) for e in err.errors())) from None
        finally:
            _ENVIRON.reset(token)

    def to_env(self) -> dict[str, str]:
        """These settings as `TAGPLAN_*` variables, for a worker process to read with `from_env`."""
        return {_PREFIX + name.upper(): str(value) for name, value in self.model_dump().items()}


@functools.cache
def get_settings() -> Settings:
    """The settings of this process's environment, read once (tests: `get_settings.cache_clear()`)."""
    return Settings.from_env()


class _MappingSource(EnvSettingsSource):
    """The environment source, reading a given mapping instead of `os.environ`."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value for name, value in self._environ.items()}


def _described(error: Any) -> str:
    """`TAGPLAN_LEASE_S=0: must be positive`, `TAGPLAN_MAX_DEVICES='many': expected a whole number`."""
    name = str(error["loc"][0]) if error.get("loc") else "?"
    variable, value = _PREFIX + name.upper(), error.get("input")
    if error.get("type") == "greater_than":
        return f"{variable}={value}: must be positive"
    kind = Settings.model_fields[name].annotation if name in Settings.model_fields else None
    expected = {int: "a whole number", float: "a number", "int": "a whole number", "float": "a number"}.get(
        kind, str(error.get("msg", "invalid")))
    return f"{variable}={value!r}: expected {expected}"


def private_files() -> None:
    """Make everything this process creates from now on its owner's alone (umask 077: folders 0700, files 0600): the
    database, uploaded traces, tenants' GNN versions. Every service process calls it as it starts (`tagplan serve`,
    `worker`, `admin`, `create_app`)."""
    os.umask(0o077)
