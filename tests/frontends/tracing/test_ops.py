"""Op classification and per-node figures of tagplan/frontends/tracing/ops.py."""

from collections.abc import Callable

import pytest
import torch
from torch import fx, nn

from tagplan.frontends.tracing.nodes import OpNode, Scale, Trace
from tagplan.frontends.tracing.ops import dropout_active, make_op, op_flops, partition_dims
from tagplan.ir.model import OpKind, PartitionDim
from tagplan.ir.workload import DType

TraceOf = Callable[..., Trace]


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [2, 4, 8]
        y = torch.relu(self.norm(self.fc(x))).softmax(-1)  # [2, 4, 8]
        return y.view(2, 32).sum(-1) + x.to(torch.float32).sum() + x.to(torch.bfloat16).float().mean()


def test_kinds_of_common_aten_ops(trace_of: TraceOf) -> None:
    t = trace_of(Mixed(), torch.zeros(2, 4, 8, device="meta"))
    kinds = [(op.opname, op.kind) for op in t.ops]
    assert kinds[:6] == [
        ("linear", OpKind.MATMUL), ("layer_norm", OpKind.LAYERNORM), ("relu", OpKind.ELEMENTWISE),
        ("softmax", OpKind.SOFTMAX), ("view", OpKind.VIEW), ("sum", OpKind.REDUCTION),
    ]  # fmt: skip
    casts = [op.kind for op in t.ops if op.opname == "to"]
    assert casts == [OpKind.VIEW, OpKind.ELEMENTWISE, OpKind.ELEMENTWISE]  # same-dtype cast is free


def test_flops_add_what_the_counter_misses(trace_of: TraceOf) -> None:
    t = trace_of(Mixed(), torch.zeros(2, 4, 8, device="meta"))
    ops = {op.opname: op for op in t.ops}
    out = 2 * 4 * 8
    assert ops["linear"].flops == 2 * out * 8
    assert ops["layer_norm"].flops == ops["softmax"].flops == 5 * out
    assert ops["relu"].flops == out and ops["view"].flops == 0
    assert ops["mean"].flops == out  # one add per input element


@pytest.mark.parametrize(("train", "kind"), [(True, OpKind.ELEMENTWISE), (False, OpKind.VIEW)])
def test_dropout_is_costed_only_in_training(trace_of: TraceOf, train: bool, kind: OpKind) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)).train(train)
    t = trace_of(model, torch.zeros(2, 4, 8, device="meta"))
    drop = next(op for op in t.ops if op.opname == "dropout")
    assert drop.kind is kind
    assert dropout_active(drop.node) is train


def node_of(*shape: int) -> fx.Node:
    node = fx.Graph().placeholder("x")
    node.meta["val"] = torch.empty(*shape, device="meta")
    return node


def test_custom_matmuls_get_two_flops_per_multiply_add() -> None:
    x, out = node_of(6, 8), torch.empty(6, 5, device="meta")
    assert op_flops(OpKind.MATMUL, 0.0, [x], [out]) == 2 * 6 * 5 * 8
    assert op_flops(OpKind.MATMUL, 7.0, [x], [out]) == 7.0  # the counter saw it
    assert op_flops(OpKind.REDUCTION, 0.0, [x], [torch.empty(6, device="meta")]) == 6 * 8
    assert op_flops(OpKind.OTHER, 3.0, [x], [out]) == 3.0


def op_at(path: str, kind: OpKind, *shape: int) -> OpNode:
    node = fx.Graph().placeholder("x")
    out = torch.empty(*shape, device="meta")
    return OpNode(node=node, kind=kind, opname="op", target="op", path=path, stack=(path,), flops=0.0,
                  inputs=[], outputs=[out])  # fmt: skip


def test_partition_dims_from_shapes_kind_and_path() -> None:
    trace = Trace(ops=[], op_of={}, params={}, param_of={}, root={}, tainted=set())
    scale = Scale(DType.BF16, batch=2, seq_len=4)
    assert partition_dims(trace, op_at("attn", OpKind.ATTENTION, 2, 3, 4, 8), scale) == (
        PartitionDim.BATCH, PartitionDim.SEQUENCE, PartitionDim.HEADS,
    )  # fmt: skip
    tokens = partition_dims(trace, op_at("moe.experts.1", OpKind.ELEMENTWISE, 8, 16), scale)
    assert tokens == (PartitionDim.BATCH, PartitionDim.SEQUENCE, PartitionDim.EXPERTS)
    assert partition_dims(trace, op_at("expertise", OpKind.MATMUL, 3, 5), scale) == ()  # no weight, no match


def test_training_dropout_saves_a_one_byte_mask(trace_of: TraceOf) -> None:
    t = trace_of(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)).train(), torch.zeros(2, 4, 8, device="meta"))
    drop = next(op for op in t.ops if op.opname == "dropout")
    op = make_op(t, drop, "drop", (), set(), Scale(DType.BF16, batch=2, seq_len=4))
    assert op.saved_bytes == 4 * 8  # one byte per element, per sample
    assert op.bytes_read == op.bytes_written == 4 * 8 * 2
