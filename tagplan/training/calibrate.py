"""Fit the cost model's calibration to measured traces, and report its error before and after.

Compute (per device type): the model is `cost.compute.op_time`,

    t = max(flops / (peak * eff(kind, flops)), bytes / (mem_bw * mem_eff)) + launch

- `launch` and `mem_eff`: the pair, over a log grid, that minimises the mean |log(predicted /
  measured)| of the memory-bound calls (norms, softmax, pointwise, embedding; both phases); then,
  with that launch, each memory-bound kind's own fraction (`Calibration.memory_efficiency`
  key `device/kind`): a CPU's GELU and its copies reach very different fractions;
- `eff(kind, .)` for each kind with a curve (matmul, conv, attention): the achieved fraction of
  peak of each call, `flops / (peak * (t - launch))` (a backward's FLOPs and launches as the
  cost model counts them), binned by decade of forward FLOPs per call; each bin's median is a
  point of the piecewise-linear curve (capped at 1).

Links (per device type and scope, intra-node or inter-node): the ring's alpha-beta model,

    t = steps * alpha + bus_bytes / bw,  steps = 2(n-1) all-reduce, (n-1) all-gather/reduce-scatter/
    all-to-all, 1 p2p;  bus_bytes = the nccl-tests bus factor times the size

fitted by non-negative least squares in (alpha, 1/bw), relative errors weighted equally.

Iterations: with `iteration` records, the named physical parameters (compute scale per device,
link scales and latencies, per-micro-batch, per-iteration and p2p overheads, optimizer scale)
are fitted on top of the op and link fit by robust least squares on log time, scored by k-fold
cross-validation (`training.iteration_fit`). Layer records are copied in as measured block
times (`Calibration.layers`) first, so the parameters correct the model the simulator will run.

Held out: for each (device, kind) every third distinct shape in FLOPs order (both phases), and every third
message size of each collective, are kept out of the fit; errors are MAPE of predicted vs measured
time on them, with the base calibration ("before") and the fitted one ("after").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tagplan.cost.calibration import (
    ANY_DEVICE,
    DEFAULT_CALIBRATION,
    INTER,
    INTRA,
    Calibration,
    EfficiencyCurve,
    LayerTime,
    LinkFit,
    link_key,
)
from tagplan.cost.compute import attention_fraction, op_time
from tagplan.datasets.traces.bundle import Bundle, CollectiveRecord, LayerRecord, OpRecord
from tagplan.errors import SpecError
from tagplan.frontends.catalog import lookup_device
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.model import Op, OpKind
from tagplan.ir.plan import ShardStrategy
from tagplan.training.iteration_fit import IterationFitReport, cross_validate, rebuild_cases

CURVE_KINDS = (OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION)
MEMORY_KINDS = (OpKind.LAYERNORM, OpKind.SOFTMAX, OpKind.ELEMENTWISE, OpKind.EMBEDDING, OpKind.REDUCTION)
HOLD_OUT_EVERY = 3
"""Every third shape (and message size) is held out of the fit to measure the error on."""
_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
          "all_to_all": lambda n: n - 1, "broadcast": lambda n: n - 1, "p2p": lambda n: 1}
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
        "p2p": lambda n: 1.0}


@dataclass(frozen=True)
class ErrorRow:
    """Error of one group of held-out measurements, before and after the fit."""

    device: str
    what: str  # an op kind and phase, or a link key
    fitted_on: int
    held_out: int
    mape_before: float | None  # None where the base calibration has no prediction (an unknown link)
    mape_after: float


@dataclass
class CalibrationFit:
    """The fitted calibration, the device figures it is relative to, and its held-out errors."""

    calibration: Calibration
    devices: dict[str, DeviceSpec]
    rows: list[ErrorRow] = field(default_factory=list)
    iterations: IterationFitReport | None = None
    held_ops: list[OpRecord] = field(default_factory=list)

    def summary(self) -> dict[str, float | None]:
        """Record-weighted MAPE over all held-out ops, before and after (None without ops)."""
        ops = [r for r in self.rows if "/" not in r.what]
        total = sum(r.held_out for r in ops)
        out: dict[str, float | None] = {"ops_mape_before": None, "ops_mape_after": None}
        if total:
            out["ops_mape_before"] = sum((r.mape_before or 0.0) * r.held_out for r in ops) / total
            out["ops_mape_after"] = sum(r.mape_after * r.held_out for r in ops) / total
        if self.iterations is not None:
            it = self.iterations
            out.update(iterations_mape_before=it.before.mape, iterations_mape_after=it.after.mape,
                       iterations_tau_before=it.before.kendall_tau, iterations_tau_after=it.after.kendall_tau)
        return out


def device_specs(bundles: Sequence[Bundle]) -> dict[str, DeviceSpec]:
    """The figures each device type's efficiencies are relative to: the manifest's, else the catalog's."""
    specs: dict[str, DeviceSpec] = {}
    for bundle in bundles:
        device = bundle.manifest.device
        if device is not None:
            specs[bundle.manifest.fingerprint.device_type] = device
    for bundle in bundles:
        for record in bundle.ops():
            if record.device not in specs:
                try:
                    specs[record.device] = lookup_device(record.device)
                except SpecError as err:
                    raise SpecError(f"op records name device {record.device!r}, which is neither in a bundle "
                                    f"manifest's `device` nor in the catalog: {err}") from None
    return specs


