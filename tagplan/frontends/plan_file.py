"""Reading Plan JSON v1 files (docs/PLAN_FORMAT.md) with errors that name the stage and field."""

from __future__ import annotations

from pydantic import ValidationError

from tagplan.errors import from_validation
from tagplan.frontends.textfile import parse_structured, read_text
from tagplan.ir.plan import Plan


def load_plan(path: str) -> Plan:
    """The plan in the JSON (or YAML) file at `path`; SpecError naming the stage and field if invalid."""
    data = parse_structured(read_text(path), path)
    if isinstance(data, dict) and "plan" in data and "stages" not in data:
        data = data["plan"]  # a `tagplan plan --json` result's best entry, or {"plan": ...}
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise from_validation(path, exc) from None
