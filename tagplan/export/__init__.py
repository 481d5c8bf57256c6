"""Export plans to runnable forms: a PyTorch program, Megatron-LM arguments, a DeepSpeed config.

`export(model_spec, plan, out_dir, fmt=..., seq_len=..., global_batch=...)` writes the files and
returns their paths; a format that cannot express the plan raises `ExportError` (a `SpecError`:
the CLI exits with code 2) saying which stage or field and why. Importing this package imports no
torch: the writers load on demand.
"""

from __future__ import annotations

from tagplan.errors import SpecError
from tagplan.export.dispatch import FORMATS, export, export_error

__all__ = ["FORMATS", "ExportError", "export"]


def __getattr__(name: str) -> type[SpecError]:
    """`ExportError`, resolved on first use (its home, `torch_program`, may import torch)."""
    if name == "ExportError":
        return export_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