def fit_calibration(bundles: Sequence[Bundle], *, base: Calibration = DEFAULT_CALIBRATION, name: str = "measured",
                    iterations: bool = True, folds: int | None = None) -> CalibrationFit:
    """Fit compute and link figures to the bundles' op and collective records, take their layer
    records, then fit the named physical parameters to their iteration records (module docstring)."""
    ops = [r for b in bundles for r in b.ops()]
    collectives = [r for b in bundles for r in b.collectives()]
    layers = [r for b in bundles for r in b.layers()]
    measured = [r for b in bundles for r in b.iterations()] if iterations else []
    if not ops and not collectives and not layers and not measured:
        raise SpecError("the bundles hold no op, collective, layer or iteration records to calibrate from")
    fit = _fit_ops_and_links(bundles, ops, collectives, base, name)
    if layers:
        fit.calibration = fit.calibration.model_copy(update={"layers": layer_times(layers, fit.calibration)})
    if measured:
        fit.calibration, fit.iterations = cross_validate(rebuild_cases(measured), fit.calibration, folds=folds)
    return fit


def layer_times(records: Sequence[LayerRecord], base: Calibration = DEFAULT_CALIBRATION) -> tuple[LayerTime, ...]:
    """The layer records as the simulator's measured block times, after `base`'s own (a record of the
    same block, device, dtype, sequence length, tp and micro-batch replaces the older one)."""
    keyed = {(t.block_hash, t.device, t.dtype, t.seq_len, t.tp, t.micro_batch): t for t in base.layers}
    for r in records:
        keyed[(r.block_hash, r.device, r.dtype, r.seq_len, r.tp, float(r.micro_batch))] = LayerTime(
            block_hash=r.block_hash, block_name=r.block_name, device=r.device, dtype=r.dtype, seq_len=r.seq_len,
            tp=r.tp, micro_batch=r.micro_batch, forward_s=r.forward_s, backward_s=r.backward_s)
    return tuple(keyed.values())


