"""torch.profiler / Kineto Chrome traces (`prof.export_chrome_trace`) -> `OpRecord`s.

Which ops: every `cpu_op` whose aten name maps to an `OpKind` (matmul, attention, layernorm,
softmax, elementwise, embedding, conv) and that is not nested inside another recorded op on the
same thread. `aten::linear` contains `aten::addmm`, which is how linear is implemented: the outer
op is recorded with its whole time and the inner one is not counted again. Ops under an
`autograd::engine::evaluate_function: XBackward0` node, or named `..._backward...`, run in the
backward; ops under an `Optimizer.step#...` annotation are the step; the rest forward. Of the ops
inside a backward node, those that build the graph (a `Sequence number`: a checkpointed block's
recomputation) are forward calls.

Time: on a CPU trace the op's own duration (its children are its implementation). On a GPU
trace (one with `kernel` events) the sum of the device activity (kernels, memcpy, memset) it
launched: each activity's `args.correlation` names a `cuda_runtime` launch, which sits inside
the launching `cpu_op` on the same thread (by time; by `External id` when time does not tell).
Calls of one op with identical input shapes and types in one phase become one record: time_s is
their median, repeats their count. Under `torch.autocast` the recorded op receives the fp32 inputs
and calls itself again on the cast ones: the record is costed from that inner call (the dtype and
shapes its kernels ran on). On a GPU trace its time leaves out those casts' kernels (the `aten::to`,
`_to_copy` or `copy_` calls directly inside an op that calls itself again): the cost model charges an
eager runtime's casts apart (`cost.compute.eager_extra_s`), and a fused runtime has none; conversions
inside an op's own implementation stay its. On a CPU trace they stay in the op's duration (an fp32
trace has none).

Backward records follow the bundle's convention (docs/TRACES.md): **a backward record carries the
forward op's figures and the time of that op's whole backward**, as `profiling.ops` measures it and
`training.calibrate` fits it (a matmul's backward is two GEMMs of its size; attention's
`attention_backward_factor` times its FLOPs; a pointwise op's twice its bytes):
- a matmul's backward is the GEMM calls (`mm`, `bmm`, `addmm`, `baddbmm`, and `matmul` or `linear`
  where a custom backward calls them) of one autograd node (`autograd::engine::evaluate_function:
  AddmmBackward0`, ...): two of one size, its input's and its weight's gradients, become one call,
  their times summed; a node with another count of GEMMs (one, where the input needs no gradient), or
  one whose GEMMs launched no kernel, is skipped and counted;
- a backward kernel (`*_backward*`: attention's, a norm's, a pointwise op's, `convolution_backward`)
  is that op's whole backward;
- either is costed as the forward op whose node it is (the node's `Sequence number` names the forward
  call that made it): its figures exactly. A node whose forward call is not a recorded op of the same
  kind (the GEMMs of an unfused attention's backward, whose forward is one attention record) is
  skipped and counted. Without the link (a trace without sequence numbers) a backward kernel is costed
  as its forward from its own arguments: attention from its queries, keys and values, a convolution from
  its input and weight, a norm or pointwise op from its input, and a GEMM pair from its first GEMM;
- the dense embedding backward (a sort and a scatter-add over the whole table, 9-18x its forward's time
  on the H200 traces) is skipped and counted: the cost model's memory-bound backward, twice the forward,
  does not describe it, and fitting it would move the lookup's bandwidth figure;
- other ops inside a backward node that build no graph (a product's gradient, a sum of gradients) are
  part of some node's backward and are skipped and counted.

FLOPs and bytes follow `ir.model.Op` (tagplan/frontends/analytic.py): a multiply-add is 2 FLOPs
(matmul [m,k]x[k,n] = 2mkn, attention 4*s*s_kv*d per head plus 5 per score), norms and softmax
5 per element, other elementwise ops 1, embedding lookups 0; bytes_read counts every tensor
input (parameters included; an embedding reads only the rows it looks up), bytes_written the
output; a backward record the forward op's (above).

What is not recorded is reported in `KinetoImport.skipped` (and logged at INFO): aten ops outside
recorded ops that map to no kind (views, copies, reductions, optimizer foreach ops...), keyed by op
name and counted once per outermost call; and mapped calls that could not be used, keyed `"name (why)"`
with the op's name or, for a backward's GEMMs, its autograd node's: no shapes, a dtype outside
bf16/fp16/fp32 with no fallback, no kernels, an op inside a backward node that is not a whole
backward, the dense embedding backward, a node with other than two GEMMs of one size, a node that is
part of another kind of op's backward, a backward GEMM outside any node.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import re
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any, Literal

from tagplan.errors import SpecError
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType

from .bundle import OpRecord

log = logging.getLogger(__name__)

_HOST_CATS = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_BACKWARD_NODE = "autograd::engine::evaluate_function:"
_STEP_NODE = "Optimizer.step#"
_CASTS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})
_GEMMS = frozenset({"mm", "bmm", "addmm", "baddbmm"})
_GEMM_NODES = ("MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "LinearBackward", "MatmulBackward")

_DTYPES = {"float": DType.FP32, "c10::Half": DType.FP16, "c10::BFloat16": DType.BF16}
_ELEM_BYTES = {
    "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8, "int": 4, "short int": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}  # fmt: skip
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"})
_NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"})
_SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
_EMBEDDINGS = frozenset({"embedding", "embedding_dense"})
_CONVS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution"})
_ELEMENTWISE = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "gelu", "silu", "relu", "threshold", "tanh", "sigmoid", "exp",
        "log", "pow", "rsqrt", "sqrt", "erf", "leaky_relu", "elu", "hardswish", "mish", "softplus",
        "clamp", "where", "masked_fill",
    }
)  # fmt: skip
_BACKWARD_SUFFIX = re.compile(r"_backward(_data|_input|_weight)?$")

Phase = Literal["forward", "backward", "step"]


@dataclass(frozen=True)
class KinetoImport:
    """What one trace yields: the op records, and how many calls were left out, by op name."""

    records: list[OpRecord]
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass
class _Event:
    """A host event in its thread's call tree, with what the walk over the tree learnt about it."""

    thread: tuple[Any, Any]
    name: str
    cat: str
    ts: float
    dur: float
    args: dict[str, Any]
    phase: Phase = "forward"
    owner: int | None = None  # index of the recorded op this event belongs to (itself, or an ancestor)
    aten_parent: bool = False  # an aten op encloses it
    inner: int | None = None  # a recorded op: the same op called again inside it (autocast's cast inputs)
    node: int | None = None  # the innermost autograd node (`_BACKWARD_NODE`) it runs in
    node_name: str = ""  # that node's function (`AddmmBackward0`)
    cast_of: int | None = None  # inside a cast (`_CASTS`) directly under this recorded op: the cast's kernels


