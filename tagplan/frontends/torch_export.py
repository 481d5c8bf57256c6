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
between). A model without indexed containers gets one layer per top-level child. Layers with
neither FLOPs nor parameters merge into the next layer (the previous one at the end).
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from tagplan.errors import SpecError
from tagplan.ir.model import Block, Layer, ModelGraph, Op, OpKind, PartitionDim
from tagplan.ir.workload import DType

_MATMULS = frozenset({"mm", "addmm", "linear", "bmm", "matmul", "baddbmm", "addbmm", "einsum", "mv", "dot"})
_NORMS = frozenset(
    {
        "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
        "native_group_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training", "instance_norm",
    }
)  # fmt: skip
_SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
_EMBEDDINGS = frozenset({"embedding", "embedding_bag", "_embedding_bag"})
_VIEWS = frozenset(
    {
        "view", "reshape", "_unsafe_view", "transpose", "permute", "expand", "expand_as",
        "unsqueeze", "squeeze", "slice", "select", "t", "clone", "contiguous", "alias", "detach",
        "flatten", "unflatten", "split", "split_with_sizes", "chunk", "unbind", "narrow", "view_as",
        "as_strided", "lift_fresh_copy", "movedim", "swapaxes", "numpy_T",
    }
)  # fmt: skip
_CASTS = frozenset({"to", "_to_copy", "type_as"})
_DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "var", "var_mean", "std", "norm", "logsumexp"})
_ELEMENTWISE = frozenset({"cumsum", "cumprod", "tril", "triu", "diff", "masked_fill", "where", "clamp"})
_NONLINEAR = frozenset(
    {
        "gelu", "silu", "tanh", "sigmoid", "exp", "exp2", "log", "log1p", "pow", "rsqrt", "sqrt",
        "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "softplus", "mish", "hardswish",
        "hardsigmoid", "hardtanh", "erf", "erfc", "sin", "cos", "reciprocal", "logsigmoid",
    }
)  # fmt: skip
_INDEXED = re.compile(r"(^|\.)\d+$")
_EXPERTS = re.compile(r"(^|\.)experts?(\.|$)")
_HASH_CHARS = 16


@dataclass(frozen=True)
class _Scale:
    """Turns traced tensors into per-sample bytes in the requested dtype."""

    dtype: DType
    batch: int
    seq_len: int

    def nbytes(self, t: torch.Tensor) -> float:
        """Bytes of `t` per sample: floats in `dtype`, integers and bools in their own size."""
        itemsize = self.dtype.nbytes if t.dtype.is_floating_point else t.dtype.itemsize
        return t.numel() * itemsize / self.batch


@dataclass(eq=False)
class _OpNode:
    """One traced call_function node that becomes an Op."""

    node: fx.Node
    kind: OpKind
    opname: str
    target: str
    path: str
    stack: tuple[str, ...]
    flops: float  # whole example batch
    inputs: list[fx.Node]  # tensor-valued argument nodes, in order
    outputs: list[torch.Tensor]
    owned: list[str] = field(default_factory=list)  # parameter FQNs first read here
    key: str | None = None


@dataclass
class _Trace:
    """The traced graph with the relations Op figures need."""

    ops: list[_OpNode]
    op_of: dict[fx.Node, _OpNode]  # tensor node -> op that produced it (getitem resolved)
    params: dict[str, int]  # FQN -> numel
    param_of: dict[fx.Node, str]  # tensor node -> parameter it is (a view of)
    root: dict[fx.Node, fx.Node]  # tensor node -> node whose storage it is (size-preserving views)
    tainted: set[fx.Node]  # nodes computed from the user inputs


