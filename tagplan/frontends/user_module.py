"""A user's own PyTorch model as a ModelGraph: the `path/to/file.py:Name` and `package.module:Name` SPECs.

`Name` is an `nn.Module` class (called with no arguments) or a factory (a callable with no
required arguments). It is called under `torch.device("meta")`, so no weights are allocated.
Example inputs come from, in order:
1. `input_shape` (`--input-shape 8x512` on the CLI; `8x512:long` for token ids), zeros of that
   shape as the one positional input;
2. the factory's return value, when it is a pair `(module, example_inputs)`;
3. the module's `example_inputs()` method.
`example_inputs` is a tensor, a tuple of positional inputs, or a dict of keyword inputs; its
batch dimension is dim 0 of the first tensor, and tokens per sample dim 1 (or `seq_len` when
given). The graph is traced by `torch_export.graph_from_module`.

Folding (`fold_stacks`): every outermost `nn.ModuleList`/`nn.Sequential` of more than
`_TRACED` elements of one class with equal parameter shapes is cut to its first `_TRACED`
elements for the trace. When the traced middle elements (all but the first and the last) hash
equal, the middle block is replicated to the list's length, numbering continued; the first and
last keep their own blocks (the last may absorb a trailing residual add). Otherwise, or when
the cut model does not trace (a forward that indexes the list by a fixed range), the full model
is traced. A 24-block model is traced as 4 blocks. Runs of ops between blocks are cut where
their dataflow separates (`split_independent`), so two towers stay two towers in `Layer.inputs`.

Only the CLI builds these: the service never imports user code (a client sends the graph).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tagplan.errors import SpecError
from tagplan.frontends.hf_fold import extend, rebuild
from tagplan.ir.model import Layer, ModelGraph
from tagplan.ir.workload import DType

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

_TRACED = 4  # elements kept per repeated list: first, two middle ones compared, last
# torch logs each failing meta kernel with its traceback (~20 lines) before raising; the trace's
# SpecError already names the error, so the log only buries it
_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"
_SHAPE = re.compile(r"(?P<dims>\d+(?:[x,]\d+)*)(?::(?P<dtype>float|long|int|bool))?")


def graph_from_user_module(
    module: str,
    attr: str,
    *,
    seq_len: int | None,
    dtype: DType,
    input_shape: str | None = None,
    fold: bool = True,
) -> ModelGraph:
    """Trace `module:attr` (a file path ending .py, or a dotted import path) into a ModelGraph.

    `input_shape` ("BxS[x...][:long]") overrides the module's own example inputs. SpecError for a
    missing module or name, no example inputs, or a model torch.export cannot trace.
    """
    name = f"{module}:{attr}"
    module_obj, inputs = instantiate(module, attr, input_shape=input_shape)
    args, kwargs = _as_call(inputs)
    traced = _tokens_per_sample(args, kwargs, name)
    if seq_len is not None and seq_len != traced:  # trace it at that length: a label alone would cost the other
        if input_shape is not None:
            raise SpecError(f"model {name!r}: seq_len={seq_len}, but --input-shape {input_shape} gives {traced} "
                            "tokens per sample; give one length")
        module_obj, inputs = instantiate(module, attr, input_shape=_at_length(args, kwargs, seq_len, name))
        args, kwargs = _as_call(inputs)
    return fold_trace(module_obj, args, kwargs, name=name, seq_len=seq_len or traced, dtype=dtype, fold=fold)


def _at_length(args: tuple[Any, ...], kwargs: dict[str, Any], seq_len: int, name: str) -> str:
    """The `--input-shape` of the module's one example input with dim 1 (the tokens) set to `seq_len`; SpecError
    for a module of several inputs (their lengths cannot be told apart) or a 1-D input (no tokens)."""
    import torch

    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    if len(tensors) != 1 or tensors[0].dim() < 2:
        raise SpecError(f"model {name!r}: it is traced on its example inputs; seq_len={seq_len} cannot be set on "
                        f"{len(tensors)} input tensor(s) of shapes {[tuple(t.shape) for t in tensors][:4]}: give "
                        "the example inputs of that length")
    dims = list(tensors[0].shape)
    dims[1] = seq_len
    kinds = {torch.long: "long", torch.int32: "int", torch.bool: "bool"}
    kind = kinds.get(tensors[0].dtype, "float")
    return "x".join(str(d) for d in dims) + f":{kind}"


def instantiate(module: str, attr: str, *, input_shape: str | None = None, device: str = "meta") -> tuple[
        nn.Module, Any]:
    """(the user's module built on `device` (default `meta`: no memory), its example inputs), as
    `graph_from_user_module` reads them (module docstring). SpecError for a missing module or
    name, or no example inputs."""
    import torch
    from torch import nn

    name = f"{module}:{attr}"
    target = getattr(_import(module), attr, None)
    if target is None or not callable(target):
        raise SpecError(f"model {name!r}: {module} has no class or factory named {attr!r}")
    shaped = parse_input_shape(input_shape, name) if input_shape else None
    with torch.device(device):
        made = _build(target, attr, name)
        module_obj, inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        if not isinstance(module_obj, nn.Module):
            raise SpecError(f"model {name!r}: {attr}() returned {type(module_obj).__name__}; expected an nn.Module "
                            "or a pair (nn.Module, example_inputs)")
        if shaped is not None:
            inputs = torch.zeros(shaped[0], dtype=shaped[1])
        elif inputs is None:
            inputs = _inputs_of(module_obj, name)
    return module_obj, inputs


def _build(target: Any, attr: str, name: str) -> Any:
    """`target()`; a required parameter, or an exception it raises, as a SpecError naming the SPEC."""
    kind = "class" if isinstance(target, type) else "factory"
    required = _required_parameters(target)
    if required:
        called = f"the class {attr}" if kind == "class" else f"the factory {attr}()"
        takes = "a required argument" if len(required) == 1 else "required arguments"
        raise SpecError(f"model {name!r}: {called} takes {takes} {', '.join(repr(p) for p in required)}; "
                        f"a {kind} is called with no arguments (docs/MODELS.md)")
    try:
        return target()
    except SpecError:
        raise
    except Exception as exc:  # the user's code: any failure is theirs to fix, in one line
        raise SpecError(f"model {name!r}: the {kind} raised {type(exc).__name__}: {exc}") from exc


def _required_parameters(target: Any) -> list[str]:
    """Names of `target`'s parameters without a default (none when its signature cannot be read)."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # some builtins and C extensions have no signature
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.kind not in variadic]