@dataclass(frozen=True)
class _Cost:
    """FLOPs and bytes of one call, as `ir.model.Op` counts them."""

    kind: OpKind
    dtype: DType
    flops: float
    bytes_read: float
    bytes_written: float
    param_bytes: float
    shape: dict[str, int]


def import_kineto(path: str | os.PathLike[str], *, device: str, dtype: DType | None = None) -> list[OpRecord]:
    """The op records of the trace at `path` (see the module docstring); times in seconds.

    `dtype` is used for ops whose inputs carry no bf16/fp16/fp32 type. Skipped calls are logged;
    `read_kineto` returns their counts.
    """
    return read_kineto(path, device=device, dtype=dtype).records


def read_kineto(path: str | os.PathLike[str], *, device: str, dtype: DType | None = None) -> KinetoImport:
    """Like `import_kineto`, also returning the counts of skipped calls by op name."""
    events = _load_events(Path(path))
    host = _host_events(events)
    skipped: Counter[str] = Counter()
    recorded = _walk(host, skipped)
    if recorded and not any("Input Dims" in host[i].args for i in recorded):
        raise SpecError(f"{path}: cpu_op events carry no 'Input Dims'; profile with record_shapes=True")
    if any(e.get("cat") in _DEVICE_CATS for e in events):
        times_s = _device_times_s(events, host)
    else:
        times_s = {i: host[i].dur / 1e6 for i in recorded}
    groups: dict[tuple[str, str, str], list[int]] = {}
    node_gemms: dict[int, list[int]] = {}
    sequenced = any("Sequence number" in ev.args for ev in host if ev.cat == "cpu_op")
    roles = {i: _role(host[i], sequenced=sequenced) for i in recorded}
    phases: dict[str, Phase] = {"forward": "forward", "backward": "backward", "step": "step"}
    for i, role in roles.items():  # a recomputed call is forward, and so is the re-call it is costed from
        if (phase := phases.get(role)) is not None:
            host[i].phase = phase
            if (inner := host[i].inner) is not None:
                host[inner].phase = phase
    forward_of = _forward_calls(host)  # after the recomputed calls are forward: under reentrant checkpointing
    for i in recorded:  # their nodes are the ones the backward runs
        ev, role = host[i], roles[i]
        if role == "skip":
            skipped[f"{ev.name} (an op inside a backward node that is neither a whole backward nor, by its sequence "
                    "number, a recomputation)"] += 1
            continue
        if role == "backward" and _base(ev.name) in _EMBEDDINGS:
            skipped[f"{ev.name} (the dense embedding backward: a sort and a scatter over the table)"] += 1
            continue
        if role == "gemm":
            if ev.node is None:
                skipped[f"{ev.name} (a backward GEMM outside an autograd node)"] += 1
            else:
                node_gemms.setdefault(ev.node, []).append(i)
            continue
        a = ev.args
        groups.setdefault((ev.name, json.dumps([a.get("Input Dims"), a.get("Input type")]), ev.phase), []).append(i)
    records = [r for members in groups.values()
               if (r := _record(host, members, times_s, device, dtype, skipped, forward_of))]
    records += _gemm_backwards(host, node_gemms, times_s, device, dtype, skipped, forward_of)
    if skipped:
        log.info("%s: %d op records; skipped %s", path, len(records), dict(skipped.most_common()))
    return KinetoImport(records, dict(skipped))