@dataclass
class _Group:
    """A run of ops that becomes one layer."""

    key: str | None
    ops: list[_OpNode]
    name: str = ""
    kind: str = "block"


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
) -> ModelGraph:
    """Trace `module(*args, **kwargs)` (all on the meta device) into a ModelGraph.

    `batch` is the size of the inputs' batch dimension (default: dim 0 of the first tensor
    input); every figure is divided by it. `seq_len` is the tokens per sample the inputs carry.
    The module keeps its train/eval mode (dropout is costed only in training mode).
    Returns the graph with per-sample FLOPs and bytes in `dtype`. Raises SpecError when
    torch.export fails or the inputs carry no tensor.
    """
    kwargs = dict(kwargs or {})
    flat = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not flat:
        raise SpecError(f"model {name!r}: example inputs hold no tensor to trace with")
    if batch is None:
        batch = int(flat[0].shape[0]) if flat[0].dim() else 1
    if batch < 1 or seq_len < 1:
        raise SpecError(f"model {name!r}: batch ({batch}) and seq_len ({seq_len}) must be positive")
    gm = _export(module, args, kwargs, name)
    try:
        flops = _node_flops(gm, pytree.tree_leaves((args, kwargs)))
    except Exception as exc:  # e.g. data-dependent shapes meta tensors cannot follow
        raise SpecError(
            f"model {name!r} ({type(module).__name__}): the exported graph does not run on meta "
            f"tensors: {_first_line(exc)}"
        ) from exc
    trace = _trace(gm, flops)
    scale = _Scale(dtype, batch, seq_len)
    groups = _name_groups(_merge_empty(_group(trace.ops)))
    blocks, layers = _build(trace, groups, scale)
    return ModelGraph(
        name=name, family=family, seq_len=seq_len, dtype=dtype, blocks=tuple(blocks), layers=tuple(layers)
    )


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


class _FlopInterpreter(fx.Interpreter):
    """Runs the graph on meta tensors and records each node's FlopCounterMode count."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.flops: dict[fx.Node, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        self.flops[n] = float(self.counter.get_total_flops() - before)
        return out


def _node_flops(gm: fx.GraphModule, flat_inputs: list[Any]) -> dict[fx.Node, float]:
    """FLOPs of every node for the example batch (higher-order ops include their bodies)."""
    counter = FlopCounterMode(display=False)
    interp = _FlopInterpreter(gm, counter)
    with counter, torch.no_grad():
        interp.run(*flat_inputs)
    return interp.flops


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside a traced value (a tensor, or nested tuples/lists of them)."""
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _opname(target: Any) -> str:
    """Short op name: `linear` for aten.linear.default, `add` for aten.add_.Tensor."""
    name = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return str(name)


