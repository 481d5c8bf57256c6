"""Group traced ops into layers: layer keys from `nn_module_stack`, merging, naming, edges.

The rules (indexed containers, unkeyed runs, "embed"/"pre"/"head"/"post" names, merging of
layers with neither FLOPs nor parameters) are in the module docstring of
`tagplan/frontends/torch_export.py`.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from torch import fx

from tagplan.frontends.tracing.nodes import OpNode, Scale, Trace, first_tensor
from tagplan.ir.model import OpKind

_INDEXED = re.compile(r"(^|\.)\d+$")
_HEAVY = frozenset({OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION, OpKind.EMBEDDING})


@dataclass
class Group:
    """A run of ops that becomes one layer."""

    key: str | None
    ops: list[OpNode]
    name: str = ""
    kind: str = "block"


def layer_groups(ops: list[OpNode], *, split_independent: bool = False) -> list[Group]:
    """The layers of a traced op sequence, grouped, merged and named (`split_runs` when asked)."""
    groups = group_ops(ops)
    if split_independent:
        groups = [part for g in groups for part in split_runs(g)]
    return name_groups(merge_empty(merge_light(groups)))


def split_runs(g: Group) -> list[Group]:
    """Cut an unkeyed run where nothing after the cut reads what came before it and both sides hold
    parameters (the first tower's final norm and the second tower's input projection)."""
    if g.key is not None:
        return [g]
    index = {op.node: i for i, op in enumerate(g.ops)}
    earliest = [min((index[p] for p in map(_source, op.inputs) if p in index), default=i) for i, op in enumerate(g.ops)]
    parts: list[Group] = []
    start = 0
    for cut in range(1, len(g.ops)):
        later_reads = min(earliest[cut:])
        if later_reads >= cut and _owns(g.ops[start:cut]) and _owns(g.ops[cut:]):
            parts.append(Group(None, g.ops[start:cut]))
            start = cut
    parts.append(Group(None, g.ops[start:]))
    return parts


def _source(node: fx.Node) -> fx.Node:
    """The node a getitem chain selects from."""
    while node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _owns(ops: list[OpNode]) -> bool:
    return any(op.owned for op in ops)


def layer_key(stack: tuple[str, ...], indexed: bool) -> str | None:
    """Outermost indexed module path; without indexed containers, the top-level child."""
    if indexed:
        return next((p for p in stack if _INDEXED.search(p)), None)
    inner = stack[-1] if stack else ""
    return inner.split(".")[0] or None


def group_ops(ops: list[OpNode]) -> list[Group]:
    """Split the op sequence into runs by layer key; unkeyed nodes inside a layer join it."""
    indexed = any(_INDEXED.search(p) for op in ops for p in op.stack)
    groups: list[Group] = []
    for op in ops:
        op.key = layer_key(op.stack, indexed)
        if groups and groups[-1].key == op.key:
            groups[-1].ops.append(op)
        elif op.key is not None and len(groups) >= 2 and groups[-1].key is None and groups[-2].key == op.key:
            groups[-2].ops.extend(groups.pop().ops)
            groups[-1].ops.append(op)
        else:
            groups.append(Group(op.key, [op]))
    return groups


def merge_light(groups: list[Group]) -> list[Group]:
    """Give a block the light ops that follow it outside any indexed module (`x = x + block(x)`).

    The leading run of an unkeyed group right after a keyed one, up to its first op that is not
    light (see `_light`), joins the keyed layer when it computes anything (a residual add, a
    scale); the rest stays a layer of its own.
    """
    out: list[Group] = []
    for g in groups:
        key = out[-1].key if out else None
        if g.key is None and key is not None:
            n = next((i for i, op in enumerate(g.ops) if not _light(op, key)), len(g.ops))
            if any(op.flops > 0 for op in g.ops[:n]):
                out[-1].ops.extend(g.ops[:n])
                if n < len(g.ops):
                    out.append(Group(None, g.ops[n:]))
                continue
        out.append(g)
    return out


def _light(op: OpNode, key: str) -> bool:
    """Run by a module enclosing the block `key` (not by a sibling such as a final norm), reading no
    parameter or buffer, and not a matmul, conv, attention or embedding."""
    enclosing = op.path == "" or key.startswith(op.path + ".")
    return enclosing and not op.owned and op.kind not in _HEAVY and not any(a.op == "get_attr" for a in op.inputs)


def merge_empty(groups: list[Group]) -> list[Group]:
    """Fold layers with neither FLOPs nor parameters into the next (or, at the end, previous)."""
    out: list[Group] = []
    pending: list[OpNode] = []
    for g in groups:
        if not any(op.flops > 0 or op.owned for op in g.ops):
            pending.extend(g.ops)
            continue
        out.append(Group(g.key, pending + g.ops))
        pending = []
    if pending and out:
        out[-1].ops.extend(pending)
    elif pending:
        out.append(Group(None, pending))
    return out


def name_groups(groups: list[Group]) -> list[Group]:
    """Name each layer and give it a kind (embedding, block, head, other)."""
    keyed = [i for i, g in enumerate(groups) if g.key is not None]
    short = short_names([g.key for g in groups if g.key is not None])
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


def short_names(keys: list[str]) -> dict[str, str]:
    """Layer names from keys: drop the leading path common to all (`transformer.h.3` -> `h.3`)."""
    stems = [k.split(".")[:-1] for k in keys]
    common = 0
    while stems and all(len(s) > common and s[common] == stems[0][common] for s in stems):
        common += 1
    return {k: ".".join(k.split(".")[max(0, min(common, len(k.split(".")) - 2)) :]) for k in keys}


def _middle_name(g: Group) -> str:
    """A layer between blocks is named after its modules that hold parameters."""
    paths: list[str] = []
    for op in g.ops:
        reads_params = op.owned or any(a.op == "get_attr" for a in op.inputs)
        if reads_params and op.path and op.path not in paths:
            paths.append(op.path)
    return "+".join(paths[:3]) or "mid"


def _uniquify(groups: list[Group]) -> None:
    """Number repeated layer names: the second `mid` becomes `mid#2`."""
    seen: dict[str, int] = {}
    for g in groups:
        n = seen.get(g.name, 0)
        seen[g.name] = n + 1
        if n:
            g.name = f"{g.name}#{n + 1}"


def layer_edges(trace: Trace, groups: list[Group], scale: Scale) -> tuple[list[list[int]], list[float]]:
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
            sent[src].setdefault(trace.root.get(a, a), scale.nbytes(first_tensor(a)))
    return [sorted(s) for s in sources], [sum(d.values()) for d in sent]


def layer_inputs(i: int, sources: list[int]) -> tuple[int, ...] | None:
    """`Layer.inputs` for layer `i`: None means "the previous layer" (or, first, the model inputs)."""
    return None if sources == [i - 1] or (i == 0 and not sources) else tuple(sources)
