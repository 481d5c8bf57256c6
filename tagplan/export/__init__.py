"""Export plans to runnable forms: a PyTorch program, Megatron-LM arguments, a DeepSpeed config.

`export(model_spec, plan, out_dir, fmt=..., seq_len=..., global_batch=...)` writes the files and
returns their paths; a format that cannot express the plan raises `ExportError` (a `SpecError`:
the CLI exits with code 2) saying which stage or field and why. Importing this package imports nothing
else: each name loads its module on first use (the torch writer on demand too).

Modules: `dispatch` (`export`) imports the writers `megatron`, `deepspeed` and `torch_program`;
they share `checks` (the refusals and `ExportError`), which imports no other export module;
`capability.exportable(plan, fmt)` says whether (and why not) a format runs a plan.
`shapes` reads a model SPEC's transformer shape, `modules` builds its torch layers, and
`runtime_train` / `runtime_launch` are the program copied into an exported run and its local
launcher (`runtime_fork`: ranks forked from one interpreter that imported torch once); `verify`
runs it against a one-process reference.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tagplan.export.capability import exportable
    from tagplan.export.checks import ExportError
    from tagplan.export.dispatch import FORMATS, Format, export

__all__ = ["FORMATS", "ExportError", "Format", "export", "exportable"]

# loaded on first use: every rank of an exported program imports the runtime modules of this package,
# and needs neither the writers nor the cost model behind `exportable`
_HOMES = {"exportable": "tagplan.export.capability", "ExportError": "tagplan.export.checks",
          "FORMATS": "tagplan.export.dispatch", "Format": "tagplan.export.dispatch",
          "export": "tagplan.export.dispatch"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tagplan.export' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