def _load_events(path: Path) -> list[dict[str, Any]]:
    """The trace's `traceEvents`; SpecError naming the file when it is not a Chrome trace."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        data = json.loads(raw)
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: not a Kineto Chrome trace ({err})") from None
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}: malformed JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise SpecError(f"{path}: no 'traceEvents' list; expected a torch.profiler Chrome trace "
                        "(prof.export_chrome_trace)")
    return [e for e in events if isinstance(e, dict)]


def _host_events(events: list[dict[str, Any]]) -> list[_Event]:
    """Complete host events, thread by thread, each thread's in call order (parents before children)."""
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _HOST_CATS and isinstance(e.get("ts"), int | float):
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out: list[_Event] = []
    for key, thread in threads.items():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        out.extend(_Event(key, str(e.get("name", "")), str(e["cat"]), float(e["ts"]), float(e.get("dur", 0)),
                          e.get("args") or {}) for e in thread)
    return out


def _walk(host: list[_Event], skipped: Counter[str]) -> list[int]:
    """Nest each thread's events by time, set their phase and owner; the indices of recorded ops."""
    recorded: list[int] = []
    stack: list[int] = []
    for i, ev in enumerate(host):
        if stack and host[stack[-1]].thread != ev.thread:
            stack.clear()
        while stack and ev.ts >= host[stack[-1]].ts + host[stack[-1]].dur:
            stack.pop()
        parent = host[stack[-1]] if stack else None
        if parent is not None:
            ev.phase, ev.owner, ev.node, ev.node_name = parent.phase, parent.owner, parent.node, parent.node_name
            ev.aten_parent = parent.aten_parent or parent.name.startswith("aten::")
            direct = ev.owner is not None and stack[-1] == ev.owner and ev.name in _CASTS
            ev.cast_of = parent.cast_of if parent.cast_of is not None else ev.owner if direct else None
        if ev.name.startswith(_BACKWARD_NODE):
            ev.phase, ev.node, ev.node_name = "backward", i, ev.name.removeprefix(_BACKWARD_NODE).strip()
        elif _BACKWARD_SUFFIX.search(ev.name):
            ev.phase = "backward"
        elif ev.name.startswith(_STEP_NODE):
            ev.phase = "step"
        if ev.cat == "cpu_op" and ev.owner is not None and ev.name == host[ev.owner].name:
            host[ev.owner].inner = i  # the innermost re-call holds the shapes and dtype the kernels ran on
        if ev.cat == "cpu_op" and ev.owner is None:
            if _kind_of(ev.name) is not None:
                ev.owner = i
                recorded.append(i)
            elif ev.name.startswith("aten::") and not ev.aten_parent:
                skipped[ev.name] += 1
        stack.append(i)
    return recorded


