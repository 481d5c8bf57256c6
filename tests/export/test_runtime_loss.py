"""The exported program's fused cross-entropy (tagplan.export.runtime_loss): PyTorch's numbers, less memory."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional

from tagplan.export import runtime_loss
from tagplan.export.runtime_loss import FusedCrossEntropy, kernel_of, token_losses
from tagplan.ir.workload import LossKernel

ROWS, VOCAB = 24, 50


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(ROWS, VOCAB, generator=g)).to(dtype).requires_grad_()
    return logits, torch.randint(0, VOCAB, (ROWS,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_elements", [1 << 24, 3 * VOCAB])  # one block of rows; several, the last short
def test_losses_and_gradients_are_pytorchs(dtype: torch.dtype, block_elements: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_loss, "BLOCK_ELEMENTS", block_elements)
    logits, target = _inputs(dtype)
    weights = torch.rand(ROWS)  # a gradient that differs per token
    (token_losses(logits, target) * weights).sum().backward()
    fused = logits.grad
    assert fused is not None and fused.dtype == dtype
    logits.grad = None
    expected = functional.cross_entropy(logits.float(), target, reduction="none")
    (expected * weights).sum().backward()
    got = token_losses(logits.detach(), target)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: both round the gradient to 8 bits of mantissa
    torch.testing.assert_close(fused.float(), logits.grad.float(), rtol=tol, atol=tol)


def test_it_keeps_the_logits_themselves_and_one_figure_per_token() -> None:
    """What the cost model's fused loss assumes: the 16-bit logits (not an fp32 copy) are all it keeps of size
    rows x vocabulary; PyTorch's eager loss keeps an fp32 tensor of that size."""

    def saved(loss_of) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        kept: list[torch.Tensor] = []
        logits, target = _inputs(torch.bfloat16)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            loss_of(logits, target).sum()
        big = [t for t in kept if t.numel() >= ROWS * VOCAB]
        return [logits, *big]

    logits, *big = saved(token_losses)
    assert len(big) == 1 and big[0].dtype == torch.bfloat16 and big[0].data_ptr() == logits.data_ptr()
    _, *eager = saved(lambda x, t: functional.cross_entropy(x.float(), t, reduction="none"))
    assert any(t.dtype == torch.float32 for t in eager)


def test_a_vocabulary_split_needs_its_group_and_its_first_class() -> None:
    """The classes of a rank's part: a target outside it contributes no logit (the other ranks' do)."""
    logits, target = _inputs(torch.float32)
    half = VOCAB // 2
    mine = target < half  # rank 0's part holds these targets
    losses = FusedCrossEntropy.apply(logits[:, :half].detach(), target, None, 0)
    alone = functional.cross_entropy(logits[:, :half].detach(), target.clamp(max=half - 1), reduction="none")
    torch.testing.assert_close(losses[mine], alone[mine])  # without the group: the part's own softmax
    rest = torch.logsumexp(logits[:, :half].detach(), dim=-1)
    torch.testing.assert_close(losses[~mine], rest[~mine])  # the target's logit sits on another rank


def test_the_program_reads_its_loss() -> None:
    assert kernel_of({"loss": "fused"}) is LossKernel.FUSED
    assert kernel_of({}) is LossKernel.EAGER  # a program written before the key
    for value in ("liger", "in-place"):  # Megatron-Core's in-place loss is no kernel the program has
        with pytest.raises(ValueError, match=rf"plan.json loss = '{value}': the program runs 'eager' or 'fused'"):
            kernel_of({"loss": value})


def _graph_names(loss: torch.Tensor) -> set[str]:
    names, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(type(node).__name__)
            stack.extend(fn for fn, _ in node.next_functions)
    return names


