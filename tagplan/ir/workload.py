"""The training workload: what one iteration processes, in which precision, with which optimizer."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from tagplan.ir.base import Record

DEFAULT_GLOBAL_BATCH = 8  # samples per iteration when none is asked for (every command, the service)


class DType(StrEnum):
    """Compute dtype of activations and weights used in matmuls."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"  # as Transformer Engine runs it: fp8 GEMMs, bf16 activations and everything else

    @property
    def nbytes(self) -> int:
        """Bytes per element of activations and weights (fp8 training keeps them in bf16)."""
        return 4 if self is DType.FP32 else 2

    @property
    def gemm_nbytes(self) -> int:
        """Bytes per element of a GEMM's operands as the kernel reads them (fp8: the 1-byte cast copy)."""
        return 1 if self is DType.FP8 else self.nbytes

    @property
    def elementwise(self) -> DType:
        """The dtype of everything but the GEMMs (fp8 runs those in bf16)."""
        return DType.BF16 if self is DType.FP8 else self


class Optimizer(StrEnum):
    """Optimizer whose state is kept per parameter."""

    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"


# fp32 state bytes per parameter beyond the weights and gradients. Mixed precision keeps an fp32
# master copy (4 B) on top of the optimizer's moments; see reference/hardware.md (2 + 2 + 12).
_STATE_BYTES = {
    Optimizer.ADAM: 8,
    Optimizer.ADAMW: 8,
    Optimizer.SGD: 0,
    Optimizer.SGD_MOMENTUM: 4,
}


REDUCE_DTYPES = (DType.FP32, DType.BF16, DType.FP16)
"""The dtypes a data-parallel gradient reduction runs in (no runtime reduces in fp8)."""


class Workload(Record):
    """One training iteration: global batch (samples), sequence length (tokens), dtype, optimizer."""

    global_batch: int = Field(default=DEFAULT_GLOBAL_BATCH, gt=0, description="samples per iteration, all replicas")
    seq_len: int = Field(default=2048, gt=0, description="tokens per sample")
    dtype: DType = DType.BF16
    optimizer: Optimizer = Optimizer.ADAM
    grad_reduce_dtype: DType | None = Field(
        default=None, description="dtype gradients cross the data-parallel group in: None = the compute dtype; fp32 as "
        "DeepSpeed's fp32_allreduce or Megatron's --accumulate-allreduce-grads-in-fp32 (twice the bytes at 16 bits)")
    fused_attention: bool | None = Field(
        default=None, description="the runtime's attention kernel: None = each device's own (DeviceSpec."
        "fused_attention: FlashAttention-2 from sm80, materialised scores before, as Megatron and DeepSpeed run); "
        "True = fused on every device (PyTorch's scaled_dot_product_attention, whose memory-efficient kernel runs "
        "from sm50); False = scores materialised everywhere")
    grad_reduce_overlap: bool = Field(
        default=True, description="the data-parallel gradient reduction runs in buckets while the last backward "
        "runs, and ZeRO's parameter gather while the next forward runs (PyTorch DDP and FSDP, Megatron's "
        "--overlap-grad-reduce/--overlap-param-gather, DeepSpeed ZeRO's overlap_comm); False: both after the "
        "backward, exposed (DeepSpeed's pipeline engine, DeepSpeed without ZeRO, Megatron-LM before Megatron-Core)")
    tp_comm_overlap: bool = Field(
        default=False, description="tensor-parallel collectives run in chunks under the block's compute (Megatron-"
        "Core's --tp-comm-overlap: Transformer Engine's userbuffers with sequence parallelism); per block and "
        "direction the exposed part is the collective's time beyond the block's compute, and at least one of its tp "
        "chunks. False: every TP collective is exposed (PyTorch tensor parallelism, Megatron without the flag)")

    @model_validator(mode="after")
    def _check_reduce_dtype(self) -> Workload:
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype {self.grad_reduce_dtype.value!r}: gradients reduce in one of "
                             f"{', '.join(d.value for d in REDUCE_DTYPES)}")
        return self

    @property
    def weight_bytes_per_param(self) -> int:
        """Bytes of one weight in the compute dtype; fp8 adds Transformer Engine's 1-byte fp8 copy."""
        return self.dtype.nbytes + (1 if self.dtype is DType.FP8 else 0)

    @property
    def grad_bytes_per_param(self) -> int:
        """Bytes of one gradient (kept in the compute dtype)."""
        return self.dtype.nbytes

    @property
    def grad_reduce_bytes_per_param(self) -> int:
        """Bytes per parameter that the data-parallel gradient reduction moves."""
        return self.grad_bytes_per_param if self.grad_reduce_dtype is None else self.grad_reduce_dtype.nbytes

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Bytes of optimizer state per parameter, including the fp32 master copy if mixed."""
        master = 0 if self.dtype is DType.FP32 else 4
        return _STATE_BYTES[self.optimizer] + master