def _device_times_s(events: list[dict[str, Any]], host: list[_Event]) -> dict[int, float]:
    """Seconds of device activity per recorded op, joined kernel -> launch -> op (correlation ids)."""
    by_external = {ev.args["External id"]: ev for ev in host if ev.cat == "cpu_op" and "External id" in ev.args}
    owner_of_launch: dict[Any, int] = {}
    def autocast_cast(ev: _Event) -> bool:  # a cast directly under an op that calls itself again on its output
        return ev.cast_of is not None and host[ev.cast_of].inner is not None

    for ev in host:
        if ev.cat in _LAUNCH_CATS and "correlation" in ev.args and not autocast_cast(ev):
            owner = ev.owner
            if owner is None and (op := by_external.get(ev.args.get("External id"))) is not None \
                    and not autocast_cast(op):
                owner = op.owner
            if owner is not None:
                owner_of_launch[ev.args["correlation"]] = owner
    times_s: dict[int, float] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") in _DEVICE_CATS and (owner := owner_of_launch.get(args.get("correlation"))) is not None:
            times_s[owner] = times_s.get(owner, 0.0) + float(e.get("dur", 0)) / 1e6
    return times_s


def _record(host: list[_Event], members: list[int], times_s: dict[int, float], device: str,
            fallback: DType | None, skipped: Counter[str], forward_of: dict[int, int]) -> OpRecord | None:
    """One OpRecord for calls with identical shapes (median time); None, counted as skipped, if unusable. A
    backward kernel is costed as the forward call that made its node, where the trace links them."""
    first = host[members[0]]
    cost, why = _cost(host[first.inner] if first.inner is not None else first, fallback)
    if first.phase == "backward" and cost is not None:
        linked, why = _linked_cost(host, first.node, forward_of, cost.kind, fallback)
        cost = linked or cost
    time_s = statistics.median(times_s.get(i, 0.0) for i in members)
    if cost is not None and time_s <= 0:
        why = "no kernels" if times_s else "zero duration"
    if cost is None or why:
        skipped[f"{first.name} ({why})"] += len(members)
        return None
    return _op_record(cost, device=device, name=first.name, phase=first.phase, time_s=time_s, repeats=len(members))


def _op_record(cost: _Cost, *, device: str, name: str, phase: str, time_s: float, repeats: int) -> OpRecord:
    """The record of `repeats` calls costed as `cost`, taking `time_s` each (their median)."""
    return OpRecord(device=device, kind=cost.kind, name=name, phase=phase, dtype=cost.dtype, flops=cost.flops,
                    bytes_read=cost.bytes_read, bytes_written=cost.bytes_written, param_bytes=cost.param_bytes,
                    time_s=time_s, repeats=repeats, shape=cost.shape)


def _role(ev: _Event, *, sequenced: bool) -> str:
    """What a recorded call is: its phase ("forward", "backward", "step"); "gemm", a GEMM of some autograd
    node's backward (`_gemm_backwards` joins them); or "skip", an op inside a backward node that is neither a
    whole backward nor a recomputation. With sequence numbers in the trace (`sequenced`), an op inside a
    backward node that has one builds graph: a recomputed forward call. Without them, a raw GEMM is a backward
    GEMM only inside a GEMM's own node (`MmBackward0`, `AddmmBackward0`, ...; elsewhere it may be a recomputation,
    which nothing tells apart: skipped), and a forward-named op other than a GEMM or a pointwise op is taken for a
    recomputation."""
    if ev.phase != "backward" or _BACKWARD_SUFFIX.search(ev.name):
        return ev.phase
    base = _base(ev.name)
    if sequenced:
        if "Sequence number" in ev.args:
            return "forward"
        return "gemm" if base in _MATMULS else "skip"
    if base in _GEMMS:
        return "gemm" if ev.node_name.startswith(_GEMM_NODES) else "skip"
    return "skip" if _kind_of(ev.name) is OpKind.ELEMENTWISE else "forward"