def _fit_ops_and_links(bundles: Sequence[Bundle], ops: list[OpRecord], collectives: list[CollectiveRecord],
                       base: Calibration, name: str) -> CalibrationFit:
    if not ops and not collectives:
        return CalibrationFit(base.model_copy(update={"name": name}), {})
    specs = device_specs(bundles)
    by_device: dict[str, list[OpRecord]] = defaultdict(list)
    for record in ops:
        by_device[record.device].append(record)
    compute = {k: dict(v) for k, v in base.compute.items()}
    memory = dict(base.memory_efficiency)
    launches: dict[str, float] = dict(base.launch_by_device)
    held: dict[str, list[OpRecord]] = {}
    fit_sets = {}
    for device, records in by_device.items():
        fit_sets[device], held[device] = _split_ops(records)
    given = base
    fused = [r for device, members in fit_sets.items() if specs[device].fused_attention for r in members]
    if (causal := fit_causal(fused)) is not None:  # before the curves, which are read at the FLOPs a kernel runs
        base = base.model_copy(update={"causal_time_fraction": causal[0], "causal_diagonal_tokens": causal[1]})
    for device, fit_set in fit_sets.items():
        launch, fractions = _memory_fit(fit_set, specs[device], base)
        launches[device] = launch
        memory.update(fractions)
        curves = {kind: curve for kind in CURVE_KINDS
                  if (curve := _curve(fit_set, kind, specs[device], launch, base)) is not None}
        compute[device] = {**compute.get(ANY_DEVICE, {}), **curves}
    links = dict(base.links)
    link_rows = []
    for key, members in _group_links(collectives).items():
        fit_links, held_out = _split_sizes(members)
        links[key] = _fit_link(fit_links or members)
        if held_out:
            measured = [r.time_s for r in held_out]
            after = _mape([_link_time(links[key], r) for r in held_out], measured)
            replaced = base.links.get(key)  # the defaults cost a link from a cluster, which a record does not name
            before = _mape([_link_time(replaced, r) for r in held_out], measured) if replaced is not None else None
            link_rows.append(ErrorRow(key.split("/")[0], key, len(fit_links), len(held_out), before, after))
    calibration = base.model_copy(update=dict(name=name, compute=compute, memory_efficiency=memory,
                                              launch_by_device=launches, links=links))
    rows = [row for device in by_device for row in _op_rows(device, held[device], specs[device], given, calibration,
                                                            len(by_device[device]) - len(held[device]))]
    return CalibrationFit(calibration, specs, rows + link_rows, held_ops=[r for d in held.values() for r in d])


def causal_pairs(records: Sequence[OpRecord]) -> list[tuple[int, float]]:
    """(keys, causal time / unmasked time) of every attention call timed both causal and unmasked at one shape,
    device, dtype and phase (`shape["causal"]`, as `profiling.ops` writes it)."""
    times: dict[tuple[str, str, str, tuple[tuple[str, int], ...], bool], float] = {}
    for r in records:
        if r.kind is OpKind.ATTENTION and "s" in r.shape and r.time_s > 0:
            dims = tuple(sorted((k, v) for k, v in r.shape.items() if k != "causal"))
            times[(r.device, r.dtype.value, r.phase, dims, bool(r.shape.get("causal", 0)))] = r.time_s
    pairs = []
    for (device, dtype, phase, dims, causal), time_s in sorted(times.items()):
        unmasked = times.get((device, dtype, phase, dims, False))
        if causal and unmasked:
            pairs.append((dict(dims)["s"], time_s / unmasked))
    return pairs


def fit_causal(records: Sequence[OpRecord]) -> tuple[float, float] | None:
    """(`causal_time_fraction`, `causal_diagonal_tokens`) by least squares of fraction + tokens / s against the
    causal-to-unmasked time ratios (`causal_pairs`), pooled over the records' devices (pass those with a fused
    kernel); where the fit finds no diagonal cost, the mean ratio alone; None with fewer than two sequence lengths
    to fit on."""
    pairs = causal_pairs(records)
    if len({keys for keys, _ in pairs}) < 2:
        return None
    keys = np.array([k for k, _ in pairs], dtype=float)
    design = np.vstack([np.ones_like(keys), 1.0 / keys]).T
    ratios = np.array([r for _, r in pairs])
    (fraction, tokens), *_ = np.linalg.lstsq(design, ratios, rcond=None)
    if tokens < 0:  # no diagonal cost to fit: the mean ratio alone
        fraction, tokens = float(np.mean(ratios)), 0.0
    return float(min(max(fraction, 1e-3), 1.0)), float(tokens)


