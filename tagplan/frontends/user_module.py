"""A user's own PyTorch model as a ModelGraph: the `path/to/file.py:Name` and `package.module:Name` SPECs.

`Name` is an `nn.Module` class (called with no arguments) or a factory (a callable with no
required arguments). It is called under `torch.device("meta")`, so no weights are allocated.
Example inputs come from, in order:
1. the factory's return value, when it is a pair `(module, example_inputs)`;
2. the module's `example_inputs()` method.
`example_inputs` is a tensor, a tuple of positional inputs, or a dict of keyword inputs; its
batch dimension is dim 0 of the first tensor, and tokens per sample dim 1 (or `seq_len` when
given). The graph is traced by `torch_export.graph_from_module`.

Only the CLI builds these: the service never imports user code (a client sends the graph).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tagplan.errors import SpecError
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType


def graph_from_user_module(module: str, attr: str, *, seq_len: int | None, dtype: DType) -> ModelGraph:
    """Trace `module:attr` (a file path ending .py, or a dotted import path) into a ModelGraph."""
    import torch
    from torch import nn

    from tagplan.frontends.torch_export import graph_from_module

    name = f"{module}:{attr}"
    target = getattr(_import(module), attr, None)
    if target is None or not callable(target):
        raise SpecError(f"model {name!r}: {module} has no class or factory named {attr!r}")
    with torch.device("meta"):
        made = target()
        module_obj, inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        if not isinstance(module_obj, nn.Module):
            raise SpecError(f"model {name!r}: {attr}() returned {type(module_obj).__name__}; expected an nn.Module "
                            "or a pair (nn.Module, example_inputs)")
        if inputs is None:
            inputs = _inputs_of(module_obj, name)
    args, kwargs = _as_call(inputs)
    seq = seq_len or _tokens_per_sample(args, kwargs, name)
    return graph_from_module(module_obj, args, kwargs, name=name, seq_len=seq, dtype=dtype)


def _import(module: str) -> ModuleType:
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise SpecError(f"model module file {module!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"tagplan_user_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise SpecError(f"model module file {module!r} cannot be imported")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded
        loader = spec.loader
        _run(lambda: loader.exec_module(loaded), module)
        return loaded
    return _run(lambda: importlib.import_module(module), module)


def _run(call: Any, module: str) -> Any:
    try:
        return call()
    except ModuleNotFoundError as exc:
        raise SpecError(f"model module {module!r} cannot be imported: {exc}") from None
    except SyntaxError as exc:
        raise SpecError(f"model module {module!r}: syntax error at line {exc.lineno}: {exc.msg}") from None


def _inputs_of(module: Any, name: str) -> Any:
    method = getattr(module, "example_inputs", None)
    if not callable(method):
        raise SpecError(f"model {name!r}: no example inputs; return (module, example_inputs) from the factory or "
                        "give the module an example_inputs() method")
    return method()


def _as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


def _tokens_per_sample(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> int:
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[1]) if value.dim() >= 2 else 1
    raise SpecError(f"model {name!r}: example inputs hold no tensor to trace with")
