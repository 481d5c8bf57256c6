"""The exported program's cross-entropy: PyTorch's eager one, or a fused one that keeps the 16-bit logits.

`plan.json`'s "loss" (`Workload.loss` as the plan was costed, `export.checks.exported_loss`):
- "eager": `functional.cross_entropy` on the logits upcast to fp32 (a vocabulary split over the tensor-parallel
  ranks through DTensor's `loss_parallel`): it keeps the fp32 softmax, and its fp32 output and gradient are
  the step's largest transients;
- "fused": `FusedCrossEntropy`, which keeps the logits as the head wrote them (16-bit under autocast: the
  last stage hands them back so, `StageModule.hands_back_logits`) and a few figures per token (an index, a
  mask, the log-sum-exp), computes in fp32 a block of rows at a time, and writes the gradient in the logits'
  dtype: the logits and their gradient, as the cost model's fused loss holds them (`cost.memory`). A
  vocabulary split over tp ranks takes three all-reduces of one figure per token in its forward (the row
  maximum, the sum of exponentials, the target's logit) and none in its backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx
from torch.nn import functional

from tagplan.ir.workload import LossKernel

BLOCK_ELEMENTS = 1 << 24
"""Logits a block of rows holds (64 MiB in fp32): the fp32 working set beside the kept logits."""


def _blocks(rows: int, vocab: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class FusedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of `logits` [N, V_local] against `target` [N] (global class indices); the
    vocabulary may be split over `group` (this rank's classes `vocab_start` .. `vocab_start + V_local - 1`)."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, target: torch.Tensor,
                group: dist.ProcessGroup | None = None, vocab_start: int = 0) -> torch.Tensor:
        rows, vocab = logits.shape
        here = (target >= vocab_start) & (target < vocab_start + vocab)
        index = (target - vocab_start).clamp(0, vocab - 1)
        row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for b in _blocks(rows, vocab):
            row_max[b] = logits[b].float().amax(dim=-1)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.empty_like(row_max)
        for b in _blocks(rows, vocab):
            sums[b] = torch.exp(logits[b].float() - row_max[b, None]).sum(dim=-1)
        picked = torch.where(here, logits.gather(1, index[:, None]).squeeze(1).float(), 0.0)  # not -inf * 0
        if group is not None:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(picked, group=group)
        log_sum = row_max + sums.log()
        ctx.save_for_backward(logits, index, here, log_sum)
        return log_sum - picked

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, index, here, log_sum = ctx.saved_tensors  # type: ignore[attr-defined]
        rows, vocab = logits.shape
        out = torch.empty_like(logits)
        for b in _blocks(rows, vocab):
            part = torch.exp(logits[b].float() - log_sum[b, None])  # the softmax of these rows
            part[torch.arange(part.shape[0], device=part.device), index[b]] -= here[b].float()
            out[b] = (part * grad[b, None]).to(out.dtype)
        return out, None, None, None


def token_losses(logits: torch.Tensor, target: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                 vocab_start: int = 0) -> torch.Tensor:
    """`FusedCrossEntropy` of `logits` [..., V_local] against `target` [...]: fp32 per-token losses, flattened."""
    return FusedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group, vocab_start)


def eager_loss(logits: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean") -> torch.Tensor:
    """PyTorch's cross-entropy of `logits` [..., V] (upcast to fp32) against `target` [...]: the mean (or sum)
    over the tokens. The eager kernel the program runs, and the one-process reference `verify` compares with."""
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                                    reduction=reduction)


PROGRAM_KERNELS = (LossKernel.EAGER, LossKernel.FUSED)
"""The cross-entropies the program runs (`checks.exported_loss` maps every costed kernel onto one)."""


def kernel_of(cfg: dict[str, object]) -> LossKernel:
    """The loss `plan.json` asks for (a program written before the key existed: eager); ValueError naming the key,
    its value and what the program runs for anything else (Megatron's in-place loss is not one of them)."""
    value = str(cfg.get("loss", LossKernel.EAGER.value))
    accepted = [k.value for k in PROGRAM_KERNELS]
    if value not in accepted:
        raise ValueError(f"plan.json loss = {value!r}: the program runs {' or '.join(map(repr, accepted))}")
    return LossKernel(value)