def test_the_programs_loss_split_runs_the_kernel_its_plan_json_names() -> None:
    """`LossSplit.loss`, which both runtimes call: eager PyTorch's, or the fused function, with the same mean."""
    from tagplan.export.runtime_parallel import LossSplit

    logits, target = _inputs(torch.float32)
    x, y = logits.reshape(2, ROWS // 2, VOCAB), target.reshape(2, ROWS // 2)
    fused, eager = LossSplit(kernel=LossKernel.FUSED).loss(x, y), LossSplit().loss(x, y)
    assert any("FusedCrossEntropy" in n for n in _graph_names(fused))
    assert not any("FusedCrossEntropy" in n for n in _graph_names(eager))
    torch.testing.assert_close(fused, eager)
    torch.testing.assert_close(LossSplit(kernel=LossKernel.FUSED).loss(x, y, reduction="sum"),
                               LossSplit().loss(x, y, reduction="sum"))


def test_the_last_stage_hands_its_16_bit_logits_to_a_fused_loss_which_keeps_them() -> None:
    """Under bf16 autocast a stage hands back fp32 (stages exchange one dtype), except the last one under a fused
    loss (`set_compute`), whose bf16 logits the loss then keeps without an fp32 copy."""
    from tagplan.export.runtime_parallel import LossSplit, StageModule
    from tagplan.export.runtime_train import set_compute

    torch.manual_seed(0)
    parts = {0: StageModule({0: torch.nn.Linear(8, 8)}), 1: StageModule({1: torch.nn.Linear(8, VOCAB)})}
    for kernel, last_dtype in ((LossKernel.EAGER, torch.float32), (LossKernel.FUSED, torch.bfloat16)):
        set_compute({"stages": [{}, {}], "loss": kernel.value}, parts, torch.bfloat16)
        hidden = parts[0](torch.randn(2, ROWS // 2, 8))
        logits = parts[1](hidden)
        assert hidden.dtype == torch.float32 and logits.dtype == last_dtype
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        LossSplit(kernel=LossKernel.FUSED).loss(logits, torch.randint(0, VOCAB, (2, ROWS // 2))).backward()
    assert [t.dtype for t in kept if t.numel() >= ROWS * VOCAB] == [torch.bfloat16]
    assert parts[1].layers["1"].weight.grad is not None
    set_compute({"stages": [{}, {}], "loss": "fused"}, parts, None)  # fp32 (verify): nothing to hand back
    assert parts[1](hidden).dtype == torch.float32


def test_a_target_logit_of_minus_infinity_elsewhere_stays_finite() -> None:
    """A rank whose part does not hold a row's target reads a clamped index there; a -inf logit at that index
    must not turn the row's loss into NaN (-inf x 0)."""
    logits, target = _inputs(torch.float32)
    target = torch.full_like(target, VOCAB - 1)  # outside the part [0, VOCAB / 2)
    part = logits[:, :VOCAB // 2].detach().clone()
    part[:, VOCAB // 2 - 1] = -math.inf
    assert torch.isfinite(FusedCrossEntropy.apply(part, target, None, 0)).all()


class _Ranks:
    """The two DeviceMesh calls a vocabulary split reads, for rank `rank` of `size`."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.ranks = rank, size

    def size(self) -> int:
        return self.ranks

    def get_local_rank(self) -> int:
        return self.rank


@pytest.mark.parametrize(("vocab", "size", "parts"), [(128, 2, [(0, 64), (64, 64)]),
                                                      (127, 2, [(0, 64), (64, 63)]),
                                                      (50257, 4, [(0, 12565), (12565, 12565), (25130, 12565),
                                                                  (37695, 12562)])])
def test_a_vocabulary_split_reads_the_rows_as_torch_chunk_deals_them(vocab: int, size: int,
                                                                     parts: list[tuple[int, int]]) -> None:
    """Each rank's first class and class count, as `torch.chunk` splits the head's rows (the example output of a
    pipelining stage and the fused loss's target offsets both read them)."""
    from tagplan.export.runtime_parallel import LossSplit

    dealt = [(int(c[0]), len(c)) for c in torch.arange(vocab).chunk(size)]
    assert dealt == parts
    for rank, (start, count) in enumerate(parts):
        split = LossSplit("vocab", _Ranks(rank, size), LossKernel.FUSED, vocab)  # type: ignore[arg-type]
        assert (split.vocab_start(count), split.local_vocab()) == (start, count)
    assert LossSplit(kernel=LossKernel.FUSED, vocab=vocab).local_vocab() == vocab  # whole logits