def predict_op_s(record: OpRecord, spec: DeviceSpec, calibration: Calibration) -> float:
    """The cost model's seconds for one measured call (its forward or backward, per its phase): the
    kernel's time, as an op record measures it (CUDA events), so without what iteration calibration
    adds on top (`compute_scale`; the host's issue floor `host_dispatch_s` is a block's, not an op's)."""
    if calibration.compute_scale or calibration.host_dispatch_s:
        calibration = kernel_only(calibration)
    t = op_time(record_op(record), samples=1.0, tp=1, strategy=ShardStrategy.REPLICATE, spec=spec,
                dtype=record.dtype, calibration=calibration)
    return t.backward_s if record.phase == "backward" else t.forward_s


def record_op(record: OpRecord) -> Op:
    """The Op one measured call is: an attention record's shape gives its queries and whether it was masked
    causally (`shape["s"]` and `shape["causal"]` as `profiling.ops` writes them, `shape["seq"]` as the Kineto
    import does), which a fused kernel's cost discounts (`compute.attention_fraction`)."""
    shape = record.shape
    queries = shape.get("s", shape.get("seq"))
    attention = record.kind is OpKind.ATTENTION and queries is not None
    return Op(name=record.name or record.kind.value, kind=record.kind, flops=record.flops, bytes_read=record.bytes_read,
              bytes_written=record.bytes_written, param_bytes=min(record.param_bytes, record.bytes_read),
              causal=attention and bool(shape.get("causal", 0)),
              output_shape=(shape.get("b", 1), shape.get("h", 1), queries, shape.get("d", 1))
              if attention and queries is not None else ())


def kernel_only(calibration: Calibration) -> Calibration:
    """`calibration` without the iteration-level figures that scale an op's kernel time or floor a block's."""
    return calibration.model_copy(update={"compute_scale": {}, "host_dispatch_s": {}})


def _split_ops(records: list[OpRecord]) -> tuple[list[OpRecord], list[OpRecord]]:
    """(fit, held out): per (kind, dtype), every third distinct shape by FLOPs, both its phases, is held out."""
    groups: dict[tuple[object, ...], list[OpRecord]] = defaultdict(list)
    for r in records:
        groups[(r.kind, r.dtype)].append(r)
    fit: list[OpRecord] = []
    held: list[OpRecord] = []
    for members in groups.values():
        shapes = sorted({_shape_key(r) for r in members})
        out = {s for i, s in enumerate(shapes) if i % HOLD_OUT_EVERY == 1 and len(shapes) >= HOLD_OUT_EVERY}
        for r in members:
            (held if _shape_key(r) in out else fit).append(r)
    return fit, held


def _shape_key(r: OpRecord) -> tuple[object, ...]:
    """A call's shape; an attention call's causal and unmasked timings are one shape, held out or fitted together
    (`fit_causal` pairs them)."""
    return (r.flops, r.bytes_read + r.bytes_written, tuple(sorted((k, v) for k, v in r.shape.items() if k != "causal")))


LAUNCH_GRID_S = (0.0, *np.geomspace(1e-7, 1e-3, 29).tolist())
MEMORY_GRID = tuple(np.geomspace(0.01, 1.0, 29).tolist())


