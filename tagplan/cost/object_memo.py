"""Memo tables that live as long as the object they describe.

A calibration fit builds a new `Simulator` for every set of parameters it tries, hundreds per fit,
on the same few clusters. What depends only on a cluster's links (the calibrated cluster itself, each
device group's ring topology) is the same for every try that leaves the link parameters alone, so it
is kept per cluster object here rather than per simulator. Entries are keyed by the object's id and
dropped when it is garbage-collected (`weakref.finalize`), so an id reused by a later object never
sees a stale table.
"""

from __future__ import annotations

import weakref
from typing import Any

_TABLES: dict[tuple[str, int], dict[Any, Any]] = {}


def object_memo(owner: object, table: str) -> dict[Any, Any]:
    """The memo dict named `table` for `owner` (created empty on first use, dropped with `owner`)."""
    key = (table, id(owner))
    memo = _TABLES.get(key)
    if memo is None:
        memo = _TABLES[key] = {}
        weakref.finalize(owner, _TABLES.pop, key, None)
    return memo
