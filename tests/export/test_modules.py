"""The torch program's own modules: the fused SwiGLU keeps what the memory model says it keeps."""

from __future__ import annotations

import torch


def test_the_fused_swiglu_matches_eager_gradients_and_keeps_two_tensors_not_three() -> None:
    from tagplan.export.modules import _GatedProduct

    gate = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_GatedProduct.apply, (gate, up))
    kept: dict[str, list[torch.Tensor]] = {"fused": [], "eager": []}
    for name, fn in (("fused", _GatedProduct.apply), ("eager", lambda g, u: torch.nn.functional.silu(g) * u)):
        with torch.autograd.graph.saved_tensors_hooks(lambda t, n=name: kept[n].append(t) or t, lambda t: t):
            fn(gate, up).sum().backward()
    assert len(kept["fused"]) == 2 and len(kept["eager"]) == 3  # gate and up; eager also keeps silu(gate)
