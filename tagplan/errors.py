"""User-facing errors. The CLI prints their message (no traceback) and exits with code 2."""

from __future__ import annotations

import difflib
from typing import Any


class SpecError(ValueError):
    """Bad user input: the message names the field, the value given and what is accepted."""


def nearest(word: str, choices: list[str] | tuple[str, ...], n: int = 3) -> list[str]:
    """Up to `n` entries of `choices` closest to `word` (case-insensitive), best first."""
    lowered = {c.lower(): c for c in choices}
    return [lowered[m] for m in difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.4)]


def unknown(field: str, value: str, choices: list[str] | tuple[str, ...]) -> SpecError:
    """An error for a value not in a known vocabulary, suggesting the nearest names."""
    close = nearest(value, choices)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    listed = ", ".join(sorted(choices))
    return SpecError(f"unknown {field} {value!r}.{hint} Known: {listed}")


def from_validation(source: str, err: Exception) -> SpecError:
    """A SpecError listing each pydantic validation failure as `field.path: message (got value)`."""
    lines = []
    errors: list[dict[str, Any]] = getattr(err, "errors", lambda: [])()
    failed = {tuple(e.get("loc", ())) for e in errors}
    for e in errors[:8]:
        loc = tuple(e.get("loc", ()))
        if loc and e.get("type") == "too_short" and any(other[:len(loc)] == loc and len(other) > len(loc)
                                                         for other in failed):
            continue  # a list left short only because its failing items (reported) were dropped
        path = ".".join(str(p) for p in loc) or "(top level)"
        got = e.get("input")
        shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
        lines.append(f"  {path}: {e.get('msg', '')} (got {shown[:80]})")
    return SpecError(f"{source}: invalid\n" + "\n".join(lines or [f"  {err}"]))
