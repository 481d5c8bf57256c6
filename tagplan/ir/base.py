"""Shared base for IR records: frozen, strict pydantic models with exact JSON round-trip."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """A frozen, validated record; unknown keys are rejected so typos fail loudly."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A validated copy with `update` applied.

        Unlike pydantic's default, the copy is re-validated and starts with no cached
        properties, so derived tables (a node's pair links, a cluster's devices) never go stale.
        """
        data = {name: getattr(self, name) for name in type(self).model_fields}
        return self.model_validate({**data, **(update or {})})

    def to_json(self) -> str:
        """Return the record as compact JSON text (exact round-trip with `from_json`)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        """Parse and validate JSON text produced by `to_json` (or written by hand)."""
        return cls.model_validate_json(text)