def _forward_calls(host: list[_Event]) -> dict[int, int]:
    """Sequence number -> the recorded forward op whose call (or a call inside it) made the autograd node of that
    number."""
    out: dict[int, int] = {}
    for ev in host:
        seq = ev.args.get("Sequence number") if ev.cat == "cpu_op" else None
        if isinstance(seq, int) and ev.owner is not None and host[ev.owner].phase == "forward" \
                and not ev.name.startswith(_BACKWARD_NODE):
            out.setdefault(seq, ev.owner)
    return out


def _linked_cost(host: list[_Event], node: int | None, forward_of: dict[int, int], kind: OpKind,
                 fallback: DType | None) -> tuple[_Cost | None, str]:
    """The figures of the forward call that made autograd node `node`, if it is a recorded op of `kind`: (cost,
    ""); (None, "") without a link; (None, why) where the forward call is another kind of op."""
    if node is None or not isinstance(seq := host[node].args.get("Sequence number"), int) or seq not in forward_of:
        return None, ""
    forward = host[forward_of[seq]]
    if _kind_of(forward.name) is not kind:
        return None, f"part of the backward of {forward.name}"
    return _cost(host[forward.inner] if forward.inner is not None else forward, fallback)


def _gemm_backwards(host: list[_Event], node_gemms: dict[int, list[int]], times_s: dict[int, float], device: str,
                    fallback: DType | None, skipped: Counter[str], forward_of: dict[int, int]) -> list[OpRecord]:
    """One backward record per autograd node name and pair of GEMM shapes and types, for nodes whose GEMMs are two
    of one size (a matmul's input and weight gradients): costed as the forward call that made the node (else as
    its first GEMM), with the two GEMMs' summed seconds (median over the nodes). Other nodes are skipped and
    counted under their node's name."""
    groups: dict[tuple[str, str], list[tuple[int, float, _Cost | None]]] = {}
    for node, calls in node_gemms.items():
        name = host[node].name.removeprefix(_BACKWARD_NODE).strip()
        costs = [_cost(host[i], fallback)[0] for i in calls]
        if len(calls) != 2 or any(c is None for c in costs) or len({c.flops for c in costs if c}) != 1:
            skipped[f"{name} ({len(calls)} GEMM{'s' if len(calls) != 1 else ''}, not an input's and a weight's "
                    "gradient of one size)"] += 1
            continue
        if any(times_s.get(i, 0.0) <= 0 for i in calls):
            skipped[f"{name} (no kernels)"] += 1
            continue
        linked, why = _linked_cost(host, node, forward_of, OpKind.MATMUL, fallback)
        if why:
            skipped[f"{name} ({why})"] += 1
            continue
        # one record per node kind and pair of GEMM shapes and types
        shapes = json.dumps(sorted(json.dumps([host[i].args.get("Input Dims"), host[i].args.get("Input type")])
                                   for i in calls))
        groups.setdefault((name, shapes), []).append((node, sum(times_s[i] for i in calls), linked))
    records = []
    for (name, _), members in groups.items():
        node, _, linked = members[0]
        cost = linked or _cost(host[node_gemms[node][0]], fallback)[0]
        assert cost is not None
        records.append(_op_record(cost, device=device, name=f"{name} (2 GEMMs)", phase="backward",
                                  time_s=statistics.median(t for _, t, _ in members), repeats=len(members)))
    return records


def _base(name: str) -> str:
    """`aten::_softmax_backward_data` -> `_softmax`; `aten::add_` -> `add`."""
    base = name.removeprefix("aten::")
    base = _BACKWARD_SUFFIX.sub("", base)
    return base[:-1] if base.endswith("_") and not base.endswith("__") else base


def _kind_of(name: str) -> OpKind | None:
    """The OpKind of an aten op name, None for names outside the supported ones."""
    if not name.startswith("aten::"):
        return None
    base = _base(name)
    if "scaled_dot_product" in base:
        return OpKind.ATTENTION
    for names, kind in ((_MATMULS, OpKind.MATMUL), (_NORMS, OpKind.LAYERNORM), (_SOFTMAXES, OpKind.SOFTMAX),
                        (_EMBEDDINGS, OpKind.EMBEDDING), (_CONVS, OpKind.CONV), (_ELEMENTWISE, OpKind.ELEMENTWISE)):
        if base in names:
            return kind
    return None