def _module_stack(node: fx.Node) -> tuple[str, ...]:
    """Module paths from outermost to innermost ('' is the root module)."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(re.sub(r"@\d+$", "", str(v[0])) for v in stack.values())


def _trace(gm: fx.GraphModule, flops: dict[fx.Node, float]) -> _Trace:
    """Classify nodes, follow views and getitems, mark activations and assign parameters."""
    params = {fqn: p.numel() for fqn, p in gm.named_parameters(remove_duplicate=False)}
    params.update({fqn: b.numel() for fqn, b in gm.named_buffers() if b.requires_grad})
    t = _Trace(ops=[], op_of={}, params=params, param_of={}, root={}, tainted=set())
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in t.tainted for a in node.all_input_nodes):
            t.tainted.add(node)
        if node.op == "get_attr" and node.target in params:
            t.param_of[node] = str(node.target)
        elif node.op == "call_function":
            _visit(node, flops.get(node, 0.0), t)
        t.root.setdefault(node, node)
    _claim_params(t)
    return t


def _visit(node: fx.Node, flops: float, t: _Trace) -> None:
    """Record one call_function node as an op, or as an alias of its producer (getitem)."""
    if node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node):
            if src in t.op_of:
                t.op_of[node] = t.op_of[src]
            if src in t.param_of:
                t.param_of[node] = t.param_of[src]
        return
    outputs = _tensors(node.meta.get("val"))
    if not outputs and flops == 0:
        return  # asserts and symbolic-size arithmetic
    inputs = [a for a in node.all_input_nodes if _tensors(a.meta.get("val"))]
    opname = _opname(node.target)
    kind = _kind(node, opname, inputs, outputs)
    stack = _module_stack(node)
    op = _OpNode(
        node=node, kind=kind, opname=opname, target=str(node.target), path=stack[-1] if stack else "",
        stack=stack, flops=_flops(kind, flops, inputs, outputs), inputs=inputs, outputs=outputs,
    )  # fmt: skip
    t.ops.append(op)
    t.op_of[node] = op
    first = inputs[0] if inputs else None
    if kind is OpKind.VIEW and first is not None:
        if first in t.param_of:
            t.param_of[node] = t.param_of[first]
        if outputs and _val_numel(first) == outputs[0].numel():
            t.root[node] = t.root.get(first, first)


def _val_numel(node: fx.Node) -> int:
    tensors = _tensors(node.meta.get("val"))
    return tensors[0].numel() if tensors else -1


def _kind(node: fx.Node, opname: str, inputs: list[fx.Node], outputs: list[torch.Tensor]) -> OpKind:
    """The OpKind of a node, from its op name and (for casts and dropout) its arguments."""
    if opname in _MATMULS or "grouped_mm" in opname:
        return OpKind.MATMUL
    if opname.startswith(("conv", "_conv", "cudnn_conv")):
        return OpKind.CONV
    if any(s in opname for s in ("scaled_dot_product", "flash_attention", "efficient_attention")):
        return OpKind.ATTENTION
    if opname == "flex_attention":
        return OpKind.ATTENTION
    for names, kind in ((_NORMS, OpKind.LAYERNORM), (_SOFTMAXES, OpKind.SOFTMAX), (_EMBEDDINGS, OpKind.EMBEDDING)):
        if opname in names:
            return kind
    if _is_view(node, opname, inputs, outputs):
        return OpKind.VIEW
    tags = getattr(node.target, "tags", ())
    if torch.Tag.reduction in tags or opname in _REDUCTIONS:
        return OpKind.REDUCTION
    if torch.Tag.pointwise in tags or opname in _ELEMENTWISE | _DROPOUTS | _CASTS:
        return OpKind.ELEMENTWISE
    return OpKind.OTHER


def _is_view(node: fx.Node, opname: str, inputs: list[fx.Node], outputs: list[torch.Tensor]) -> bool:
    """Views, copies of layout, same-dtype casts and inactive dropout move no data we cost."""
    if opname in _VIEWS or opname.startswith("_assert"):
        return True
    if opname in _CASTS:
        src = _tensors(inputs[0].meta.get("val")) if inputs else []
        return bool(src and outputs and src[0].dtype == outputs[0].dtype)
    if opname in _DROPOUTS:
        return not _dropout_active(node)
    return False


def _dropout_active(node: fx.Node) -> bool:
    """Whether a dropout node drops anything: training mode and p > 0."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return bool(train) and float(p) > 0  # type: ignore[arg-type]


def _flops(kind: OpKind, counted: float, inputs: list[fx.Node], outputs: list[torch.Tensor]) -> float:
    """FLOPs for the example batch: FlopCounterMode's count plus what it does not see."""
    out = outputs[0].numel() if outputs else 0
    if kind is OpKind.ELEMENTWISE:
        return counted + out
    if kind in (OpKind.LAYERNORM, OpKind.SOFTMAX):
        return counted + 5 * out
    if kind is OpKind.REDUCTION:
        return counted + max(_val_numel(inputs[0]) if inputs else 0, out)
    if kind is OpKind.MATMUL and counted == 0 and inputs and outputs:
        first = _tensors(inputs[0].meta.get("val"))[0]  # custom matmuls (grouped MoE): 2 * M * N * K
        return 2.0 * out * (first.shape[-1] if first.dim() else 1)
    return counted


