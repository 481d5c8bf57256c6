"""`tagplan.export` loads what a name needs on first use: a rank of an exported program imports the runtime
modules of this package without the writers or the cost model behind `exportable`."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tagplan.export as export_package


def test_importing_the_package_and_its_layout_module_loads_no_writer_and_no_simulator() -> None:
    code = ("import sys, tagplan.export, tagplan.export.runtime_layout; "
            "print(sorted(m for m in ('tagplan.export.capability', 'tagplan.export.dispatch', "
            "'tagplan.export.megatron', 'tagplan.cost.simulator') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert loaded.strip() == "[]"


def test_the_public_names_load_on_use_and_unknown_ones_are_refused() -> None:
    from tagplan.export import FORMATS, ExportError, export, exportable
    from tagplan.export.capability import exportable as home_exportable
    from tagplan.export.checks import ExportError as HomeError

    assert exportable is home_exportable and ExportError is HomeError and callable(export) and FORMATS
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        export_package.nothing  # noqa: B018
