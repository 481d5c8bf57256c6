"""The benchmark scripts under bench/ as modules, for tests of the data and helpers they hold
(`from bench_modules import BENCH, load_bench`; tests/ is on the import path, as for search_toys)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/`name`.py, imported by path (bench/ is not a package); bench/ is appended to the import path, so
    that its scripts' imports of each other (`from planned import planned`) resolve as when they run."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