def _memory_fit(records: list[OpRecord], spec: DeviceSpec, base: Calibration) -> tuple[float, dict[str, float]]:
    """(launch s, fraction of memory bandwidth per `device/kind` key): the launch and one fraction
    minimising the mean |log(predicted / measured)| of all memory-bound calls (both phases) over a
    grid, then each kind's own fraction with that launch. (base launch, {}) without such calls."""
    calls = [r for r in records if r.kind in MEMORY_KINDS]
    if not calls:
        return base.launch_s(spec.name), {}
    launch, _ = _grid(calls, spec, base, LAUNCH_GRID_S)
    fractions = {}
    for kind in sorted({r.kind for r in calls}):
        _, fractions[f"{spec.name}/{kind.value}"] = _grid([r for r in calls if r.kind is kind], spec, base, (launch,))
    return launch, fractions


def _grid(calls: list[OpRecord], spec: DeviceSpec, base: Calibration,
          launches: Sequence[float]) -> tuple[float, float]:
    """The (launch, device-wide memory fraction) of the grid with the least mean |log error| on `calls`."""
    truth = np.log([r.time_s for r in calls])
    best: tuple[float, float, float] | None = None
    for launch in launches:
        for fraction in MEMORY_GRID:
            trial = base.model_copy(update={"launch_by_device": {**base.launch_by_device, spec.name: launch},
                                            "memory_efficiency": {**base.memory_efficiency, spec.name: fraction}})
            error = float(np.mean(np.abs(np.log([predict_op_s(r, spec, trial) for r in calls]) - truth)))
            if best is None or error < best[2]:
                best = (launch, fraction, error)
    assert best is not None
    return best[0], best[1]


def _curve(records: list[OpRecord], kind: OpKind, spec: DeviceSpec, launch_s: float,
           base: Calibration) -> EfficiencyCurve | None:
    """The efficiency curve of `kind`: per decade of forward FLOPs per call, the median achieved
    fraction of the sustained peak over the calls of both phases (a backward does 2x, attention's
    `attention_backward_factor` x, the forward's FLOPs in the cost model)."""
    points: dict[int, list[float]] = defaultdict(list)
    backward = base.attention_backward_factor if kind is OpKind.ATTENTION else 2.0
    for r in records:
        if r.kind is not kind or r.flops <= 0 or r.phase not in ("forward", "backward"):
            continue
        launches = 1.0 if r.phase == "forward" or kind is OpKind.ATTENTION else 2.0
        run = r.flops * attention_fraction(record_op(r), fused=spec.fused_attention, calibration=base)
        flops = run * (1.0 if r.phase == "forward" else backward)
        body = max(r.time_s - launches * launch_s, 0.1 * r.time_s)
        # against the sustained peak, as `op_time` applies the curve (at the FLOPs the kernel runs: a causal
        # kernel's discounted ones): a power cap is counted once
        points[round(math.log10(run))].append(flops / (spec.sustained_peak_flops(r.dtype) * body))
    if not points:
        return None
    decades = sorted(points)
    return EfficiencyCurve(flops=tuple(10.0**d for d in decades),
                           efficiency=tuple(float(min(max(np.median(points[d]), 1e-4), 1.0)) for d in decades))


def _op_rows(device: str, held: list[OpRecord], spec: DeviceSpec, base: Calibration, fitted: Calibration,
             fitted_on: int) -> list[ErrorRow]:
    groups: dict[tuple[str, str], list[OpRecord]] = defaultdict(list)
    for r in held:
        groups[(r.kind.value, r.phase)].append(r)
    rows = []
    for (kind, phase), members in sorted(groups.items()):
        truth = [r.time_s for r in members]
        before = _mape([predict_op_s(r, spec, base) for r in members], truth)
        after = _mape([predict_op_s(r, spec, fitted) for r in members], truth)
        rows.append(ErrorRow(device, f"{kind} {phase}", fitted_on, len(members), before, after))
    return rows


def _group_links(records: list[CollectiveRecord]) -> dict[str, list[CollectiveRecord]]:
    groups: dict[str, list[CollectiveRecord]] = defaultdict(list)
    for r in records:
        groups[link_key(r.device, INTRA if r.nodes == 1 else INTER)].append(r)
    return groups


