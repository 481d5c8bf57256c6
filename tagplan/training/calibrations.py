"""Which calibration a planning or simulation request uses: the one resolver for the CLI and the service.

A choice is:
- None: the calibration pinned beside the registry's active GNN version, else the shipped defaults;
- a registry version name: the calibration pinned beside that version;
- a mapping: a calibration object as `tagplan calibrate` writes it (inline);
- a file path (only where `allow_paths`: the CLI; the service reads no file a tenant names).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.errors import SpecError, from_validation
from tagplan.training.registry import Registry

_SHOWN_CHARS = 80  # of a value named in an error: never echo long input


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file written by `tagplan calibrate`; SpecError naming the file and the bad field."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as err:
        raise SpecError(f"calibration {source}: cannot read it ({err.strerror or err})") from None
    try:
        return Calibration.model_validate_json(text)
    except ValidationError as err:
        raise from_validation(f"calibration file {source}", err) from None


def resolve_calibration(choice: Any, registry: Registry, *, allow_paths: bool) -> Calibration:
    """The Calibration `choice` names (module docstring); SpecError naming the value otherwise."""
    if choice is None:
        return _pinned(registry, None)
    if isinstance(choice, Mapping):
        try:
            return Calibration.model_validate(dict(choice))
        except ValidationError as err:
            raise from_validation("calibration", err) from None
    if isinstance(choice, str) and choice in registry.versions():
        return _pinned(registry, choice)
    if isinstance(choice, str) and allow_paths:
        if not Path(choice).exists():
            raise SpecError(f"calibration {choice!r}: no such file, nor a registry version with a "
                            f"calibration pinned ({', '.join(registry.versions()) or 'none registered'})")
        return load_calibration(choice)
    shown = repr(choice)[:_SHOWN_CHARS]
    raise SpecError(f"calibration: {shown} is not accepted; expected a calibration object (from `tagplan calibrate`) "
                    f"or a registry version with one pinned ({', '.join(registry.versions()) or 'none'})")


def _pinned(registry: Registry, version: str | None) -> Calibration:
    path = registry.calibration_path(version)
    if path is None:
        if version is not None:
            raise SpecError(f"calibration: version {version!r} has no calibration pinned beside it")
        return DEFAULT_CALIBRATION
    try:
        return load_calibration(path)
    except SpecError as err:
        raise SpecError(f"the calibration pinned in the registry is unreadable: {err}") from None
