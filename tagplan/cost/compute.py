"""Compute time of ops and blocks on one device: roofline with calibrated efficiency.

    t_op = max(flops / (peak * sustained * efficiency(kind, flops)), bytes / (mem_bw * bw_fraction)) + launch
    t_op = t_op * compute_scale
    t_eager = eager_bytes / (mem_bw * bw_fraction(elementwise)) * compute_scale      (eager runtimes only)
    t_block = max(sum(t_op + t_eager), kernels * host_dispatch)        (forward and backward apart)

`compute_scale` is the device type's fitted achieved-compute scale (1 unless calibrated from measured
iterations). `host_dispatch` is the seconds the host takes to issue one kernel under an eager
runtime (`Workload.eager`: PyTorch op by op under autocast), and `kernels` the kernels the block's ops
issue: each op's `Op.eager_kernels` (the casts of fp32 weights and of a norm's fp32 output, the unfused
rotary and loss: an eager Llama block issues about twice a GPT block's kernels), one forward and two
backward for an op the model gives no count. The host runs ahead of the device while work is queued,
so within a block its issue time hides under long kernels and only a block whose kernels are shorter
in all than their issue leaves the device waiting: that block costs the issue time. Eager PyTorch on a
fast GPU is host-bound this way for small shapes (a 48-layer, 512-wide GPT at 512 tokens ran 8x slower
on an H200 than its kernels take). `host_dispatch` is fitted from measured eager iterations
(`Calibration.host_dispatch_s`), else `Calibration.eager_host_dispatch_s` (fitted on an H200 host's
eager runs); a fused runtime (Megatron-Core, CUDA graphs) gets no floor and keeps its kernel times. A
CPU runs its kernels itself (`DeviceSpec.queued` False): nothing runs ahead, so an eager runtime's dispatch
adds to the ops' time, `t_block = sum(t_op) + kernels * host_dispatch`, with the figure fitted from that CPU's
eager runs alone (0 until fitted: the H200 host's default says nothing of another machine's Python). An fp32
runtime dispatches no autocast casts (`Op.eager_cast_kernels`): on the gloo testbed the Llama block issues
about three times the GPT block's kernels (116 against 38 in the torch program), which the ops' FLOPs and
bytes do not show.
An eager runtime also moves more bytes than the fused kernels an op's bytes describe (`eager_extra_s`): each
op's `Op.eager_extra_bytes` (the fp32 residual stream and norm outputs, autocast's casts of fp32 inputs, unfused
rotary, gradient sums and copies; per sample, divided over a tensor-parallel group as the tensor they are about
is, `eager_split`), a projection's bias-gradient sum (`Op.eager_bias_bytes`) and, under 16-bit autocast, every
GEMM's weight casts per micro-batch (`WEIGHT_CAST_PASSES`), at the pointwise kernels' bandwidth (`t_eager`).
`sustained` is the device's `sustained_peak_fraction`: where a power cap lowers the clock under a
continuous load (T4), every tensor-core kernel of the training loop runs at the lowered clock.

FLOPs and bytes are those of the op on one device of its tensor-parallel group for one
micro-batch of `samples` samples. The backward of a matmul is two GEMMs of the forward's size
(2x FLOPs); fused attention's backward does `attention_backward_factor` x the forward FLOPs;
memory-bound ops move about twice the bytes backward. Recomputation replays the forward of the
checkpointed blocks (not embeddings or heads: `ir.model.CHECKPOINT_SKIPPED`).

Quantized GEMMs (fp8, fp8-cs, mxfp8, nvfp4) run at the device's rate for the format (`DeviceSpec.peak_flops`),
the block-scaled ones (mxfp8, nvfp4) on Blackwell at a fitted fraction of it
(`Calibration.block_scaled_gemm_fraction`: scale-factor traffic, and nvfp4's Hadamard transforms of the weight
gradient's operands, inside the kernels). Their casts are fused into neighbouring kernels (Transformer
Engine's LayerNormLinear, cast-transpose; charging each cast as a pass of its own made the NeMo H100 fp8 rows,
held out of every fit, worse: median 3.7% -> 4.1%, worst 20% -> 25%), except the amax that scaling by the
tensor's own maximum needs first (fp8-cs, and nvfp4's per-tensor second-level scale): one more memory-bound
read of the input forward and of the output gradient backward (`_amax_s`).

Attention on a device without a fused kernel (`DeviceSpec.fused_attention` False: NVIDIA before
sm80, where FlashAttention-2 does not run) materialises its score matrix: the forward writes the
scores, softmax reads and writes them, dropout reads and writes them, and the value GEMM reads the
probabilities (6 passes over heads x s x s_kv elements); the backward makes 9 (the probability
gradient written, dropout and softmax backward reading probabilities, gradients and writing, both
GEMMs reading the score gradient, the value gradient reading the probabilities). These passes run
at the memory-bound kernels' bandwidth on top of the fused model's time: the score traffic is what
fusion removes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from tagplan.cost.calibration import Calibration, LayerTime
from tagplan.cost.sharding import Layout, divides, layouts, param_split
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.model import Block, Op, OpKind
from tagplan.ir.plan import ShardStrategy
from tagplan.ir.workload import DType

_GEMM_KINDS = (OpKind.MATMUL, OpKind.CONV)
UNFUSED_SCORE_PASSES_FORWARD = 6
UNFUSED_SCORE_PASSES_BACKWARD = 9
UNFUSED_KERNELS_FORWARD = 3  # scale/mask/softmax, dropout, and the second batched GEMM
UNFUSED_KERNELS_BACKWARD = 4


@dataclass(frozen=True, slots=True)
class OpTime:
    """Forward and backward seconds of one op for one micro-batch on one device."""

    forward_s: float
    backward_s: float


def attention_fraction(op: Op, *, fused: bool, calibration: Calibration) -> float:
    """The fraction of attention op `op`'s FLOPs (every query against every key) a kernel is charged for: under a
    causal mask (`Op.causal`) a fused kernel skips the tiles above the diagonal, at the cost
    min(1, `causal_time_fraction` + `causal_diagonal_tokens` / keys) of its unmasked time; a materialised kernel
    (`fused` False) computes the whole score matrix and masks it: 1. The shipped defaults charge 1 (see
    `Calibration.causal_time_fraction`); op records of causal and unmasked calls fit both figures."""
    if op.kind is not OpKind.ATTENTION or not fused or not op.causal:
        return 1.0
    # the query count, equal to the keys in self-attention: (1, s, width) as built, (batch, heads, s, width) traced
    keys = op.output_shape[-2] if len(op.output_shape) >= 2 else 0
    if not keys:
        return 1.0
    return min(1.0, calibration.causal_time_fraction + calibration.causal_diagonal_tokens / keys)


def op_time(op: Op, *, samples: float, tp: int, strategy: ShardStrategy, spec: DeviceSpec, dtype: DType,
            calibration: Calibration) -> OpTime:
    """Seconds for `op` over `samples` samples on one device of a `tp`-way group."""
    if op.kind is OpKind.VIEW:
        return OpTime(0.0, 0.0)
    split = tp if tp > 1 and divides(strategy) else 1
    params_split = param_split(strategy, op.kind, tp)
    flops = op.flops * samples / split
    if op.kind is OpKind.ATTENTION:
        flops *= attention_fraction(op, fused=spec.fused_attention, calibration=calibration)
    activation_read = max(op.bytes_read - op.param_bytes, 0.0)
    nbytes = (activation_read + op.bytes_written) * samples / split + op.param_bytes / params_split
    curve = calibration.curve(spec.name, op.kind)
    if curve is not None:  # GEMMs in the compute dtype; attention and the rest in bf16 under fp8
        peak = spec.sustained_peak_flops(dtype if op.kind in _GEMM_KINDS else dtype.elementwise)
        if op.kind in _GEMM_KINDS and dtype.block_scaled and spec.peak_flops_fp4 is not None:
            peak *= calibration.block_scaled_gemm_fraction.get(dtype, 1.0)
        compute_s = flops / (peak * curve.at(flops)) if flops else 0.0
    else:  # pointwise work runs on the vector units
        compute_s = flops / spec.peak_flops_fp32
    memory_s = nbytes / (spec.mem_bandwidth_Bps * calibration.bandwidth_fraction(spec.name, op.kind))
    launch = calibration.launch_s(spec.name)
    body = max(compute_s, memory_s)
    if op.kind in _GEMM_KINDS:
        forward, backward = body + launch, 2.0 * body + 2.0 * launch
        if op.kind is OpKind.MATMUL:
            amax_forward, amax_backward = _amax_s(activation_read * samples / split, op.bytes_written * samples / split,
                                                  dtype=dtype, spec=spec, calibration=calibration)
            forward += amax_forward
            backward += amax_backward
        return _scaled(forward, backward, spec, calibration)
    if op.kind is OpKind.ATTENTION:
        forward, backward = body + launch, calibration.attention_backward_factor * body + launch
        if not spec.fused_attention and op.score_elements:
            pass_s = (op.score_elements * samples / split * dtype.elementwise.nbytes
                      / (spec.mem_bandwidth_Bps * calibration.bandwidth_fraction(spec.name, OpKind.SOFTMAX)))
            forward += UNFUSED_SCORE_PASSES_FORWARD * pass_s + UNFUSED_KERNELS_FORWARD * launch
            backward += UNFUSED_SCORE_PASSES_BACKWARD * pass_s + UNFUSED_KERNELS_BACKWARD * launch
        return _scaled(forward, backward, spec, calibration)
    return _scaled(body + launch, 2.0 * body + launch, spec, calibration)


def _scaled(forward_s: float, backward_s: float, spec: DeviceSpec, calibration: Calibration) -> OpTime:
    """The op's device seconds times the device's compute scale."""
    scale = calibration.compute_factor(spec.name)
    return OpTime(forward_s * scale, backward_s * scale)


_CASTS_KEPT_IN_16_BITS = (OpKind.ELEMENTWISE, OpKind.SOFTMAX)
"""Kinds of op whose `Op.eager_cast_kernels` a program held in 16 bits still issues: the rotary's tables, computed
in fp32, cast to the activations' dtype; the loss's logits cast up (`.float()`). A projection's casts (of its
weight, bias and an fp32 input) and an expert combine's (its output to the fp32 routing weights) are autocast's."""


def issued_kernels(op: Op, *, eager: bool, autocast: bool, sixteen_bit_weights: bool = False) -> tuple[int, int]:
    """(forward, backward) kernels the host issues for `op` per micro-batch: its eager PyTorch count under an
    eager runtime where the model gives one, else one forward and two backward (none for a view). A runtime
    computing in the weights' dtype (`autocast` False) issues no autocast casts (`Op.eager_cast_kernels`), but over
    16-bit weights (`sixteen_bit_weights`) it still makes the casts of `_CASTS_KEPT_IN_16_BITS`' ops: the rotary's
    tables to the activations' dtype, the loss's logits up. Only an eager runtime pays for them
    (`Calibration.host_issue_s`)."""
    if op.kind is OpKind.VIEW:
        return 0, 0
    if eager and op.eager_kernels is not None:
        if autocast or (sixteen_bit_weights and op.kind in _CASTS_KEPT_IN_16_BITS):
            return op.eager_kernels
        return (op.eager_kernels[0] - op.eager_cast_kernels[0], op.eager_kernels[1] - op.eager_cast_kernels[1])
    return 1, 2


WEIGHT_CAST_PASSES = 3.0
"""Passes over a GEMM's 16-bit weight bytes that autocast's cast of its fp32 weight makes per micro-batch (reads
four bytes a parameter, writes two), and as many backward (its gradient cast back to fp32)."""


def eager_extra_s(op: Op, *, samples: float, tp: int, strategy: ShardStrategy, spec: DeviceSpec,
                  calibration: Calibration, autocast: bool, sixteen_bit_weights: bool = False) -> OpTime:
    """Seconds of the memory traffic eager PyTorch's kernels add to `op` for one micro-batch of `samples` samples
    on one device of a `tp`-way group (`eager_traffic_bytes`: its eager bytes, and under 16-bit autocast over fp32
    weights a GEMM's weight casts), at the pointwise kernels' bandwidth, times the device's compute scale."""
    forward_bytes, backward_bytes = eager_traffic_bytes(op, samples=samples, tp=tp, strategy=strategy,
                                                        autocast=autocast, sixteen_bit_weights=sixteen_bit_weights)
    bandwidth_Bps = spec.mem_bandwidth_Bps * calibration.bandwidth_fraction(spec.name, OpKind.ELEMENTWISE)
    return _scaled(forward_bytes / bandwidth_Bps, backward_bytes / bandwidth_Bps, spec, calibration)


def eager_traffic_bytes(op: Op, *, samples: float, tp: int, strategy: ShardStrategy, autocast: bool,
                        sixteen_bit_weights: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes `eager_extra_s` charges `op` on one device of a `tp`-way group for one
    micro-batch of `samples` samples: its `Op.eager_extra_bytes` (over 16-bit weights, `sixteen_bit_weights`,
    `Op.eager_uniform_extra_bytes` where the op has one), divided as the tensor they are about is (`eager_split`);
    a projection's `Op.eager_bias_bytes`, divided as its output is; and under `autocast` a GEMM's weight casts
    (`WEIGHT_CAST_PASSES` over its 16-bit weight bytes, a tied head's included)."""
    if op.kind is OpKind.VIEW:
        return 0.0, 0.0
    split = eager_split(op, strategy, tp)
    uniform = op.eager_uniform_extra_bytes if sixteen_bit_weights else None
    extra = op.eager_extra_bytes if uniform is None else uniform
    forward_bytes, backward_bytes = (b * samples / split for b in extra)
    if op.eager_bias_bytes:  # about the output: whole under row parallelism (a partial sum), split under column
        split_out = tp > 1 and layouts(op, strategy).output in (Layout.H, Layout.S)
        backward_bytes += op.eager_bias_bytes * samples / (tp if split_out else 1)
    if autocast and op.kind in _GEMM_KINDS:
        casts = WEIGHT_CAST_PASSES * (op.param_bytes + op.shared_param_bytes) / param_split(strategy, op.kind, tp)
        forward_bytes, backward_bytes = forward_bytes + casts, backward_bytes + casts
    return forward_bytes, backward_bytes


def eager_split(op: Op, strategy: ShardStrategy, tp: int) -> int:
    """How many ways `op`'s `Op.eager_extra_bytes` divide over a `tp`-way group: as the tensor they are about lies
    on it (`sharding.layouts`). A lookup's are about its output, which a vocabulary-parallel table writes whole (a
    partial sum); every other op's about its input (a projection's cast of it, its gradient's cast and sums; a
    pointwise op's input is laid out as its output), which a column-parallel projection reads whole on every
    device."""
    if tp <= 1:
        return 1
    laid = layouts(op, strategy)
    about = laid.output if laid.input is None else laid.input
    return tp if about in (Layout.H, Layout.S) else 1


def _amax_s(input_bytes: float, output_bytes: float, *, dtype: DType, spec: DeviceSpec,
            calibration: Calibration) -> tuple[float, float]:
    """(forward, backward) seconds of the amax reads a quantized GEMM's activation operands take before their
    cast where the recipe scales by the tensor's own amax (`DType.amax_passes`): forward its input, backward
    its output gradient (`*_bytes`: those tensors in bf16), each read once more, memory-bound."""
    if not dtype.amax_passes:
        return 0.0, 0.0
    bandwidth_Bps = spec.mem_bandwidth_Bps * calibration.bandwidth_fraction(spec.name, OpKind.REDUCTION)
    launch = calibration.launch_s(spec.name) * dtype.amax_passes
    per_byte = dtype.amax_passes / bandwidth_Bps
    return input_bytes * per_byte + launch, output_bytes * per_byte + launch


@dataclass(frozen=True, slots=True)
class BlockTime:
    """One block's compute seconds per micro-batch on one device (TP communication excluded)."""

    forward_s: float
    backward_s: float
    host_bound: bool = False
    """The host's time to issue the block's kernels set a direction's time (`block_time`)."""


def block_time(block: Block, strategies: dict[str, ShardStrategy], *, samples: float, tp: int, spec: DeviceSpec,
               dtype: DType, calibration: Calibration, eager: bool, autocast: bool,
               sixteen_bit_weights: bool = False) -> BlockTime:
    """Sum of the block's op times for one micro-batch of `samples` samples and the host's time to issue the
    block's kernels (`eager`: the runtime issues each op's eager kernels, `issued_kernels`, and moves their extra
    bytes, `eager_extra_s`; `autocast`: with the casts of 16-bit autocast over fp32 weights; `sixteen_bit_weights`:
    over weights held in 16 bits, `Workload.eager_16bit_weights`): on a device with a
    queue (`DeviceSpec.queued`) the issue time is a floor of each direction's time, on a CPU, which runs each
    kernel as the host issues it, it adds."""
    forward = backward = 0.0
    kernels_forward = kernels_backward = 0
    for op in block.ops:
        t = op_time(op, samples=samples, tp=tp, strategy=strategies[op.name], spec=spec, dtype=dtype,
                    calibration=calibration)
        forward += t.forward_s
        backward += t.backward_s
        if eager:
            extra = eager_extra_s(op, samples=samples, tp=tp, strategy=strategies[op.name], spec=spec,
                                  calibration=calibration, autocast=autocast,
                                  sixteen_bit_weights=sixteen_bit_weights)
            forward += extra.forward_s
            backward += extra.backward_s
        k_forward, k_backward = issued_kernels(op, eager=eager, autocast=autocast,
                                               sixteen_bit_weights=sixteen_bit_weights)
        kernels_forward += k_forward
        kernels_backward += k_backward
    host_s = calibration.host_issue_s(spec.name, eager=eager, queued=spec.queued)
    issue_forward, issue_backward = kernels_forward * host_s, kernels_backward * host_s
    if not spec.queued:
        return BlockTime(forward + issue_forward, backward + issue_backward)
    return BlockTime(max(forward, issue_forward), max(backward, issue_backward),
                     host_bound=issue_forward > forward or issue_backward > backward)


def profiled_block_time(profiles: Sequence[LayerTime], *, tp: int, samples: float) -> tuple[BlockTime | None, str]:
    """(time, why) of one block from its measured layer times (one block, device, dtype, sequence length).

    Interpolates linearly in micro-batch samples between measured sizes, and linearly in 1/tp
    between measured tp degrees (compute divides by tp; what does not divide stays). Outside the
    measured range it returns (None, the reason): the caller falls back to the op model and says so.
    """
    degrees = sorted({p.tp for p in profiles})
    if tp in degrees:
        return _over_samples([p for p in profiles if p.tp == tp], samples)
    below, above = [d for d in degrees if d < tp], [d for d in degrees if d > tp]
    if not below or not above:
        return None, f"tp {tp} outside the profiled degrees {degrees}"
    lo, hi = below[-1], above[0]
    (t_lo, why_lo), (t_hi, why_hi) = (_over_samples([p for p in profiles if p.tp == d], samples) for d in (lo, hi))
    if t_lo is None or t_hi is None:
        return None, why_lo if t_lo is None else why_hi
    w = (1 / lo - 1 / tp) / (1 / lo - 1 / hi)
    return BlockTime(t_lo.forward_s + w * (t_hi.forward_s - t_lo.forward_s),
                     t_lo.backward_s + w * (t_hi.backward_s - t_lo.backward_s)), "layer profile (interpolated tp)"


def _over_samples(profiles: Sequence[LayerTime], samples: float) -> tuple[BlockTime | None, str]:
    points = sorted(profiles, key=lambda p: p.micro_batch)
    sizes = [p.micro_batch for p in points]
    if samples < sizes[0] - 1e-9 or samples > sizes[-1] + 1e-9:
        return None, f"micro-batch {samples:g} outside the profiled sizes {sizes[0]:g}-{sizes[-1]:g}"
    i = bisect.bisect_left(sizes, samples - 1e-9)
    if abs(sizes[i] - samples) <= 1e-9:
        return BlockTime(points[i].forward_s, points[i].backward_s), "layer profile"
    a, b = points[i - 1], points[i]
    w = (samples - a.micro_batch) / (b.micro_batch - a.micro_batch)
    return BlockTime(a.forward_s + w * (b.forward_s - a.forward_s),
                     a.backward_s + w * (b.backward_s - a.backward_s)), "layer profile (interpolated)"


def local_param_count(block: Block, strategies: dict[str, ShardStrategy], tp: int, nbytes: int) -> float:
    """Parameters of `block` held by one device of a `tp`-way group."""
    total = 0.0
    for op in block.ops:
        split = param_split(strategies[op.name], op.kind, tp) if tp > 1 else 1
        total += op.param_bytes / split
    return total / nbytes


def multiplied_param_count(block: Block, strategies: dict[str, ShardStrategy], tp: int, nbytes: int) -> float:
    """Parameters one device of a `tp`-way group multiplies in `block`'s GEMMs, a tied head's table included:
    what autocast casts to a 16-bit copy each micro-batch (a lookup table is read, not cast)."""
    total = 0.0
    for op in block.ops:
        if op.kind in _GEMM_KINDS:
            split = param_split(strategies[op.name], op.kind, tp) if tp > 1 else 1
            total += (op.param_bytes + op.shared_param_bytes) / split
    return total / nbytes


def shared_param_count(block: Block, strategies: dict[str, ShardStrategy], tp: int, nbytes: int) -> float:
    """The largest table of the first layer's that an op of `block` uses (a tied head), per device of
    a `tp`-way group; 0 when none does."""
    largest = 0.0
    for op in block.ops:
        if op.shared_param_bytes:
            split = param_split(strategies[op.name], op.kind, tp) if tp > 1 else 1
            largest = max(largest, op.shared_param_bytes / split)
    return largest / nbytes


def model_flops(block: Block) -> float:
    """Forward FLOPs per sample that count as model FLOPs (matmuls, convolutions, attention)."""
    return sum(op.flops for op in block.ops if op.kind in (*_GEMM_KINDS, OpKind.ATTENTION))