def parse_input_shape(text: str, name: str = "model") -> tuple[tuple[int, ...], Any]:
    """(dims, torch dtype) of `--input-shape` text such as `8x512`, `8,3,224,224` or `8x512:long`."""
    import torch

    m = _SHAPE.fullmatch(text.strip())
    if m is None or any(int(d) == 0 for d in re.split("[x,]", m["dims"])):
        raise SpecError(f"{name}: input shape {text!r} is not accepted; expected positive sizes such as 8x512 "
                        "or 8x512:long (dtypes: float, long, int, bool)")
    dtypes = {"float": torch.float32, "long": torch.long, "int": torch.int32, "bool": torch.bool}
    return tuple(int(d) for d in re.split("[x,]", m["dims"])), dtypes[m["dtype"] or "float"]


def fold_trace(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str, seq_len: int, dtype: DType,
    fold: bool = True,
) -> ModelGraph:
    """`graph_from_module` with repeated lists traced once (module docstring); the full trace as fallback."""
    from tagplan.frontends.torch_export import graph_from_module

    def trace() -> ModelGraph:
        with _quiet(_FAKE_TENSOR_LOG):
            return graph_from_module(module, args, kwargs, name=name, seq_len=seq_len, dtype=dtype,
                                     split_independent=True)

    lists = repeated_lists(module) if fold else {}
    if lists:
        try:
            with _cut(module, lists):
                graph = trace()
            folded = _unfold(graph, lists)
            if folded is not None:
                return folded
            log.info("%s: the traced blocks of %s differ; tracing the full model", name, ", ".join(lists))
        except SpecError as exc:
            log.info("%s: the model with cut lists does not trace (%s); tracing the full model", name, exc)
    return trace()


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Only CRITICAL records from `logger_name` for the duration; its level restored after."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def repeated_lists(module: nn.Module) -> dict[str, int]:
    """Path -> length of each outermost ModuleList/Sequential worth folding (module docstring)."""
    from torch import nn

    found: dict[str, int] = {}
    for path, child in module.named_modules():
        if any(path.startswith(p + ".") for p in found) or not isinstance(child, nn.ModuleList | nn.Sequential):
            continue
        items = list(child)
        if len(items) > _TRACED and len({_signature(m) for m in items}) == 1:
            found[path] = len(items)
    return found