def _split_sizes(records: list[CollectiveRecord]) -> tuple[list[CollectiveRecord], list[CollectiveRecord]]:
    """(fit, held out): per collective and group size, every third message size is held out."""
    groups: dict[tuple[str, int], list[CollectiveRecord]] = defaultdict(list)
    for r in records:
        groups[(r.collective, r.ranks)].append(r)
    fit: list[CollectiveRecord] = []
    held: list[CollectiveRecord] = []
    for members in groups.values():
        sizes = sorted({r.bytes for r in members})
        out = {s for i, s in enumerate(sizes) if i % HOLD_OUT_EVERY == 1 and len(sizes) >= HOLD_OUT_EVERY}
        for r in members:
            (held if r.bytes in out else fit).append(r)
    return fit, held


def _share_bytes(r: CollectiveRecord) -> float:
    """The bytes one GPU's link share carries: the bus bytes, over the ranks per host for a collective
    across nodes (NCCL runs one ring per NIC, so a host's ranks share its NICs and the bus bandwidth
    nccl-tests reports is theirs together). The fitted bandwidth is then per GPU, the figure
    `frontends.nccl_tests.apply_nccl_tests` gives the same log, and `calibrated_cluster` applies."""
    per_host = max(r.ranks // r.nodes, 1) if r.nodes > 1 else 1
    return _BUS[r.collective](r.ranks) * r.bytes / per_host


def _fit_link(records: list[CollectiveRecord]) -> LinkFit:
    """Non-negative least squares of t = steps * alpha + share_bytes * (1 / bw), each row scaled by 1 / t."""
    steps = np.array([_STEPS[r.collective](r.ranks) for r in records], dtype=float)
    bus = np.array([_share_bytes(r) for r in records])
    t = np.array([r.time_s for r in records])
    a = np.column_stack([steps, bus]) / t[:, None]
    b = np.ones(len(t))
    best: tuple[float, float, float] | None = None
    for cols in ((0, 1), (1,), (0,)):  # the 2-parameter solution, else one parameter at its bound 0
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (sol < 0).any():
            continue
        x = np.zeros(2)
        x[list(cols)] = sol
        residual = float(np.square(a @ x - b).sum())
        if best is None or residual < best[2]:
            best = (float(x[0]), float(x[1]), residual)
    alpha, inverse_bw, _ = best if best is not None else (0.0, float(np.median(t / np.maximum(bus, 1.0))), 0.0)
    bandwidth = 1.0 / inverse_bw if inverse_bw > 0 else float(np.max(bus / t))
    return LinkFit(bandwidth_Bps=bandwidth, latency_s=alpha, samples=len(records))


def _link_time(fit: LinkFit, r: CollectiveRecord) -> float:
    return _STEPS[r.collective](r.ranks) * fit.latency_s + _share_bytes(r) / fit.bandwidth_Bps


def _mape(pred: Sequence[float], true: Sequence[float]) -> float:
    p, t = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)
    return float(np.mean(np.abs(p / t - 1.0))) if len(t) else float("nan")


@dataclass(frozen=True)
class Comparison:
    """Held-out error of a new calibration and of the one it would replace, on the same records."""

    metric: str  # "iteration MAPE (k-fold)" or "op MAPE (held-out shapes)"
    new: float
    replaced: float

    @property
    def worse(self) -> bool:
        """Whether the new calibration is worse on held-out data (beyond rounding)."""
        return self.new > self.replaced * (1 + 1e-6) + 1e-12


