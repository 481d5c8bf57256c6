"""Records of a traced graph: the nodes that become Ops, the relations between them, the scale.

See `tagplan/frontends/torch_export.py` for the conventions these records serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType


@dataclass(frozen=True)
class Scale:
    """Turns traced tensors into per-sample bytes in the requested dtype."""

    dtype: DType
    batch: int
    seq_len: int

    def nbytes(self, t: torch.Tensor) -> float:
        """Bytes of `t` per sample: floats in `dtype`, integers and bools in their own size."""
        itemsize = self.dtype.nbytes if t.dtype.is_floating_point else t.dtype.itemsize
        return t.numel() * itemsize / self.batch


@dataclass(eq=False)
class OpNode:
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
class Trace:
    """The traced graph with the relations Op figures need."""

    ops: list[OpNode]
    op_of: dict[fx.Node, OpNode]  # tensor node -> op that produced it (getitem resolved)
    params: dict[str, int]  # FQN -> numel
    param_of: dict[fx.Node, str]  # tensor node -> parameter it is (a view of)
    root: dict[fx.Node, fx.Node]  # tensor node -> node whose storage it is (size-preserving views)
    tainted: set[fx.Node]  # nodes computed from the user inputs


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside a traced value (a tensor, or nested tuples/lists of them)."""
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def first_tensor(node: fx.Node) -> torch.Tensor:
    """The first tensor a tensor-valued node produced (its traced `val`)."""
    return tensors(node.meta["val"])[0]


def val_numel(node: fx.Node) -> int:
    """Elements of the node's first traced tensor; -1 when it produced none."""
    found = tensors(node.meta.get("val"))
    return found[0].numel() if found else -1


def node_shape(node: fx.Node) -> list[int]:
    """Shape of the node's first traced tensor; [] when it produced none."""
    found = tensors(node.meta.get("val"))
    return [int(d) for d in found[0].shape] if found else []
