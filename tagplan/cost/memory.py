"""Memory per device: weights, gradients, optimizer state, activations, framework overhead.

- Model state per parameter follows the workload (mixed-precision Adam: 2 + 2 + 12 bytes);
  ZeRO stage 1 divides the optimizer state by the data-parallel degree, stage 2 also the
  gradients, stage 3 also the weights.
- Activations: the bytes a micro-batch saves for backward on this device (1/tp of the block's
  with tensor + sequence parallelism) times the micro-batches in flight on the stage, which the
  pipeline simulation reports for the schedule (1F1B: stage s of S holds min(S - s, M); GPipe
  all M). Under fp8 a GEMM keeps its input as the 1-byte fp8 copy it multiplied (Transformer
  Engine), everything else in bf16 (`Simulator._op_saved_bytes`). A runtime that fuses pointwise
  chains (`Workload.fused_activation`, Megatron-Core's SwiGLU) keeps only a chain's own inputs: the
  gated MLP its gate and up projections, not silu(gate) as well. With recomputation a
  checkpointed layer keeps only its input, and one such layer's full activations are live while
  its backward recomputes them; embeddings and heads are not checkpointed (Megatron's and the
  torch program's recompute covers the transformer blocks), so they keep what they save and their
  forward is not replayed.
- Under an eager runtime's autocast over fp32 weights (`Workload.eager`, 16-bit compute), each micro-batch
  in flight also keeps the 16-bit copy of every weight a GEMM multiplied (`Simulator._cast_copies_bytes`).
- Transient: the largest single op output of the stage (e.g. the logits) and its gradient. The loss
  (`Workload.loss`, `LossKernel`): PyTorch's eager cross-entropy keeps the fp32 softmax, and its fp32 output
  and gradient are the transients; Megatron-Core's (in-place) keeps the fp32 softmax too but turns it into
  the gradient in place, so the logits count here once, as the 16-bit gradient it casts back (or the 16-bit
  logits beside their fp32 copy in the forward); a fused kernel keeps the 16-bit logits instead of the fp32
  softmax, and they count here once more, as their gradient.
- `FRAMEWORK_OVERHEAD_BYTES`: CUDA context (0.3-0.5 GB), cuBLAS workspaces, NCCL buffers for
  the communicators, and caching-allocator fragmentation; PyTorch jobs typically show 0.7-1.5
  GB beyond what tensors account for. One documented constant, not tuned per case.
"""

from __future__ import annotations

from dataclasses import dataclass

from tagplan.ir.model import Block, Op, OpKind
from tagplan.ir.workload import LossKernel, Workload

FRAMEWORK_OVERHEAD_BYTES = 1.0e9


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Bytes one device holds at its peak."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    transient_bytes: float
    overhead_bytes: float = FRAMEWORK_OVERHEAD_BYTES

    @property
    def total_bytes(self) -> float:
        """Sum of all parts."""
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes
                + self.transient_bytes + self.overhead_bytes)


def model_state_bytes(params: float, workload: Workload, *, zero: int, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes on one device holding `params` parameters."""
    weights = params * workload.weight_bytes_per_param
    grads = params * workload.grad_bytes_per_param
    optim = params * workload.optimizer_bytes_per_param
    if zero >= 1:
        optim /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return weights, grads, optim


def transient_bytes_per_sample(blocks: list[Block], *, tp: int, loss: LossKernel = LossKernel.EAGER) -> float:
    """The largest op output of the stage and its gradient, per sample. Under an in-place or fused loss
    (`Workload.loss`) the loss's own transients are per-token figures, and the logits count once: as the
    16-bit gradient (in-place: cast back from the fp32 softmax it overwrote, which it keeps as an activation;
    fused: beside the logits it keeps, `fused_loss_saved_bytes`)."""
    if loss is LossKernel.EAGER:
        return 2.0 * max((b.largest_output_bytes for b in blocks), default=0.0) / tp
    largest = 0.0
    for block in blocks:
        losses = [op for op in block.ops if is_loss(op, block)]
        logits = {src for op in losses for src in op.inputs}
        for op in block.ops:
            if op in losses:  # the per-token loss, not the fp32 softmax (what the eager loss writes and keeps)
                largest = max(largest, 2.0 * max(op.bytes_written - op.saved_bytes, 0.0))
            else:
                largest = max(largest, (1.0 if op.name in logits else 2.0) * op.bytes_written)
    return largest / tp


def is_loss(op: Op, block: Block) -> bool:
    """A head's softmax: the model's loss (cross-entropy over the logits; a traced head whose loss is one
    `cross_entropy` op, or that has none, has no such op, and `Workload.loss` leaves it as it is)."""
    return op.kind is OpKind.SOFTMAX and block.kind == "head"


def fused_loss_saved_bytes(op: Op, block: Block) -> float:
    """What a fused cross-entropy keeps for its backward per sample: the logits it reads, as the ops that make
    them write them (the model's 16-bit logits), where the eager loss keeps its fp32 softmax."""
    return sum(other.bytes_written for other in block.ops if other.name in op.inputs)