@dataclass(frozen=True)
class _Call:
    """An op call's tensor inputs (dims, element bytes), in argument order, and its other arguments."""

    tensors: list[tuple[list[int], int]]
    concrete: list[str]
    dtype: DType
    backward: bool

    def nbytes(self, index: int) -> float:
        dims, elem = self.tensors[index]
        return float(math.prod(dims) * elem)

    def numel(self, index: int) -> int:
        return math.prod(self.tensors[index][0])

    @property
    def elem(self) -> int:
        return self.dtype.nbytes

    @property
    def read(self) -> float:
        return sum(self.nbytes(i) for i in range(len(self.tensors)))


def _cost(ev: _Event, fallback: DType | None) -> tuple[_Cost | None, str]:
    """FLOPs and bytes of a recorded call from its `Input Dims` and `Input type`; else None and why."""
    dims, types = ev.args.get("Input Dims"), ev.args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list):
        return None, "no shapes"
    tensors = [(list(d), _ELEM_BYTES[t]) for d, t in zip(dims, types, strict=False)
               if t in _ELEM_BYTES and isinstance(d, list) and all(isinstance(x, int) for x in d)]
    dtype = next((_DTYPES[t] for t in types if t in _DTYPES), fallback)
    if dtype is None:
        return None, f"dtype {next((t for t in types if t in _ELEM_BYTES), '?')}"
    call = _Call(tensors, [str(c) for c in ev.args.get("Concrete Inputs") or []], dtype, ev.phase == "backward")
    kind = _kind_of(ev.name)
    try:
        cost = _COSTS[kind](_base(ev.name), call) if kind is not None and tensors else None
    except (IndexError, ValueError, ZeroDivisionError):
        cost = None
    return (cost, "") if cost is not None else (None, "unexpected shapes")


def _matmul(base: str, c: _Call) -> _Cost:
    shapes = [d for d, _ in c.tensors]
    if base == "linear":
        x, w = shapes[0], shapes[1]
        batch, m, k, n = 1, math.prod(x[:-1]), x[-1], w[0]
        params = sum(c.nbytes(i) for i in range(1, len(shapes)))
    else:
        a, b = shapes[1:3] if base in ("addmm", "baddbmm") else shapes[:2]
        a, b = ([1, *a] if len(a) == 1 else a), ([*b, 1] if len(b) == 1 else b)
        m, k, n = a[-2], a[-1], b[-1]
        batch = math.prod(max(p, q) for p, q in zip_longest(reversed(a[:-2]), reversed(b[:-2]), fillvalue=1))
        params = 0.0
    shape = {"m": m, "k": k, "n": n} | ({"batch": batch} if batch > 1 else {})
    return _Cost(OpKind.MATMUL, c.dtype, 2.0 * batch * m * k * n, c.read, float(batch * m * n * c.elem),
                 params if not c.backward else 0.0, shape)


_IS_CAUSAL_ARG = {"scaled_dot_product_attention": 5, "_scaled_dot_product_flash_attention": 4,
                  "_scaled_dot_product_flash_attention_for_cpu": 4, "_scaled_dot_product_efficient_attention": 6,
                  "_scaled_dot_product_cudnn_attention": 6}
"""Where each forward attention op's schema has `is_causal` (its `Concrete Inputs` follow the schema)."""


def _attention(base: str, c: _Call) -> _Cost:
    q, k, v = (c.tensors[i][0] for i in ((1, 2, 3) if c.backward else (0, 1, 2)))
    heads, s, d = math.prod(q[:-2]), q[-2], q[-1]
    s_kv, d_v = k[-2], v[-1]
    scores = heads * s * s_kv
    read = sum(c.nbytes(i) for i in ((1, 2, 3) if c.backward else (0, 1, 2)))  # the forward's q, k, v
    shape = {"batch_heads": heads, "seq": s, "seq_kv": s_kv, "head_dim": d}
    at = _IS_CAUSAL_ARG.get(base)
    if at is not None and len(c.concrete) > at and c.concrete[at] == "True":  # which `training.calibrate` reads
        shape["causal"] = 1
    return _Cost(OpKind.ATTENTION, c.dtype, 2.0 * scores * (d + d_v) + 5.0 * scores, read,
                 float(heads * s * d_v * c.elem), 0.0, shape)


