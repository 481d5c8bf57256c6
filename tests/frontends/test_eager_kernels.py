"""The analytic blocks' eager kernel counts (`Op.eager_kernels`) against a count of the kernels tagplan's own
torch modules dispatch under autocast (`profiling.iterations` GPT block, `profiling.layers.LlamaBlock`)."""

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tagplan.cost.compute import issued_kernels
from tagplan.frontends.families import TransformerShape, gpt_block, llama_block
from tagplan.ir import Block
from tagplan.profiling.iterations import _Block
from tagplan.profiling.layers import LlamaBlock

_NO_KERNEL = {"aten.detach", "aten.empty", "aten.empty_strided", "aten.lift_fresh", "aten._unsafe_view", "aten.t"}


class _Kernels(TorchDispatchMode):
    """Counts dispatched aten ops that run a kernel (not views); a norm module's ops count as one (CUDA runs
    LayerNorm and RMSNorm as one kernel each; the CPU decomposes RMSNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.inside_norm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view and str(func.overloadpacket) not in _NO_KERNEL and not self.inside_norm:
            self.count += 1
        return out


def _forward_kernels(module: nn.Module, x: torch.Tensor, *, autocast: bool = True) -> tuple[int, Callable[[], int]]:
    """(forward kernels, a function counting the backward's) of `module` on `x` under bf16 autocast (`autocast`
    False: in fp32, as the CPU testbed runs)."""
    mode = _Kernels()
    for norm in (m for m in module.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm)):
        def enter(*_: object, mode: _Kernels = mode) -> None:
            mode.count += 1  # the norm's own kernel
            mode.inside_norm += 1

        def leave(*_: object, mode: _Kernels = mode) -> None:
            mode.inside_norm -= 1
        norm.register_forward_pre_hook(enter)
        norm.register_forward_hook(leave)
    x = x.requires_grad_(True)
    with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    grad = torch.randn_like(y)

    def backward() -> int:
        counted = _Kernels()
        with counted:
            y.backward(grad)
        return counted.count
    return mode.count, backward


def _totals(block: Block, *, autocast: bool = True, sixteen_bit_weights: bool = False) -> tuple[int, int]:
    assert all(op.eager_kernels is not None for op in block.ops)
    kernels = [issued_kernels(op, eager=True, autocast=autocast, sixteen_bit_weights=sixteen_bit_weights)
               for op in block.ops]
    return sum(k[0] for k in kernels), sum(k[1] for k in kernels)


def test_gpt_block_issues_the_kernels_its_eager_module_dispatches() -> None:
    forward, backward = _forward_kernels(_Block(64, 4), torch.randn(2, 16, 64))
    ir_forward, ir_backward = _totals(gpt_block(TransformerShape(layers=1, hidden=64, heads=4), 16, 2))
    assert ir_forward == pytest.approx(forward, abs=1)
    assert ir_forward + ir_backward == pytest.approx(forward + backward(), rel=0.05)


def test_llama_block_issues_about_twice_a_gpt_blocks_kernels_as_its_eager_module_does() -> None:
    shape = TransformerShape(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    forward, backward = _forward_kernels(LlamaBlock(shape, tp=1), torch.randn(2, 16, 64))
    ir_forward, ir_backward = _totals(llama_block(shape, 16, 2))
    assert ir_forward == forward  # the rotary table and rotation, the casts of each projection's input and weight
    # the CPU decomposes RMSNorm's backward into a dozen ops each (CUDA: one kernel), so the CPU counts more
    counted = backward()
    assert ir_backward == pytest.approx(counted, rel=0.35) and ir_backward < counted
    gpt_forward, gpt_backward = _totals(gpt_block(TransformerShape(layers=1, hidden=64, heads=4), 16, 2))
    assert 1.8 < (ir_forward + ir_backward) / (gpt_forward + gpt_backward) < 2.6


def test_without_autocast_the_blocks_issue_their_kernels_less_the_casts() -> None:
    """An fp32 runtime (the CPU testbed's torch program) dispatches no weight, bias or input casts: forward the
    GPT block's GEMMs, norms, SDPA and pointwise ops alone, the Llama block's also the rotary tables uncast."""
    forward, backward = _forward_kernels(_Block(64, 4), torch.randn(2, 16, 64), autocast=False)
    ir_forward, ir_backward = _totals(gpt_block(TransformerShape(layers=1, hidden=64, heads=4), 16, 2), autocast=False)
    assert ir_forward == pytest.approx(forward, abs=1)
    assert ir_backward == pytest.approx(backward(), abs=1)
    assert ir_forward + ir_backward < 0.65 * sum(_totals(gpt_block(TransformerShape(layers=1, hidden=64, heads=4),
                                                                   16, 2)))  # a third of bf16's are casts
    shape = TransformerShape(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    forward, _ = _forward_kernels(LlamaBlock(shape, tp=1), torch.randn(2, 16, 64), autocast=False)
    assert _totals(llama_block(shape, 16, 2), autocast=False)[0] == forward


@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("runtime", ["autocast", "fp32", "bf16-weights"])
def test_an_expert_bank_issues_the_kernels_of_the_torch_programs_loop_over_its_experts(experts: int,
                                                                                      runtime: str) -> None:
    """The moe block's kernels beyond a llama block's (router, routing, every expert's GEMMs and its gathers and
    scatters) against the same difference between the exported program's moe and llama blocks, under autocast, in
    fp32 and held in bf16 (no autocast: the combine casts nothing back)."""
    from tagplan.export.modules import Block as ProgramBlock
    from tagplan.export.shapes import model_config

    torch.manual_seed(0)
    dense = "llama?layers=1&hidden=64&heads=4&kv_heads=2&vocab=100&ffn=128"
    dtype, default = torch.bfloat16 if runtime == "bf16-weights" else torch.float32, torch.get_default_dtype()
    counted = []
    for spec in (dense, f"moe?layers=1&hidden=64&heads=4&kv_heads=2&vocab=100&ffn=128&experts={experts}&top_k=2"):
        torch.set_default_dtype(dtype)
        try:
            block = ProgramBlock(model_config(spec, seq_len=16))
        finally:
            torch.set_default_dtype(default)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.1)
        forward, backward = _forward_kernels(block, torch.randn(2, 16, 64, dtype=dtype), autocast=runtime == "autocast")
        counted.append((forward, backward()))
    shape = TransformerShape(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100, experts=experts, top_k=2)
    flags = {"autocast": runtime == "autocast", "sixteen_bit_weights": runtime == "bf16-weights"}
    ir_dense = _totals(llama_block(shape, 16, 2), **flags)
    ir_moe = _totals(llama_block(shape, 16, 2, moe=True), **flags)
    assert ir_moe[0] - ir_dense[0] == counted[1][0] - counted[0][0]  # e.g. 66 forward with 4 experts under autocast
    assert ir_moe[1] - ir_dense[1] == pytest.approx(counted[1][1] - counted[0][1], abs=1)


def test_over_16_bit_weights_the_blocks_issue_their_kernels_less_the_weights_and_inputs_casts() -> None:
    """A module held in bf16 and run without autocast (FSDP's mixed precision, `Workload.eager_16bit_weights`)
    casts no weight or input; the Llama block still casts its rotary tables (computed in fp32) to bf16."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        gpt = _Block(64, 4)
        shape = TransformerShape(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
        llama = LlamaBlock(shape, tp=1)
    finally:
        torch.set_default_dtype(default)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    forward, backward = _forward_kernels(gpt, x, autocast=False)
    ir_forward, ir_backward = _totals(gpt_block(TransformerShape(layers=1, hidden=64, heads=4), 16, 2),
                                      autocast=False, sixteen_bit_weights=True)
    assert ir_forward == pytest.approx(forward, abs=1)
    assert ir_backward == pytest.approx(backward(), abs=1)
    forward, _ = _forward_kernels(llama, x, autocast=False)
    block = llama_block(shape, 16, 2)
    assert _totals(block, autocast=False, sixteen_bit_weights=True)[0] == forward
    assert _totals(block, autocast=False)[0] < forward  # an fp32 program casts no table
