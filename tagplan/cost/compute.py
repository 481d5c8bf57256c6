"""Compute time of ops and blocks on one device: roofline with calibrated efficiency.

    t_op = max(flops / (peak * efficiency(kind, flops)), bytes / (mem_bw * bw_fraction)) + launch

FLOPs and bytes are those of the op on one device of its tensor-parallel group for one
micro-batch of `samples` samples. The backward of a matmul is two GEMMs of the forward's size
(2x FLOPs); fused attention's backward does `attention_backward_factor` x the forward FLOPs;
memory-bound ops move about twice the bytes backward. Recomputation replays the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from tagplan.cost.calibration import Calibration
from tagplan.cost.sharding import divides, divides_params
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.model import Block, Op, OpKind
from tagplan.ir.plan import ShardStrategy
from tagplan.ir.workload import DType

_GEMM_KINDS = (OpKind.MATMUL, OpKind.CONV)


@dataclass(frozen=True, slots=True)
class OpTime:
    """Forward and backward seconds of one op for one micro-batch on one device."""

    forward_s: float
    backward_s: float


def op_time(op: Op, *, samples: float, tp: int, strategy: ShardStrategy, spec: DeviceSpec, dtype: DType,
            calibration: Calibration) -> OpTime:
    """Seconds for `op` over `samples` samples on one device of a `tp`-way group."""
    if op.kind is OpKind.VIEW:
        return OpTime(0.0, 0.0)
    split = tp if tp > 1 and divides(strategy) else 1
    param_split = tp if tp > 1 and divides_params(strategy, op.kind) else 1
    flops = op.flops * samples / split
    activation_read = max(op.bytes_read - op.param_bytes, 0.0)
    nbytes = (activation_read + op.bytes_written) * samples / split + op.param_bytes / param_split
    curve = calibration.curve(spec.name, op.kind)
    if curve is not None:
        compute_s = flops / (spec.peak_flops(dtype) * curve.at(flops)) if flops else 0.0
    else:  # pointwise work runs on the vector units
        compute_s = flops / spec.peak_flops_fp32
    memory_s = nbytes / (spec.mem_bandwidth_Bps * calibration.bandwidth_fraction(spec.name, op.kind))
    launch = calibration.launch_s(spec.name)
    body = max(compute_s, memory_s)
    if op.kind in _GEMM_KINDS:
        return OpTime(body + launch, 2.0 * body + 2.0 * launch)
    if op.kind is OpKind.ATTENTION:
        return OpTime(body + launch, calibration.attention_backward_factor * body + launch)
    return OpTime(body + launch, 2.0 * body + launch)


@dataclass(frozen=True, slots=True)
class BlockTime:
    """One block's compute seconds per micro-batch on one device (TP communication excluded)."""

    forward_s: float
    backward_s: float


def block_time(block: Block, strategies: dict[str, ShardStrategy], *, samples: float, tp: int, spec: DeviceSpec,
               dtype: DType, calibration: Calibration) -> BlockTime:
    """Sum of the block's op times for one micro-batch of `samples` samples."""
    forward = backward = 0.0
    for op in block.ops:
        t = op_time(op, samples=samples, tp=tp, strategy=strategies[op.name], spec=spec, dtype=dtype,
                    calibration=calibration)
        forward += t.forward_s
        backward += t.backward_s
    return BlockTime(forward, backward)


def local_param_count(block: Block, strategies: dict[str, ShardStrategy], tp: int, nbytes: int) -> float:
    """Parameters of `block` held by one device of a `tp`-way group."""
    total = 0.0
    for op in block.ops:
        split = tp if tp > 1 and divides_params(strategies[op.name], op.kind) else 1
        total += op.param_bytes / split
    return total / nbytes


def model_flops(block: Block) -> float:
    """Forward FLOPs per sample that count as model FLOPs (matmuls, convolutions, attention)."""
    return sum(op.flops for op in block.ops if op.kind in (*_GEMM_KINDS, OpKind.ATTENTION))