def _signature(m: nn.Module) -> tuple[Any, ...]:
    """Class and parameter/buffer shapes: elements with equal signatures may share a block."""
    shapes = [(n, tuple(p.shape)) for n, p in (*m.named_parameters(), *m.named_buffers())]
    return (type(m), tuple(shapes))


@contextmanager
def _cut(module: nn.Module, lists: dict[str, int]) -> Iterator[None]:
    """Replace each list by its first `_TRACED` elements for the duration; restore after."""
    from torch import nn

    saved = []
    for path in lists:
        parent_path, _, attr = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        full = getattr(parent, attr)
        saved.append((parent, attr, full))
        items = list(full)[:_TRACED]
        setattr(parent, attr, nn.Sequential(*items) if isinstance(full, nn.Sequential) else nn.ModuleList(items))
    try:
        yield
    finally:
        for parent, attr, full in saved:
            setattr(parent, attr, full)


def _unfold(graph: ModelGraph, lists: dict[str, int]) -> ModelGraph | None:
    """Replicate each cut list's middle block to its full length; None if the middles differ."""
    layers = list(graph.layers)
    for path, depth in sorted(lists.items(), key=lambda kv: -_span_start(layers, kv[0])):
        first = _span_start(layers, path)
        if first < 0:
            return None
        last = first + _TRACED - 1
        middle = {layers[i].block for i in range(first + 1, last)}
        if len(middle) > 1:
            return None
        layers = extend(layers, first, last - 1, depth - 1)
        end = first + depth - 1  # the traced last element, renamed to the list's last index
        layers[end] = layers[end].model_copy(update={"name": _indexed(layers[end].name, depth - 1)})
    return rebuild(graph, layers=tuple(layers))


def _span_start(layers: list[Layer], path: str) -> int:
    """Index of the layer for element 0 of the list at `path` (followed by elements 1.._TRACED-1), or -1."""
    for i in range(len(layers) - _TRACED + 1):
        if all(_names(layers[i + k].name, path, k) for k in range(_TRACED)):
            return i
    return -1


def _names(layer_name: str, path: str, k: int) -> bool:
    """Whether a (possibly shortened) layer name is element `k` of the list at `path`."""
    full = f"{path}.{k}" if path else str(k)
    return full == layer_name or full.endswith("." + layer_name)


def _indexed(layer_name: str, index: int) -> str:
    stem, _, _ = layer_name.rpartition(".")
    return f"{stem}.{index}" if stem else str(index)


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
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"model module {module!r}: importing it raised {type(exc).__name__}: {exc}") from exc


def _inputs_of(module: Any, name: str) -> Any:
    method = getattr(module, "example_inputs", None)
    if not callable(method):
        raise SpecError(f"model {name!r}: no example inputs; return (module, example_inputs) from the factory, "
                        "give the module an example_inputs() method, or pass --input-shape")
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
