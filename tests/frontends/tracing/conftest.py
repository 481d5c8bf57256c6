"""Shared helpers for the tracing tests: trace a tiny module on the meta device."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tagplan.frontends.tracing.nodes import Trace
from tagplan.frontends.tracing.trace import node_flops, trace_graph


def _trace_of(module: nn.Module, *args: Any) -> Trace:
    gm = torch.export.export(module.to("meta"), args, strict=False).module()
    assert isinstance(gm, torch.fx.GraphModule)
    return trace_graph(gm, node_flops(gm, list(args)))


@pytest.fixture
def trace_of() -> Callable[..., Trace]:
    """`trace_of(module, *meta_args)`: the Trace of `module(*meta_args)`."""
    return _trace_of