def _claim_params(t: _Trace) -> None:
    """Give each parameter to the first non-view op reading it (tied weights count once)."""
    claimed: set[str] = set()
    for op in t.ops:
        if op.kind is OpKind.VIEW:
            continue
        for a in op.inputs:
            fqn = t.param_of.get(a)
            if fqn is not None and fqn not in claimed:
                claimed.add(fqn)
                op.owned.append(fqn)


def _layer_key(stack: tuple[str, ...], indexed: bool) -> str | None:
    """Outermost indexed module path; without indexed containers, the top-level child."""
    if indexed:
        return next((p for p in stack if _INDEXED.search(p)), None)
    inner = stack[-1] if stack else ""
    return inner.split(".")[0] or None


def _group(ops: list[_OpNode]) -> list[_Group]:
    """Split the op sequence into runs by layer key; unkeyed nodes inside a layer join it."""
    indexed = any(_INDEXED.search(p) for op in ops for p in op.stack)
    groups: list[_Group] = []
    for op in ops:
        op.key = _layer_key(op.stack, indexed)
        if groups and groups[-1].key == op.key:
            groups[-1].ops.append(op)
        elif op.key is not None and len(groups) >= 2 and groups[-1].key is None and groups[-2].key == op.key:
            groups[-2].ops.extend(groups.pop().ops)
            groups[-1].ops.append(op)
        else:
            groups.append(_Group(op.key, [op]))
    return groups


def _merge_empty(groups: list[_Group]) -> list[_Group]:
    """Fold layers with neither FLOPs nor parameters into the next (or, at the end, previous)."""
    out: list[_Group] = []
    pending: list[_OpNode] = []
    for g in groups:
        if not any(op.flops > 0 or op.owned for op in g.ops):
            pending.extend(g.ops)
            continue
        out.append(_Group(g.key, pending + g.ops))
        pending = []
    if pending and out:
        out[-1].ops.extend(pending)
    elif pending:
        out.append(_Group(None, pending))
    return out


def _name_groups(groups: list[_Group]) -> list[_Group]:
    """Name each layer and give it a kind (embedding, block, head, other)."""
    keyed = [i for i, g in enumerate(groups) if g.key is not None]
    short = _short_names([g.key for g in groups if g.key is not None])
    for i, g in enumerate(groups):
        has_embedding = any(op.kind is OpKind.EMBEDDING for op in g.ops)
        has_params = any(op.owned for op in g.ops)
        if g.key is not None:
            g.name, g.kind = short[g.key], "block"
        elif not keyed:
            g.name, g.kind = "model", "block"
        elif i < keyed[0]:
            g.name = "embed" if has_embedding or has_params else "pre"
            g.kind = "embedding" if has_embedding or has_params else "other"
        elif i > keyed[-1]:
            g.name, g.kind = ("head" if has_params else "post"), "head"
        else:
            g.name, g.kind = _middle_name(g), ("embedding" if has_embedding else "other")
    _uniquify(groups)
    return groups


def _short_names(keys: list[str]) -> dict[str, str]:
    """Layer names from keys: drop the leading path common to all (`transformer.h.3` -> `h.3`)."""
    stems = [k.split(".")[:-1] for k in keys]
    common = 0
    while stems and all(len(s) > common and s[common] == stems[0][common] for s in stems):
        common += 1
    return {k: ".".join(k.split(".")[max(0, min(common, len(k.split(".")) - 2)) :]) for k in keys}


def _middle_name(g: _Group) -> str:
    """A layer between blocks is named after its modules that hold parameters."""
    paths: list[str] = []
    for op in g.ops:
        reads_params = op.owned or any(a.op == "get_attr" for a in op.inputs)
        if reads_params and op.path and op.path not in paths:
            paths.append(op.path)
    return "+".join(paths[:3]) or "mid"


def _uniquify(groups: list[_Group]) -> None:
    seen: dict[str, int] = {}
    for g in groups:
        n = seen.get(g.name, 0)
        seen[g.name] = n + 1
        if n:
            g.name = f"{g.name}#{n + 1}"


