"""Reading YAML/JSON text with errors that carry the file's line number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tagplan.errors import SpecError


def read_text(path: str | Path) -> str:
    """The file's text; SpecError if it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from None


def parse_structured(text: str, source: str) -> Any:
    """Parse JSON (if it looks like JSON) or YAML; SpecError names the source and line."""
    if source.endswith(".json") or text.lstrip().startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{source}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{source}: malformed YAML{where}: {problem}") from None
