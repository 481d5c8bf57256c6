"""Run an exported graph on meta tensors and record it: per-node FLOPs, ops, views, parameters.

Produces the `Trace` the layer and block builders read (see `tracing/nodes.py`): which nodes
are activations, which are (views of) parameters, which storage a view shares, and which op
first reads each parameter (tied weights count once; a later layer's op reading a parameter of the
first layer carries its bytes in `Op.shared_param_bytes` instead, see `ops.tied_reads`).
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from tagplan.frontends.tracing.nodes import OpNode, Trace, tensors, val_numel
from tagplan.frontends.tracing.ops import op_flops, op_kind
from tagplan.ir.model import OpKind


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


def node_flops(gm: fx.GraphModule, flat_inputs: list[Any]) -> dict[fx.Node, float]:
    """FLOPs of every node for the example batch (higher-order ops include their bodies)."""
    counter = FlopCounterMode(display=False)
    interp = _FlopInterpreter(gm, counter)
    with counter, torch.no_grad():
        interp.run(*flat_inputs)
    return interp.flops


def opname(target: Any) -> str:
    """Short op name: `linear` for aten.linear.default, `add` for aten.add_.Tensor."""
    name = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return str(name)


def module_stack(node: fx.Node) -> tuple[str, ...]:
    """Module paths from outermost to innermost ('' is the root module)."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(re.sub(r"@\d+$", "", str(v[0])) for v in stack.values())


def trace_graph(gm: fx.GraphModule, flops: dict[fx.Node, float]) -> Trace:
    """Classify nodes, follow views and getitems, mark activations and assign parameters."""
    params = {fqn: p.numel() for fqn, p in gm.named_parameters(remove_duplicate=False)}
    params.update({fqn: b.numel() for fqn, b in gm.named_buffers() if b.requires_grad})
    t = Trace(ops=[], op_of={}, params=params, param_of={}, root={}, tainted=set())
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


def _visit(node: fx.Node, flops: float, t: Trace) -> None:
    """Record one call_function node as an op, or as an alias of its producer (getitem)."""
    if node.target is operator.getitem:
        _alias(node, t)
        return
    outputs = tensors(node.meta.get("val"))
    if not outputs and flops == 0:
        return  # asserts and symbolic-size arithmetic
    inputs = [a for a in node.all_input_nodes if tensors(a.meta.get("val"))]
    name = opname(node.target)
    kind = op_kind(node, name, inputs, outputs)
    stack = module_stack(node)
    op = OpNode(
        node=node, kind=kind, opname=name, target=str(node.target), path=stack[-1] if stack else "",
        stack=stack, flops=op_flops(kind, flops, inputs, outputs), inputs=inputs, outputs=outputs,
    )  # fmt: skip
    t.ops.append(op)
    t.op_of[node] = op
    first = inputs[0] if inputs else None
    if kind is OpKind.VIEW and first is not None:
        if first in t.param_of:
            t.param_of[node] = t.param_of[first]
        if outputs and val_numel(first) == outputs[0].numel():
            t.root[node] = t.root.get(first, first)


def _alias(node: fx.Node, t: Trace) -> None:
    """A getitem stands for its source's producer and parameter."""
    src = node.args[0]
    if isinstance(src, fx.Node):
        if src in t.op_of:
            t.op_of[node] = t.op_of[src]
        if src in t.param_of:
            t.param_of[node] = t.param_of[src]


def _claim_params(t: Trace) -> None:
    """Give each parameter to the first non-view op reading it (tied weights count once).

    Later readers own nothing; `blocks.build_blocks` marks those outside the first layer that read one
    of its parameters (a tied head) once layers are known (`ops.tied_reads`)."""
    claimed: set[str] = set()
    for op in t.ops:
        if op.kind is OpKind.VIEW:
            continue
        for a in op.inputs:
            fqn = t.param_of.get(a)
            if fqn is not None and fqn not in claimed:
                claimed.add(fqn)
                op.owned.append(fqn)
