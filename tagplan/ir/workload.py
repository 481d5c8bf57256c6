"""The training workload: what one iteration processes, in which precision, with which optimizer."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from tagplan.ir.base import Record

DEFAULT_GLOBAL_BATCH = 8  # samples per iteration when none is asked for (every command, the service)


class DType(StrEnum):
    """Compute dtype of activations and weights used in matmuls.

    The four quantized recipes run their GEMMs on cast copies of the operands and everything else in
    bf16 (Transformer Engine): `fp8` per-tensor scaling from the amax history (delayed scaling,
    Megatron's `--fp8-recipe delayed`), `fp8-cs` per-tensor scaling from the tensor's own amax (current
    scaling: one more read of each GEMM input before its cast), `mxfp8` E4M3 with an E8M0 scale per
    32 elements (Blackwell's block-scaled tensor cores), `nvfp4` E2M1 with an E4M3 scale per 16
    elements (Blackwell's fp4 tensor cores, at twice or more the fp8 rate).
    """

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"  # as Transformer Engine runs it: fp8 GEMMs, bf16 activations and everything else
    FP8_CS = "fp8-cs"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    @property
    def quantized(self) -> bool:
        """GEMMs run on cast copies (fp8, fp8-cs, mxfp8, nvfp4); activations and weights stay bf16."""
        return self in _QUANTIZED

    @property
    def nbytes(self) -> int:
        """Bytes per element of activations and weights (quantized training keeps them in bf16)."""
        return 4 if self is DType.FP32 else 2

    @property
    def gemm_nbytes(self) -> float:
        """Bytes per element of a GEMM's operand as the kernel reads it: the cast copy's element and its
        share of the block scale (mxfp8 1 + 1/32, nvfp4 1/2 + 1/16) under the quantized recipes."""
        return _GEMM_NBYTES.get(self, float(self.nbytes))

    @property
    def block_scaled(self) -> bool:
        """A microscaling format (mxfp8, nvfp4): its GEMM operands are scaled along the reduction
        dimension, so a weight keeps two cast copies (rowwise for the forward, columnwise for the
        data gradient) where a per-tensor fp8 weight keeps one."""
        return self in (DType.MXFP8, DType.NVFP4)

    @property
    def amax_passes(self) -> int:
        """Extra reads of a GEMM input before its cast: scaling by the tensor's own amax needs it first
        (1: fp8-cs, and nvfp4's per-tensor second-level scale); delayed scaling takes it from the history
        and mxfp8's power-of-two block scales are computed inside the cast kernel (0)."""
        return 1 if self in (DType.FP8_CS, DType.NVFP4) else 0

    @property
    def elementwise(self) -> DType:
        """The dtype of everything but the GEMMs (the quantized recipes run those in bf16)."""
        return DType.BF16 if self.quantized else self


_QUANTIZED = frozenset({DType.FP8, DType.FP8_CS, DType.MXFP8, DType.NVFP4})
_GEMM_NBYTES = {DType.FP8: 1.0, DType.FP8_CS: 1.0, DType.MXFP8: 1.0 + 1.0 / 32, DType.NVFP4: 0.5 + 1.0 / 16}


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


class LossKernel(StrEnum):
    """How the runtime computes the cross-entropy over the logits, which sets what the stage holding the head keeps
    (per logit, with 16-bit logits; `cost.memory`)."""

    EAGER = "eager"
    """PyTorch's cross_entropy on upcast logits: keeps the fp32 softmax, and its fp32 output and gradient are the
    stage's largest transients (about 12 bytes)."""
    IN_PLACE = "in-place"
    """Megatron-Core's vocab-parallel cross-entropy (native, fused or not): upcasts the logits once, keeps the
    fp32 softmax and turns it into the gradient in place, cast back to the logits' dtype (about 6 bytes)."""
    FUSED = "fused"
    """One kernel over the 16-bit logits that keeps them (flash-attn's CrossEntropyLoss, llm-foundry's default;
    Transformer Engine's parallel_cross_entropy, Megatron-Core's --cross-entropy-fusion-impl te; the torch
    program's fused loss): about 4 bytes."""


LOSS_KERNEL_TEXT: dict[LossKernel, str] = {
    LossKernel.EAGER: "PyTorch's, on upcast logits, keeping an fp32 softmax",
    LossKernel.IN_PLACE: "Megatron-Core's, the fp32 softmax turned into the gradient in place",
    LossKernel.FUSED: "one kernel over the 16-bit logits, keeping them (flash-attn's, llm-foundry's default, "
                      "Transformer Engine's)",
}
"""Each loss kernel in a phrase, for help texts and notes."""


class EagerRuntime(StrEnum):
    """An eager runtime (`Workload.eager`) by how it holds its weights (`Workload.eager_16bit_weights`)."""

    AUTOCAST = "autocast"
    SIXTEEN_BIT_WEIGHTS = "16bit-weights"


EAGER_RUNTIME_TEXT: dict[EagerRuntime, str] = {
    EagerRuntime.AUTOCAST: "PyTorch op by op under torch.autocast over fp32 weights (AMP with DDP, Hugging Face "
                           "Trainer's bf16, tagplan's torch program; plain fp32 at --dtype fp32)",
    EagerRuntime.SIXTEEN_BIT_WEIGHTS: "PyTorch op by op over weights held in 16 bits (FSDP's "
                                      "MixedPrecision(param_dtype=bfloat16), DeepSpeed's bf16 and fp16 engines)",
}
"""Each eager runtime in a phrase, for help texts."""


def eager_fields(runtime: EagerRuntime | None) -> dict[str, bool]:
    """The `Workload` fields an eager runtime sets (None: a fused runtime, the defaults)."""
    if runtime is None:
        return {}
    return {"eager": True, "eager_16bit_weights": runtime is EagerRuntime.SIXTEEN_BIT_WEIGHTS}


def eager_runtime(workload: Workload) -> EagerRuntime | None:
    """The eager runtime `workload` describes (None: fused kernels); `eager_fields`' inverse."""
    if not workload.eager:
        return None
    return EagerRuntime.SIXTEEN_BIT_WEIGHTS if workload.eager_16bit_weights else EagerRuntime.AUTOCAST


def eager_dtype_refusal(runtime: EagerRuntime | None, dtype: DType) -> str | None:
    """Why an eager runtime cannot compute in `dtype` (None: it can): weights held in 16 bits need a dtype of
    16 bits or fewer. Each surface names its own fields before it (`Workload`, the CLI's --eager, the
    service's `eager`)."""
    if runtime is EagerRuntime.SIXTEEN_BIT_WEIGHTS and dtype is DType.FP32:
        return (f"weights held in 16 bits need a dtype of 16 bits or fewer, not {dtype.value!r} (accepted: any "
                f"dtype but fp32; at fp32 the {EagerRuntime.AUTOCAST.value!r} runtime runs plain fp32)")
    return None


SIXTEEN_BIT = (DType.BF16, DType.FP16)
"""The 16-bit dtypes autocast computes in (`Workload.autocast`)."""

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
    fused_activation: bool = Field(
        default=False, description="the runtime fuses each chain of pointwise ops (a gated MLP's activation and "
        "product: Megatron-Core's bias_swiglu_impl) into one function that keeps only the chain's own inputs for "
        "its backward and recomputes the rest (the gated MLP keeps its two projections, not also the activated "
        "one). False: each pointwise op keeps its inputs (PyTorch eager, Hugging Face)")
    loss: LossKernel = Field(
        default=LossKernel.EAGER, description="the runtime's cross-entropy (`LossKernel`, `LOSS_KERNEL_TEXT`), which "
        "sets what the stage holding the head keeps. Costed in memory only")
    keeps_stage_outputs: bool = Field(
        default=False, description="the runtime's pipeline engine keeps each micro-batch's received input and "
        "output until that micro-batch's backward, beside what the stage's ops save, and its last stage the "
        "previous micro-batch's logits as well (DeepSpeed's pipeline engine: pipe_buffers['inputs'] and "
        "['outputs'], which its last stage never frees); pipelined plans only. False: a stage's input and output "
        "are freed once used (Megatron-Core, torch.distributed.pipelining, tagplan's torch program)")
    eager: bool = Field(
        default=False, description="the runtime runs the model op by op as eager PyTorch, under autocast when it "
        "computes in 16 bits (`autocast`; tagplan's torch program, its measured iterations): the host issues each "
        "op's eager kernels (`Op.eager_kernels`: the unfused rotary and loss, autocast's weight casts); a block on "
        "a GPU takes at least the host's time to issue them (`Calibration.host_issue_s` per kernel), on a CPU "
        "that time adds to its ops'; its unfused kernels move more bytes than the ops' fused figures "
        "(`Op.eager_extra_bytes`, `Op.eager_bias_bytes`: the fp32 residual stream and norm outputs, casts, "
        "unfused rotary, gradient sums), and under 16-bit autocast over fp32 weights it casts each GEMM's weights "
        "per micro-batch (`compute.eager_extra_s`), and each micro-batch in flight keeps a "
        "16-bit copy of the weights it multiplied. False: fused runtimes (Megatron-Core, Transformer Engine, CUDA "
        "graphs), costed at their kernels' time")
    eager_16bit_weights: bool = Field(
        default=False, description="an eager runtime holds its weights, and with them every tensor, in 16 bits "
        "(PyTorch FSDP's MixedPrecision(param_dtype=bfloat16), DeepSpeed's bf16 and fp16 engines; a quantized "
        "recipe's GEMMs cast from those): no autocast casts of weights or inputs, no fp32 residual stream, no cast "
        "copies kept (`Op.eager_uniform_extra_bytes`). It assumes no autocast, or norms run in 16 bits (MPT's "
        "low-precision LayerNorm): autocast's fp32 norms over 16-bit weights cast their outputs back, which neither "
        "figure describes. The optimizer state stays as `optimizer` keeps it (fp32 master weights and moments). "
        "False: autocast over fp32 weights (torch.autocast, tagplan's torch program). Only with `eager` and a dtype "
        "other than fp32")
    tp_comm_overlap: bool = Field(
        default=False, description="tensor-parallel collectives run in chunks under the block's compute (Megatron-"
        "Core's --tp-comm-overlap: Transformer Engine's userbuffers with sequence parallelism); per block and "
        "direction the exposed part is the collective's time beyond the block's compute, and at least one of its tp "
        "chunks. False: every TP collective is exposed (PyTorch tensor parallelism, Megatron without the flag)")

    @property
    def autocast(self) -> bool:
        """An eager runtime computing in 16 bits over fp32 weights: autocast casts each GEMM's weight (and an fp32
        input) per micro-batch, and the casts are kernels (`Op.eager_cast_kernels`) and memory."""
        return self.eager and self.dtype in SIXTEEN_BIT and not self.eager_16bit_weights

    @model_validator(mode="after")
    def _check_eager_weights(self) -> Workload:
        if self.eager_16bit_weights and not self.eager:
            raise ValueError("eager_16bit_weights true describes an eager runtime; this workload has eager false "
                             "(accepted: eager true beside it)")
        refusal = eager_dtype_refusal(eager_runtime(self), self.dtype)
        if refusal:
            raise ValueError(f"eager_16bit_weights true, dtype {self.dtype.value!r}: {refusal}")
        return self

    @model_validator(mode="after")
    def _check_reduce_dtype(self) -> Workload:
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype {self.grad_reduce_dtype.value!r}: gradients reduce in one of "
                             f"{', '.join(d.value for d in REDUCE_DTYPES)}")
        return self

    @property
    def weight_bytes_per_param(self) -> float:
        """Bytes of one weight in the compute dtype; a quantized recipe adds Transformer Engine's cast
        copy of it (two under block scaling: rowwise and columnwise)."""
        d = self.dtype
        if not d.quantized:
            return float(d.nbytes)
        return d.nbytes + d.gemm_nbytes * (2 if d.block_scaled else 1)

    @property
    def stored_weight_bytes_per_param(self) -> int:
        """Bytes of one weight as the runtime stores, gathers (ZeRO) and updates it: the compute dtype. A quantized
        recipe's cast copies are made from it in the forward, and cross no link (Megatron gathers parameters
        before casting them, as tagplan's exports run it: no `--fp8-param-gather`)."""
        return self.dtype.nbytes

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
