"""Recording an exported graph: op names, module paths, FLOPs, activations, views, parameters."""

from collections.abc import Callable

import torch
from torch import fx, nn

from tagplan.frontends.tracing.nodes import Trace
from tagplan.frontends.tracing.trace import module_stack, opname
from tagplan.ir.model import OpKind

TraceOf = Callable[..., Trace]


def test_opname_drops_overload_and_inplace_suffix_but_not_dunders() -> None:
    assert opname(torch.ops.aten.linear.default) == "linear"
    assert opname(torch.ops.aten.add_.Tensor) == "add"
    assert opname(torch.ops.aten.__and__.Tensor) == "__and__"


def test_module_stack_is_outermost_first_without_call_counters() -> None:
    node = fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {
        "a": ("", nn.Module),
        "b": ("layers.0@1", nn.Module),
        "c": ("layers.0.fc", nn.Linear),
    }
    assert module_stack(node) == ("", "layers.0", "layers.0.fc")
    assert module_stack(fx.Graph().placeholder("y")) == ()


class Tied(nn.Module):
    """An embedding whose weight the output projection reuses, plus a constant table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, s]
        x = self.emb(ids)  # [b, s, 4]
        pos = torch.arange(4, device=ids.device).float()  # [4], not from the inputs
        return (x + pos) @ self.emb.weight.t()  # [b, s, 10]


def test_tied_weights_are_owned_by_the_first_reader(trace_of: TraceOf) -> None:
    t = trace_of(Tied(), torch.zeros(2, 3, dtype=torch.long, device="meta"))
    assert t.params == {"emb.weight": 40}
    owners = [(op.opname, op.owned) for op in t.ops if op.owned]
    assert owners == [("embedding", ["emb.weight"])]


def test_constants_are_not_activations(trace_of: TraceOf) -> None:
    t = trace_of(Tied(), torch.zeros(2, 3, dtype=torch.long, device="meta"))
    ops = {op.opname: op for op in t.ops}
    assert ops["arange"].node not in t.tainted
    assert ops["embedding"].node in t.tainted and ops["matmul"].node in t.tainted


def test_views_share_storage_and_parameter(trace_of: TraceOf) -> None:
    t = trace_of(Tied(), torch.zeros(2, 3, dtype=torch.long, device="meta"))
    view = next(op for op in t.ops if op.opname == "t")
    assert view.kind is OpKind.VIEW
    assert t.param_of[view.node] == "emb.weight"
    assert t.root[view.node] is view.inputs[0]


def test_flops_come_from_the_counter(trace_of: TraceOf) -> None:
    t = trace_of(nn.Sequential(nn.Linear(8, 16)), torch.zeros(2, 4, 8, device="meta"))
    (linear,) = t.ops
    assert linear.flops == 2 * 2 * 4 * 8 * 16  # whole example batch
    assert linear.path == "0" and linear.stack == ("", "0")  # root module first


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.split(2, dim=-1)
        return a * b


def test_getitem_resolves_to_the_producing_op(trace_of: TraceOf) -> None:
    t = trace_of(Pair(), torch.zeros(2, 4, device="meta"))
    mul = next(op for op in t.ops if op.opname == "mul")
    assert {t.op_of[a].opname for a in mul.inputs} == {"split"}
    assert all(op.opname != "getitem" for op in t.ops)
