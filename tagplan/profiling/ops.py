"""Measure single ops on one device, forward and backward, as `OpRecord`s.

Every record carries the op's figures as `ir.model.Op` counts them for the whole call (the
cost model's `op_time(Op(...), samples=1, tp=1)` reproduces it), whatever the phase: a
"backward" record times the backward of that forward op (the cost model predicts it as
`op_time(...).backward_s`), a "step" record one optimizer step. The conventions, as
`frontends/torch_export.py` states them:

- matmul [m,k] x [k,n] (the right operand a weight): 2mkn FLOPs, (mk + kn) x itemsize read,
  mn x itemsize written, kn x itemsize of parameters. Batched matmul: b times the FLOPs and
  bytes, no parameters (both operands are activations, as attention scores).
- attention (`scaled_dot_product_attention`, q/k/v [b,h,s,d]): 4bhs^2d FLOPs, without a causal
  discount (a causal case says so in its shape, `causal: 1`); q, k, v read, the output written.
- layer norm, RMS norm, softmax: 5 FLOPs per output element; GELU, SiLU: 1. Bytes are the
  input and output tensors', weights included (and counted as parameters).
- embedding [vocab, hidden] looked up by `tokens` int64 indices: no FLOPs; the indices and the
  whole table read (the table is the op's parameter, as the tracer counts it, though a lookup
  touches only `tokens` rows), tokens x hidden written.
- Adam step over `params` parameters (fp32 parameter, gradient and two moments): 16 x params
  bytes read, 12 x params written, 4 x params of parameters, about 12 FLOPs per parameter.

The backward is timed as `torch.autograd.grad(output, inputs, grad_output)` on a retained
graph, differentiating with respect to every floating-point input (activations and weights),
as `loss.backward()` would inside a model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.nn import functional

from tagplan.datasets.traces.bundle import OpRecord
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType
from tagplan.profiling.denormals import flushed_denormals
from tagplan.profiling.timing import FULL_TIMING, Timing, measure

log = logging.getLogger(__name__)

OpName = Literal["matmul", "bmm", "attention", "layernorm", "rmsnorm", "softmax", "gelu", "silu", "embedding", "adam"]
ADAM_FLOPS_PER_PARAM = 12  # lerp, mul + addcmul, sqrt + div + add, addcdiv: about a dozen per element
_TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


@dataclass(frozen=True, slots=True)
class OpCase:
    """One op to measure: which op, its dimensions (names as the builder for `op` reads them), its dtype."""

    op: OpName
    dims: Mapping[str, int] = field(default_factory=dict)
    dtype: DType = DType.FP32


@dataclass(frozen=True, slots=True)
class Bench:
    """A runnable op with its `ir.model.Op` figures: `run` calls it once (returning the output, or
    None for an optimizer step); the backward differentiates the output with respect to `wrt`."""

    kind: OpKind
    name: str
    flops: float
    bytes_read: float
    bytes_written: float
    param_bytes: float
    run: Callable[[], torch.Tensor | None]
    wrt: tuple[torch.Tensor, ...] = ()


def _rand(shape: Sequence[int], dtype: torch.dtype, device: str, *, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


def _matmul(case: OpCase, dt: torch.dtype, device: str) -> Bench:
    m, k, n = case.dims["m"], case.dims["k"], case.dims["n"]
    size = torch.finfo(dt).bits // 8
    x, w = _rand((m, k), dt, device), _rand((k, n), dt, device)
    return Bench(OpKind.MATMUL, f"matmul {m}x{k}x{n}", 2.0 * m * k * n, (m * k + k * n) * size, m * n * size,
                 k * n * size, lambda: x @ w, (x, w))


def _bmm(case: OpCase, dt: torch.dtype, device: str) -> Bench:
    b, m, k, n = case.dims["b"], case.dims["m"], case.dims["k"], case.dims["n"]
    size = torch.finfo(dt).bits // 8
    x, y = _rand((b, m, k), dt, device), _rand((b, k, n), dt, device)
    return Bench(OpKind.MATMUL, f"bmm {b}x{m}x{k}x{n}", 2.0 * b * m * k * n, b * (m * k + k * n) * size,
                 b * m * n * size, 0.0, lambda: torch.bmm(x, y), (x, y))


def _attention(case: OpCase, dt: torch.dtype, device: str) -> Bench:
    b, h, s, d = case.dims["b"], case.dims["h"], case.dims["s"], case.dims["d"]
    causal = bool(case.dims.get("causal", 0))
    size = torch.finfo(dt).bits // 8
    q, k, v = (_rand((b, h, s, d), dt, device) for _ in range(3))
    elements = b * h * s * d
    return Bench(OpKind.ATTENTION, f"sdpa b{b} h{h} s{s} d{d}{' causal' if causal else ''}", 4.0 * b * h * s * s * d,
                 3 * elements * size, elements * size, 0.0,
                 lambda: functional.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v))


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if hasattr(functional, "rms_norm"):
        return functional.rms_norm(x, (x.shape[-1],), w)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # torch < 2.4


def _norm(case: OpCase, dt: torch.dtype, device: str) -> Bench:
    rows, hidden = case.dims["rows"], case.dims["hidden"]
    size = torch.finfo(dt).bits // 8
    x, w, b = _rand((rows, hidden), dt, device), _rand((hidden,), dt, device), _rand((hidden,), dt, device)
    params = (w, b) if case.op == "layernorm" else (w,)
    param_bytes = len(params) * hidden * size

    def run() -> torch.Tensor:
        return functional.layer_norm(x, (hidden,), w, b) if case.op == "layernorm" else _rms_norm(x, w)

    name = "layer_norm" if case.op == "layernorm" else "rms_norm"
    return Bench(OpKind.LAYERNORM, f"{name} {rows}x{hidden}", 5.0 * rows * hidden, rows * hidden * size + param_bytes,
                 rows * hidden * size, param_bytes, run, (x, *params))


_POINTWISE: dict[str, tuple[OpKind, float, Callable[[torch.Tensor], torch.Tensor]]] = {
    "softmax": (OpKind.SOFTMAX, 5.0, lambda x: functional.softmax(x, dim=-1)),
    "gelu": (OpKind.ELEMENTWISE, 1.0, functional.gelu),
    "silu": (OpKind.ELEMENTWISE, 1.0, functional.silu),
}


def _pointwise(case: OpCase, dt: torch.dtype, device: str) -> Bench:
    rows, cols = case.dims["rows"], case.dims["cols"]
    kind, flops_per_element, fn = _POINTWISE[case.op]
    nbytes = rows * cols * (torch.finfo(dt).bits // 8)
    x = _rand((rows, cols), dt, device)
    return Bench(kind, f"{case.op} {rows}x{cols}", flops_per_element * rows * cols, nbytes, nbytes, 0.0,
                 lambda: fn(x), (x,))


def _embedding(case: OpCase, dt: torch.dtype, device: str) -> Bench:
    vocab, hidden, tokens = case.dims["vocab"], case.dims["hidden"], case.dims["tokens"]
    size = torch.finfo(dt).bits // 8
    table = _rand((vocab, hidden), dt, device)
    ids = torch.randint(0, vocab, (tokens,), device=device)
    table_bytes = vocab * hidden * size
    return Bench(OpKind.EMBEDDING, f"embedding {vocab}x{hidden}[{tokens}]", 0.0, tokens * 8 + table_bytes,
                 tokens * hidden * size, table_bytes, lambda: functional.embedding(ids, table), (table,))


def _adam(case: OpCase, dt: torch.dtype, device: str) -> Bench:
    params = case.dims["params"]
    weight = torch.nn.Parameter(torch.randn(params, dtype=dt, device=device))
    weight.grad = torch.randn_like(weight)
    optimizer = torch.optim.Adam([weight], lr=1e-4)
    size = torch.finfo(dt).bits // 8

    def run() -> None:
        optimizer.step()

    return Bench(OpKind.ELEMENTWISE, f"adam {params}", ADAM_FLOPS_PER_PARAM * params, 4 * params * size,
                 3 * params * size, params * size, run)


_BUILDERS: dict[str, Callable[[OpCase, torch.dtype, str], Bench]] = {
    "matmul": _matmul, "bmm": _bmm, "attention": _attention, "layernorm": _norm, "rmsnorm": _norm,
    "softmax": _pointwise, "gelu": _pointwise, "silu": _pointwise, "embedding": _embedding, "adam": _adam,
}


def build(case: OpCase, device: str) -> Bench:
    """The runnable op and its figures for `case` on `device` ('cpu' or 'cuda')."""
    return _BUILDERS[case.op](case, _TORCH_DTYPES[case.dtype], device)


def _backward(bench: Bench) -> Callable[[], object]:
    out = bench.run()
    assert out is not None
    grad_out = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, bench.wrt, grad_out, retain_graph=True)


def measure_case(case: OpCase, *, device: Literal["cpu", "cuda"], device_type: str,
                 timing: Timing = FULL_TIMING) -> list[OpRecord]:
    """The forward and backward records of one case (one "step" record for an optimizer)."""
    bench = build(case, device)
    phases: list[tuple[Literal["forward", "backward", "step"], Callable[[], object]]] = (
        [("step", bench.run)] if case.op == "adam" else [("forward", bench.run), ("backward", _backward(bench))]
    )
    records = []
    for phase, fn in phases:
        timed = measure(fn, device=device, timing=timing)
        records.append(OpRecord(device=device_type, kind=bench.kind, name=bench.name, phase=phase, dtype=case.dtype,
                                flops=bench.flops, bytes_read=bench.bytes_read, bytes_written=bench.bytes_written,
                                param_bytes=bench.param_bytes, time_s=timed.median_s, repeats=timed.repeats,
                                shape=dict(case.dims)))
    return records


def achieved_flops(records: Sequence[OpRecord]) -> dict[DType, float]:
    """The best FLOP/s per dtype among matmul and attention records, counting a matmul's backward as
    twice its forward FLOPs (the cost model's convention); attention backward is left out (its
    factor is a calibration figure)."""
    best: dict[DType, float] = {}
    for r in records:
        if r.kind is OpKind.MATMUL and r.phase in ("forward", "backward"):
            rate = (2.0 if r.phase == "backward" else 1.0) * r.flops / r.time_s
        elif r.kind is OpKind.ATTENTION and r.phase == "forward":
            rate = r.flops / r.time_s
        else:
            continue
        best[r.dtype] = max(best.get(r.dtype, 0.0), rate)
    return best


def measure_ops(grid: Sequence[OpCase], *, device: Literal["cpu", "cuda"], device_type: str,
                timing: Timing = FULL_TIMING, progress: Callable[[str], None] | None = None) -> Iterator[OpRecord]:
    """Records of every case of `grid`, in order. A case the device cannot run (an op or dtype the
    torch build lacks, or out of memory) is logged, reported to `progress` and skipped."""
    for i, case in enumerate(grid, start=1):
        try:
            with flushed_denormals(device):  # as a GPU computes them (profiling.denormals)
                records = measure_case(case, device=device, device_type=device_type, timing=timing)
        except (RuntimeError, NotImplementedError) as err:
            message = f"op {i}/{len(grid)} {case.op} {dict(case.dims)} {case.dtype}: skipped ({str(err)[:120]})"
            log.warning(message)
            if progress is not None:
                progress(message)
            continue
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        if progress is not None:
            times = ", ".join(f"{r.phase} {r.time_s * 1e3:.3g} ms" for r in records)
            progress(f"op {i}/{len(grid)} {records[0].name} {case.dtype}: {times}")
        yield from records
