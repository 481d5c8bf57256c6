"""Scale and the tensor helpers of tagplan/frontends/tracing/nodes.py."""

import pytest
import torch
from torch import fx

from tagplan.frontends.tracing.nodes import Scale, first_tensor, node_shape, tensors, val_numel
from tagplan.ir.workload import DType


def node_with(val: object) -> fx.Node:
    node = fx.Graph().placeholder("x")
    node.meta["val"] = val
    return node


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.float32, 8 * 2), (torch.float16, 8 * 2), (torch.int64, 8 * 8), (torch.bool, 8 * 1)],
)
def test_nbytes_is_per_sample_floats_in_the_requested_dtype(dtype: torch.dtype, expected: float) -> None:
    t = torch.empty(4, 8, dtype=dtype, device="meta")  # batch 4, 8 elements per sample
    assert Scale(DType.BF16, batch=4, seq_len=8).nbytes(t) == expected


def test_nbytes_follows_the_requested_float_dtype() -> None:
    t = torch.empty(2, 3, device="meta")
    assert Scale(DType.FP32, batch=2, seq_len=3).nbytes(t) == 3 * 4


def test_tensors_flattens_nested_values_and_skips_non_tensors() -> None:
    a, b = torch.empty(1, device="meta"), torch.empty(2, device="meta")
    assert tensors((a, [3, (b, None)])) == [a, b]
    assert tensors(None) == [] and tensors(7) == []


def test_shape_helpers_read_the_first_traced_tensor() -> None:
    node = node_with((torch.empty(2, 5, device="meta"), torch.empty(3, device="meta")))
    assert first_tensor(node).shape == (2, 5)
    assert val_numel(node) == 10
    assert node_shape(node) == [2, 5]


def test_shape_helpers_on_a_node_without_tensors() -> None:
    node = node_with(4)
    assert val_numel(node) == -1
    assert node_shape(node) == []
    assert val_numel(fx.Graph().placeholder("bare")) == -1
