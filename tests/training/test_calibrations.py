"""The one calibration resolver: defaults, pinned versions, inline objects, and paths only where allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.errors import SpecError
from tagplan.training.calibrations import resolve_calibration
from tagplan.training.registry import Registry


def _registry_with_pinned(tmp_path: Path, calibration: Calibration) -> tuple[Registry, str]:
    registry = Registry(tmp_path / "registry")
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"not a real checkpoint")
    version = registry.register(checkpoint, {"metrics": {}})
    calib = tmp_path / "calib.json"
    calib.write_text(calibration.model_dump_json())
    registry.pin_calibration(version, calib)
    return registry, version


def test_none_is_the_active_pinned_one_else_the_defaults(tmp_path: Path) -> None:
    assert resolve_calibration(None, Registry(tmp_path / "empty"), allow_paths=False) == DEFAULT_CALIBRATION
    custom = DEFAULT_CALIBRATION.model_copy(update={"launch_overhead_s": 7e-6})
    registry, version = _registry_with_pinned(tmp_path, custom)
    assert resolve_calibration(version, registry, allow_paths=False).model_dump() == custom.model_dump()
    registry.activate(version)
    assert resolve_calibration(None, registry, allow_paths=False).model_dump() == custom.model_dump()


# Compared as dumps: a copy of a Calibration keeps the cached lookups of the one it was copied from.


def test_inline_objects_and_paths(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry")
    custom = DEFAULT_CALIBRATION.model_copy(update={"launch_overhead_s": 9e-6})
    inline = json.loads(custom.model_dump_json())
    assert resolve_calibration(inline, registry, allow_paths=False).model_dump() == custom.model_dump()
    path = tmp_path / "calib.json"
    path.write_text(custom.model_dump_json())
    assert resolve_calibration(str(path), registry, allow_paths=True).model_dump() == custom.model_dump()
    with pytest.raises(SpecError, match=r"calibration: '/.* is not accepted") as err:
        resolve_calibration(str(path), registry, allow_paths=False)  # the service reads no file it is given
    assert "launch_overhead_s" not in str(err.value)


def test_long_values_are_not_echoed(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        resolve_calibration("x" * 5000, Registry(tmp_path / "r"), allow_paths=False)
    assert len(str(err.value)) < 300
