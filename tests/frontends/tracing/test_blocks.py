"""Blocks from layer groups: structural hashes, sharing, op names relative to the layer."""

from collections.abc import Callable

import torch
from torch import nn

from tagplan.frontends.tracing.blocks import build_blocks, digest
from tagplan.frontends.tracing.layers import layer_groups
from tagplan.frontends.tracing.nodes import Scale, Trace
from tagplan.ir.workload import DType

TraceOf = Callable[..., Trace]


def test_digest_is_16_hex_characters_and_ignores_key_order() -> None:
    a = digest([{"x": 1, "y": [2, 3]}])
    assert len(a) == 16 and int(a, 16) >= 0
    assert a == digest([{"y": [2, 3], "x": 1}])
    assert a != digest([{"x": 1, "y": [3, 2]}])


class Stack(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        ins = [8, *widths[:-1]]
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(i, o), nn.ReLU()) for i, o in zip(ins, widths, strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, s, 8]
        for layer in self.layers:
            x = layer(x)
        return x


def blocks_of(trace_of: TraceOf, widths: list[int]) -> tuple[list[str], list[str], list[str]]:
    t = trace_of(Stack(widths), torch.zeros(2, 4, 8, device="meta"))
    blocks, layers = build_blocks(t, layer_groups(t.ops), Scale(DType.BF16, batch=2, seq_len=4))
    first = next(b for b in blocks if b.hash == layers[0].block)
    return [layer.name for layer in layers], [layer.block for layer in layers], [o.name for o in first.ops]


def test_identical_layers_share_a_block_and_different_ones_do_not(trace_of: TraceOf) -> None:
    names, hashes, ops = blocks_of(trace_of, [8, 8, 8, 16])
    assert names == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert hashes[0] == hashes[1] == hashes[2] != hashes[3]
    assert ops == ["0.linear", "1.relu"]  # paths relative to the layer's module
