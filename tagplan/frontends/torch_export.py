"""ModelGraph from any `nn.Module`: `torch.export` on the meta device plus FlopCounterMode.

The module and its example inputs live on the `meta` device, so no weights are allocated and
nothing is downloaded. The exported graph is re-run node by node on meta tensors under
`FlopCounterMode` to measure each node's FLOPs; shapes and dtypes come from the trace.

Conventions (the cost model relies on them):
- Every Op figure is per sample: the traced figure divided by the example batch `batch`
  (weights read by an op are divided too, so `bytes_read` is exact at micro-batch `batch`).
  `param_bytes` is per model copy.
- Floating-point tensors are costed in the requested `dtype` (not the meta tensors' dtype);
  integer and bool tensors in their own itemsize.
- FLOPs: FlopCounterMode's count (matmul, bmm, addmm, linear, conv, sdpa: 2 per multiply-add,
  attention without the causal discount). It ignores the rest, so we add: elementwise ops 1 per
  output element, layernorm and softmax 5 per output element, reductions 1 per input element
  (the adds actually done). Matmul-like custom ops it cannot see (grouped MoE matmuls) get
  `2 * output elements * contraction size`. Views are free.
- "Activations" are tensors computed from the user inputs. Tensors that are not (position
  tables, causal masks, a bias shared between blocks) are recomputable constants: they are not
  saved for backward, not sent between layers and do not set `Layer.inputs`.
- `saved_bytes`: matmul/conv save their activation inputs; attention saves q, k, v and its
  output; softmax its output; layernorm its input; nonlinear unary elementwise ops their input;
  dropout (training, p > 0) a 1-byte mask; mul/div their activation inputs; the rest nothing.
  A tensor (followed through size-preserving views) saved by several ops of one layer is
  counted once, on the first; each layer counts its own, so a tensor read by several layers
  (T5's encoder output) is counted by each of them, as a pipeline stage holding that layer must.
- Parameters belong to the first non-view op that reads them anywhere in the model (tied
  weights count once). Parameters the forward never reads are not counted.

Layers: a node's layer key is the outermost module path in its `nn_module_stack` that ends in a
numeric index (`model.layers.3`, `encoder.block.5`, `0`). Nodes without a key between two nodes
of one key join that layer; other runs of them form their own layers ("embed"/"pre" before the
first block, "head"/"post" after the last, named after their modules with parameters in
between). A model without indexed containers gets one layer per top-level child. Light ops right
after a block outside any indexed module (a residual add `x = x + block(x)` written in the parent's
forward: no parameter or buffer read, no matmul, conv, attention or embedding) join that block.
Layers with neither FLOPs nor parameters merge into the next layer (the previous one at the end).
Dataflow that is not a chain (two towers, encoder-decoder, skip connections) is kept in
`Layer.inputs`: a layer reading only the model inputs has `inputs == ()`.

The work is done in `tagplan/frontends/tracing/`: `trace` (run and record the graph), `ops`
(kinds and per-node figures), `layers` (grouping and naming) and `blocks` (hashing).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from tagplan.errors import SpecError
from tagplan.frontends.tracing.blocks import build_blocks
from tagplan.frontends.tracing.layers import layer_groups
from tagplan.frontends.tracing.nodes import Scale
from tagplan.frontends.tracing.trace import node_flops, trace_graph
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType


def graph_from_module(
    module: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    name: str,
    family: str = "custom",
    seq_len: int,
    dtype: DType = DType.BF16,
    batch: int | None = None,
    split_independent: bool = False,
) -> ModelGraph:
    """Trace `module(*args, **kwargs)` (all on the meta device) into a ModelGraph.

    `batch` is the size of the inputs' batch dimension (default: dim 0 of the first tensor
    input); every figure is divided by it. `seq_len` is the tokens per sample the inputs carry.
    The module keeps its train/eval mode (dropout is costed only in training mode).
    `split_independent` cuts a run of ops between blocks where its second part does not read the
    first (two towers: the first's final norm, the second's input projection; `layers.split_runs`).
    Returns the graph with per-sample FLOPs and bytes in `dtype`. Raises SpecError when
    torch.export fails or the inputs carry no tensor.
    """
    kwargs = dict(kwargs or {})
    batch = _example_batch(args, kwargs, batch, name)
    if batch < 1 or seq_len < 1:
        raise SpecError(f"model {name!r}: batch ({batch}) and seq_len ({seq_len}) must be positive")
    gm = _export(module, args, kwargs, name)
    try:
        flops = node_flops(gm, pytree.tree_leaves((args, kwargs)))
    except Exception as exc:  # e.g. data-dependent shapes meta tensors cannot follow
        raise SpecError(
            f"model {name!r} ({type(module).__name__}): the exported graph does not run on meta "
            f"tensors: {_first_line(exc)}"
        ) from exc
    trace = trace_graph(gm, flops)
    groups = layer_groups(trace.ops, split_independent=split_independent)
    blocks, layers = build_blocks(trace, groups, Scale(dtype, batch, seq_len))
    return ModelGraph(
        name=name, family=family, seq_len=seq_len, dtype=dtype, blocks=tuple(blocks), layers=tuple(layers)
    )


def _example_batch(args: tuple[Any, ...], kwargs: dict[str, Any], batch: int | None, name: str) -> int:
    """`batch`, or dim 0 of the first tensor input (1 for a scalar). Raises SpecError without one."""
    flat = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not flat:
        raise SpecError(f"model {name!r}: example inputs hold no tensor to trace with")
    if batch is None:
        batch = int(flat[0].shape[0]) if flat[0].dim() else 1
    return batch


def _export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> fx.GraphModule:
    """torch.export the module and return the unlifted graph (parameters as get_attr nodes)."""
    try:
        ep = torch.export.export(module, args, kwargs, strict=False)
        gm = ep.module()
    except Exception as exc:  # any export failure is the user's model: say which and why
        raise SpecError(f"model {name!r} ({type(module).__name__}): torch.export failed: {_first_line(exc)}") from exc
    assert isinstance(gm, fx.GraphModule)
    return gm


def _first_line(exc: Exception) -> str:
    """`Type: first line of the message`, for one-line user errors."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