def _per_element(kind: OpKind, flops_per_element: float) -> Callable[[str, _Call], _Cost]:
    """Cost of a memory-bound op: `flops_per_element` per element of its (largest) input, written once."""

    def cost(base: str, c: _Call) -> _Cost:
        numel = c.numel(0) if kind is not OpKind.ELEMENTWISE else max(c.numel(i) for i in range(len(c.tensors)))
        last = c.tensors[0][0][-1] if c.tensors[0][0] else 1
        params = 0.0 if c.backward else sum(c.nbytes(i) for i in range(1, len(c.tensors)))
        shape = {"elements": numel} if kind is OpKind.ELEMENTWISE else {"rows": numel // last, "cols": last}
        # a backward kernel is costed as its forward: one input read, the output written (its weights left out)
        read = float(numel * c.elem) if c.backward else c.read
        return _Cost(kind, c.dtype, flops_per_element * numel, read, float(numel * c.elem),
                     params if kind is OpKind.LAYERNORM else 0.0, shape)

    return cost


def _embedding(base: str, c: _Call) -> _Cost:
    """A lookup, embedding(weight [V, H], indices [...]) (its dense backward is not recorded: `read_kineto`)."""
    (vocab, hidden), tokens = c.tensors[0][0], c.numel(1)
    looked_up = float(tokens * hidden * c.elem)
    return _Cost(OpKind.EMBEDDING, c.dtype, 0.0, looked_up + c.nbytes(1), looked_up, c.nbytes(0),
                 {"tokens": tokens, "vocab": vocab, "hidden": hidden})


def _ints(text: str, rank: int, default: int) -> list[int]:
    """`'[2, 2]'` or `'2'` -> [2, 2]; `default` repeated when the trace has no value."""
    found = [int(x) for x in re.findall(r"-?\d+", text)]
    return (found * rank)[:rank] if found else [default] * rank


def _conv(base: str, c: _Call) -> _Cost:
    # forward: (input, weight, bias, stride, padding, dilation[, transposed, output_padding], groups);
    # convolution_backward: (grad_out, input, weight, bias_sizes, stride, padding, dilation, ...).
    x, w = (c.tensors[1][0], c.tensors[2][0]) if c.backward else (c.tensors[0][0], c.tensors[1][0])
    first = 4 if c.backward else 3
    rank = len(w) - 2
    args = [*c.concrete, "", "", "", "", ""][first:first + 4]
    if args[3] == "True":  # convolution(..., transposed, ...): not costed here
        raise ValueError("transposed convolution")
    stride, dilation = _ints(args[0], rank, 1), _ints(args[2], rank, 1)
    if "same" in args[1]:
        padded = [dil * (kw - 1) for dil, kw in zip(dilation, w[2:], strict=True)]
    else:
        padded = [2 * p for p in _ints(args[1], rank, 0)]
    out = [(size + pad - dil * (kw - 1) - 1) // st + 1
           for size, pad, dil, kw, st in zip(x[2:], padded, dilation, w[2:], stride, strict=True)]
    macs = x[0] * w[0] * math.prod(out) * math.prod(w[1:])
    written = float(x[0] * w[0] * math.prod(out) * c.elem)
    # a backward is costed as its forward: the input and weight read (the bias's sizes are not a tensor there)
    read, params = (c.nbytes(1) + c.nbytes(2), c.nbytes(2)) if c.backward else (
        c.read, sum(c.nbytes(i) for i in range(1, len(c.tensors))))
    shape = {"batch": x[0], "in_channels": x[1], "out_channels": w[0], "kernel": math.prod(w[2:]),
             "out_positions": math.prod(out)}
    return _Cost(OpKind.CONV, c.dtype, 2.0 * macs, read, written, params, shape)


_COSTS: dict[OpKind, Callable[[str, _Call], _Cost]] = {
    OpKind.MATMUL: _matmul,
    OpKind.ATTENTION: _attention,
    OpKind.LAYERNORM: _per_element(OpKind.LAYERNORM, 5.0),
    OpKind.SOFTMAX: _per_element(OpKind.SOFTMAX, 5.0),
    OpKind.ELEMENTWISE: _per_element(OpKind.ELEMENTWISE, 1.0),
    OpKind.EMBEDDING: _embedding,
    OpKind.CONV: _conv,
}