def _build(trace: _Trace, groups: list[_Group], scale: _Scale) -> tuple[list[Block], list[Layer]]:
    """Turn layer groups into unique Blocks and the Layer sequence."""
    sources, out_bytes = _edges(trace, groups, scale)
    blocks: dict[str, Block] = {}
    layers: list[Layer] = []
    for i, g in enumerate(groups):
        ops, signature = _block_ops(trace, g, scale)
        params = sum(trace.params[fqn] for op in g.ops for fqn in op.owned)
        digest = _digest([g.kind, params, out_bytes[i], signature, [op.model_dump(mode="json") for op in ops]])
        block = Block(hash=digest, kind=g.kind, ops=tuple(ops), params=params, output_bytes=out_bytes[i])
        blocks.setdefault(digest, block)
        # None means "the previous layer"; a first layer reads only the model inputs
        inputs = None if sources[i] == [i - 1] or (i == 0 and not sources[i]) else tuple(sources[i])
        layers.append(Layer(name=g.name, block=digest, inputs=inputs))
    return list(blocks.values()), layers


def _edges(trace: _Trace, groups: list[_Group], scale: _Scale) -> tuple[list[list[int]], list[float]]:
    """Per layer: the earlier layers whose activations it reads, and the per-sample bytes of its
    activations that later layers read (each tensor once)."""
    layer_of = {op.node: i for i, g in enumerate(groups) for op in g.ops}
    sources: list[set[int]] = [set() for _ in groups]
    sent: list[dict[fx.Node, float]] = [{} for _ in groups]
    for op in trace.ops:
        dst = layer_of[op.node]
        for a in op.inputs:
            producer = trace.op_of.get(a)
            if producer is None or a not in trace.tainted or layer_of[producer.node] == dst:
                continue
            src = layer_of[producer.node]
            sources[dst].add(src)
            sent[src].setdefault(trace.root.get(a, a), scale.nbytes(_tensors(a.meta["val"])[0]))
    return [sorted(s) for s in sources], [sum(d.values()) for d in sent]


def _block_ops(trace: _Trace, g: _Group, scale: _Scale) -> tuple[list[Op], list[Any]]:
    """The block's Ops and the structural facts Ops do not hold (targets, params, external edges)."""
    prefix = f"{g.key}." if g.key else ""
    names: dict[_OpNode, str] = {}
    counts: dict[str, int] = {}
    saved: set[fx.Node] = set()
    ops: list[Op] = []
    signature: list[Any] = []
    for op in g.ops:
        rel = op.path[len(prefix) :] if prefix and op.path.startswith(prefix) else op.path
        rel = "" if g.key is not None and op.path == g.key else rel
        base = f"{rel}.{op.opname}" if rel else op.opname
        counts[base] = counts.get(base, 0) + 1
        names[op] = base if counts[base] == 1 else f"{base}_{counts[base] - 1}"
        producers = [trace.op_of.get(a) for a in op.inputs]
        local = tuple(dict.fromkeys(names[p] for p in producers if p is not None and p in names))
        ops.append(_make_op(trace, op, names[op], local, saved, scale))
        signature.append(
            [
                op.target,
                [(_strip(trace.param_of[a], prefix), _shape(a)) for a in op.inputs if a in trace.param_of],
                [_shape(a) for a, p in zip(op.inputs, producers, strict=True) if p not in names],
            ]
        )
    return ops, signature


def _strip(fqn: str, prefix: str) -> str:
    return fqn[len(prefix) :] if prefix and fqn.startswith(prefix) else fqn


def _shape(node: fx.Node) -> list[int]:
    tensors = _tensors(node.meta.get("val"))
    return [int(d) for d in tensors[0].shape] if tensors else []