def compare_with(fit: CalibrationFit, replaced: Calibration, bundles: Sequence[Bundle]) -> Comparison | None:
    """The new fit's held-out error beside `replaced`'s on the same held-out records; None when the
    bundles give no held-out error (layer records only, or a single iteration record)."""
    from tagplan.training.iteration_fit import predict_s

    if fit.iterations is not None and fit.iterations.folds:
        cases = rebuild_cases([r for b in bundles for r in b.iterations()])
        truth = np.array([c.measured_s for c in cases])
        old = float(np.mean(np.abs(predict_s(cases, replaced) / truth - 1.0)))
        return Comparison(f"iteration MAPE ({fit.iterations.folds}-fold)", fit.iterations.after.mape, old)
    if fit.held_ops:
        truth_ops = [r.time_s for r in fit.held_ops]
        new = _mape([predict_op_s(r, fit.devices[r.device], fit.calibration) for r in fit.held_ops], truth_ops)
        old = _mape([predict_op_s(r, fit.devices[r.device], replaced) for r in fit.held_ops], truth_ops)
        return Comparison("op MAPE (held-out shapes)", new, old)
    return None


def calibrated_devices(calibration: Calibration) -> set[tuple[str, str]]:
    """(what, device type) for each figure `calibration` holds fitted for a device: its op curves, memory
    efficiency (`device/kind` keys too), links, scales, overheads and layer times (the catch-all `*` entries
    excluded). A new calibration that lacks a pair the file it overwrites has would drop that figure."""
    tables: dict[str, Mapping[str, object]] = {
        "op curves": calibration.compute, "memory efficiency": calibration.memory_efficiency,
        "launch time": calibration.launch_by_device, "compute scale": calibration.compute_scale,
        "micro-batch overhead": calibration.micro_batch_overhead_s,
        "iteration overhead": calibration.iteration_overhead_s, "p2p overhead": calibration.p2p_overhead_s,
        "collective overhead": calibration.collective_overhead_s,
        "recompute overhead": calibration.recompute_overhead_s, "optimizer scale": calibration.optimizer_scale,
        "ZeRO-3 scale": calibration.zero3_comm_scale, "ZeRO-3 overlap": calibration.zero3_hidden_fraction,
        "host dispatch": calibration.host_dispatch_s, "links": calibration.links,
        "link scales": calibration.link_scales}
    pairs = {(what, key.split("/")[0]) for what, table in tables.items() for key in table}  # link_key's device
    pairs |= {("layer times", layer.device) for layer in calibration.layers}
    return {(what, device) for what, device in pairs if device != ANY_DEVICE}


def fingerprint_warnings(bundles: Sequence[Bundle], device: str) -> list[str]:
    """One line per bundle or record whose measured device type is not `device`."""
    out = []
    for i, bundle in enumerate(bundles):
        measured = bundle.manifest.fingerprint.device_type
        if measured != device:
            out.append(f"bundle {i} ({bundle.manifest.source}): its fingerprint measured {measured!r}, not {device!r}")
        kinds = ({r.device for r in bundle.ops()} | {r.device for r in bundle.collectives()}
                 | {r.device for r in bundle.layers()}) - {device}
        if kinds:
            out.append(f"bundle {i}: records name device type(s) {', '.join(sorted(kinds))}, not {device!r}")
        others = [j for j, r in enumerate(bundle.iterations())
                  if (names := _cluster_devices(r.cluster)) and device not in names]
        if others:
            out.append(f"bundle {i}: {len(others)} iteration record(s) ({', '.join(map(str, others[:5]))}"
                       f"{', ...' if len(others) > 5 else ''}) ran on clusters without {device!r}")
    return out


def _cluster_devices(cluster: object) -> set[str]:
    """Device type names an iteration record's cluster names (inline objects only; SPECs: by name)."""
    if isinstance(cluster, dict):
        groups = cluster.get("node_groups") or cluster.get("nodes") or []
        names = set()
        for g in groups if isinstance(groups, list) else []:
            gpu = g.get("gpu") if isinstance(g, dict) else None
            name = gpu.get("name") if isinstance(gpu, dict) else gpu
            if isinstance(name, str):
                names.add(name)
        return names
    if isinstance(cluster, str):
        from tagplan.frontends.cluster_spec import load_cluster

        try:
            return {d.spec.name for d in load_cluster(cluster).devices}
        except SpecError:
            return set()
    return set()
