"""What each traced node is and costs: its OpKind, FLOPs, bytes, saved bytes, partition dims.

The FLOP, byte and saved-for-backward conventions are listed in the module docstring of
`tagplan/frontends/torch_export.py`; this module implements them per node.
"""

from __future__ import annotations

import re

import torch
from torch import fx

from tagplan.frontends.tracing.nodes import OpNode, Scale, Trace, first_tensor, tensors, val_numel
from tagplan.ir.model import Op, OpKind, PartitionDim

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
_EXPERTS = re.compile(r"(^|\.)experts?(\.|$)")


def op_kind(node: fx.Node, opname: str, inputs: list[fx.Node], outputs: list[torch.Tensor]) -> OpKind:
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
    if is_view(node, opname, inputs, outputs):
        return OpKind.VIEW
    tags = getattr(node.target, "tags", ())
    if torch.Tag.reduction in tags or opname in _REDUCTIONS:
        return OpKind.REDUCTION
    if torch.Tag.pointwise in tags or opname in _ELEMENTWISE | _DROPOUTS | _CASTS:
        return OpKind.ELEMENTWISE
    return OpKind.OTHER


def is_view(node: fx.Node, opname: str, inputs: list[fx.Node], outputs: list[torch.Tensor]) -> bool:
    """Views, copies of layout, same-dtype casts and inactive dropout move no data we cost."""
    if opname in _VIEWS or opname.startswith("_assert"):
        return True
    if opname in _CASTS:
        src = tensors(inputs[0].meta.get("val")) if inputs else []
        return bool(src and outputs and src[0].dtype == outputs[0].dtype)
    if opname in _DROPOUTS:
        return not dropout_active(node)
    return False


def dropout_active(node: fx.Node) -> bool:
    """Whether a dropout node drops anything: training mode and p > 0."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return bool(train) and float(p) > 0  # type: ignore[arg-type]


def op_flops(kind: OpKind, counted: float, inputs: list[fx.Node], outputs: list[torch.Tensor]) -> float:
    """FLOPs for the example batch: FlopCounterMode's count plus what it does not see."""
    out = outputs[0].numel() if outputs else 0
    if kind is OpKind.ELEMENTWISE:
        return counted + out
    if kind in (OpKind.LAYERNORM, OpKind.SOFTMAX):
        return counted + 5 * out
    if kind is OpKind.REDUCTION:
        return counted + max(val_numel(inputs[0]) if inputs else 0, out)
    if kind is OpKind.MATMUL and counted == 0 and inputs and outputs:
        first = first_tensor(inputs[0])  # custom matmuls (grouped MoE): 2 * M * N * K
        return 2.0 * out * (first.shape[-1] if first.dim() else 1)
    return counted


def score_elements(op: OpNode, scale: Scale) -> float:
    """Attention's score-matrix elements per sample: queries (..., heads, s, d) against keys (..., s_kv, d)."""
    if op.kind is not OpKind.ATTENTION or len(op.inputs) < 2:
        return 0.0
    q, k = first_tensor(op.inputs[0]), first_tensor(op.inputs[1])
    if q.dim() < 2 or k.dim() < 2:
        return 0.0
    return float(q.numel() // max(int(q.shape[-1]), 1) * int(k.shape[-2])) / scale.batch


def is_causal(op: OpNode) -> bool:
    """Whether a traced attention call masks causally: its `is_causal` argument, by keyword or by its position in
    the ATen schema (scaled_dot_product_attention and its flash, efficient and cuDNN variants all name it). A
    mask passed as a tensor is not read: such calls count as unmasked, which costs them their whole score matrix."""
    if op.kind is not OpKind.ATTENTION:
        return False
    node = op.node
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    schema = getattr(node.target, "_schema", None)
    for index, argument in enumerate(getattr(schema, "arguments", ())):
        if argument.name == "is_causal" and index < len(node.args):
            return bool(node.args[index])
    return False


def make_op(
    trace: Trace,
    op: OpNode,
    name: str,
    inputs: tuple[str, ...],
    saved: set[fx.Node],
    scale: Scale,
    first_layer: frozenset[str] = frozenset(),
) -> Op:
    """One Op with per-sample figures; `saved` holds the layer's already-saved tensors, `first_layer` the
    parameters the model's first layer owns (pass them only for ops of later layers: see `tied_reads`)."""
    is_view = op.kind is OpKind.VIEW
    read = sum(scale.nbytes(first_tensor(a)) for a in op.inputs)
    written = sum(scale.nbytes(t) for t in op.outputs)
    shared = sum(trace.params[f] for f in tied_reads(trace, op, first_layer))
    saved_bytes = 0.0
    for root, nbytes in saved_tensors(trace, op, scale):
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
        shared_param_bytes=float(shared * scale.dtype.nbytes),
        saved_bytes=saved_bytes,
        score_elements=score_elements(op, scale),
        causal=is_causal(op),
        output_shape=tuple(int(d) for d in op.outputs[0].shape) if op.outputs else (),
        partition_dims=partition_dims(trace, op, scale),
        inputs=inputs,
    )


def tied_reads(trace: Trace, op: OpNode, first_layer: frozenset[str]) -> list[str]:
    """The parameters of `first_layer` (FQNs the model's first layer owns) that `op` reads without owning
    them, each once: a head tied to the token embedding. Views read none (the op they feed does).

    Only the first layer's parameters count (`Op.shared_param_bytes`): a parameter shared between two
    later layers stays with its owner alone, and its other readers mark nothing.
    """
    if op.kind is OpKind.VIEW:
        return []
    read = dict.fromkeys(trace.param_of[a] for a in op.inputs if a in trace.param_of)
    return [fqn for fqn in read if fqn in first_layer and fqn not in op.owned]


def saved_tensors(trace: Trace, op: OpNode, scale: Scale) -> list[tuple[fx.Node, float]]:
    """Tensors this op keeps for backward, as (storage root, per-sample bytes)."""
    acts = [a for a in op.inputs if a in trace.tainted and a not in trace.param_of]

    def entry(n: fx.Node) -> tuple[fx.Node, float]:
        return trace.root.get(n, n), scale.nbytes(first_tensor(n))

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
        ints = [a for a in acts if not first_tensor(a).dtype.is_floating_point]
        return [entry(a) for a in ints]
    return []


def partition_dims(trace: Trace, op: OpNode, scale: Scale) -> tuple[PartitionDim, ...]:
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