def _make_op(
    trace: _Trace, op: _OpNode, name: str, inputs: tuple[str, ...], saved: set[fx.Node], scale: _Scale
) -> Op:
    """One Op with per-sample figures; `saved` holds the layer's already-saved tensors."""
    is_view = op.kind is OpKind.VIEW
    read = sum(scale.nbytes(_tensors(a.meta["val"])[0]) for a in op.inputs)
    written = sum(scale.nbytes(t) for t in op.outputs)
    saved_bytes = 0.0
    for root, nbytes in _saved(trace, op, scale):
        if root not in saved:
            saved.add(root)
            saved_bytes += nbytes
    return Op(
        name=name,
        kind=op.kind,
        flops=op.flops / scale.batch,
        bytes_read=0.0 if is_view else read,
        bytes_written=0.0 if is_view else written,
        param_bytes=float(sum(trace.params[f] for f in op.owned) * scale.dtype.nbytes),
        saved_bytes=saved_bytes,
        output_shape=tuple(int(d) for d in op.outputs[0].shape) if op.outputs else (),
        partition_dims=_partition_dims(trace, op, scale),
        inputs=inputs,
    )


def _saved(trace: _Trace, op: _OpNode, scale: _Scale) -> list[tuple[fx.Node, float]]:
    """Tensors this op keeps for backward, as (storage root, per-sample bytes)."""
    acts = [a for a in op.inputs if a in trace.tainted and a not in trace.param_of]

    def entry(n: fx.Node) -> tuple[fx.Node, float]:
        return trace.root.get(n, n), scale.nbytes(_tensors(n.meta["val"])[0])

    kind, out = op.kind, op.outputs[0] if op.outputs else None
    if kind in (OpKind.MATMUL, OpKind.CONV) or op.opname in ("mul", "div"):
        return [entry(a) for a in acts]
    if kind is OpKind.ATTENTION and out is not None:
        return [entry(a) for a in acts[:3]] + [(op.node, scale.nbytes(out))]
    if kind is OpKind.SOFTMAX and out is not None and op.node in trace.tainted:
        return [(op.node, scale.nbytes(out))]
    if (kind is OpKind.LAYERNORM or op.opname in _NONLINEAR) and op.inputs and op.inputs[0] in acts:
        return [entry(op.inputs[0])]
    if op.opname in _DROPOUTS and kind is OpKind.ELEMENTWISE and out is not None and acts:
        return [(op.node, out.numel() / scale.batch)]  # a 1-byte mask per element
    if kind is OpKind.EMBEDDING:
        ints = [a for a in acts if not _tensors(a.meta["val"])[0].dtype.is_floating_point]
        return [entry(a) for a in ints]
    return []


def _partition_dims(trace: _Trace, op: _OpNode, scale: _Scale) -> tuple[PartitionDim, ...]:
    """Dimensions the op may be split along, in PartitionDim order."""
    dims: set[PartitionDim] = set()
    shape = tuple(op.outputs[0].shape) if op.outputs else ()
    tokens = scale.batch * scale.seq_len
    if shape and shape[0] in (scale.batch, tokens):
        dims.add(PartitionDim.BATCH)
    if scale.seq_len in shape or (shape and shape[0] == tokens):
        dims.add(PartitionDim.SEQUENCE)
    has_weight = any(a in trace.param_of for a in op.inputs)
    if op.kind in (OpKind.MATMUL, OpKind.CONV) and has_weight:
        dims.update((PartitionDim.HIDDEN_IN, PartitionDim.HIDDEN_OUT))
    if op.kind is OpKind.ATTENTION:
        dims.add(PartitionDim.HEADS)
    if op.kind is OpKind.EMBEDDING:
        dims.add(PartitionDim.HIDDEN_OUT)
    if _EXPERTS.search(op.path):
        dims.add(PartitionDim.EXPERTS)
    return tuple(d for d in PartitionDim if d in dims)


def _digest(payload: Sequence[Any]) -> str:
    """sha256 of a JSON payload, first 16 hex characters."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]
