"""Fit the cost model's named physical parameters to measured iteration times.

The parameters (`cost.calibration.Calibration`; the defaults are the datasheet model):

- per device type an achieved-compute scale (compute time x scale);
- per link class (`DEVICE/intra`, `DEVICE/inter`) an achieved-bandwidth scale and an added latency per step;
- a fixed overhead per stage per micro-batch, one per iteration, one per pipeline send, one per
  collective call (the ranks' synchronisation, which a send does not pay: without it the link latency
  that gloo's collectives need also slowed every pipeline send);
- an optimizer-step scale;
- for runs with ZeRO-3 stages, a scale of the seconds of their per-micro-batch gathers and reduce-scatters and
  how much of them runs hidden under compute (`Calibration.zero3_comm_scale`, `zero3_hidden_fraction`, at most 1;
  the fit starts the fraction at 1/2, since fully hidden fetches move no prediction and their seconds could not
  be fitted);
- for eager runs, the host's time to issue one kernel (`Calibration.host_dispatch_s`: a floor of each block on
  a GPU, added to it on a CPU).

All but the compute scales are filed under the one device type the records ran on (`*` when
they span several), so a calibration of one device type never changes plans on another.

Each measured iteration is simulated with the candidate parameters; the fit minimises the Huber
loss (delta 0.1) of log(predicted / measured) by Levenberg-Marquardt with forward-difference
Jacobians, iteratively reweighted, plus a weak pull (`PRIOR`) towards the starting calibration
so that parameters the records cannot see stay where they were. Scales are fitted in log space
within [1/50, 50]; overheads and latencies in units of the median measured time, never negative.
A parameter whose change moves no prediction (a link class no measured plan uses) is left out.

`cross_validate` scores the procedure: k folds (k = min(5, records)), each record predicted by a
fit that never saw it; it reports MAPE and Kendall tau before (the starting calibration) and after.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tagplan.cost.calibration import ANY_DEVICE, INTER, INTRA, Calibration, LinkScale
from tagplan.cost.simulator import Simulator
from tagplan.datasets.traces.bundle import IterationRecord
from tagplan.datasets.traces.iterations import rebuild_record
from tagplan.errors import SpecError
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan
from tagplan.ir.workload import Workload

PRIOR = 1e-3
"""Weight of the pull towards the starting values, per parameter (in log or median-time units)."""
HUBER_DELTA = 0.1
"""log-error beyond which a record's weight falls as 1/|error| (robust to a few bad measurements)."""
SCALE_BOUNDS = (math.log(1 / 50), math.log(50))
BANDWIDTH_SCALE_MAX = 2.0
"""A link's achieved bandwidth stays below twice its rated figure: no collective beats the wire, and the
slack only covers rated figures that understate. Without the bound a few records can trade a link
class against another (a 5x faster network paired with a slower PCIe fitting 16 runs equally well)."""
MAX_FOLDS = 5


@dataclass(frozen=True)
class IterationCase:
    """One measured iteration rebuilt: what the simulator needs and the measured seconds."""

    model: ModelGraph
    cluster: Cluster
    workload: Workload
    plan: Plan
    measured_s: float


@dataclass(frozen=True)
class Param:
    """One named parameter: `field` of Calibration, its key, and whether it is a log-scale or seconds."""

    name: str
    log_scale: bool
    max_value: float | None = None  # a scale's largest value (None: SCALE_BOUNDS; overheads: unbounded)
    start: float | None = None  # where the fit starts when the base calibration has no figure (None: its default)

    @property
    def upper(self) -> float:
        """Largest value the fit may take, in its own space (log for scales, median-time units otherwise)."""
        if not self.log_scale:
            return math.inf
        return math.log(self.max_value) if self.max_value is not None else SCALE_BOUNDS[1]


@dataclass(frozen=True)
class IterationScore:
    """MAPE and Kendall tau of predicted against measured iteration times."""

    mape: float
    kendall_tau: float | None


@dataclass(frozen=True)
class IterationFitReport:
    """Cross-validated error before (starting calibration) and after (the fitted parameters)."""

    records: int
    folds: int
    before: IterationScore
    after: IterationScore
    parameters: dict[str, float]
    held_out_predictions_s: tuple[float, ...]


def rebuild_cases(records: Sequence[IterationRecord]) -> list[IterationCase]:
    """The records' models, clusters and plans (SpecError naming the record that does not load)."""
    shared: dict[str, Any] = {}  # records naming one model, cluster or workload share its object (`predict_s`)
    cases = []
    for i, record in enumerate(records):
        model, cluster, plan = rebuild_record(record, f"iteration record {i}")
        workload = record.workload
        model = shared.setdefault(_key("model", record.model, workload.seq_len, workload.dtype), model)
        cluster = shared.setdefault(_key("cluster", record.cluster), cluster)
        workload = shared.setdefault(_key("workload", workload.model_dump(mode="json")), workload)
        cases.append(IterationCase(model, cluster, workload, plan, record.measured_s))
    return cases


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=str)


def predict_s(cases: Sequence[IterationCase], calibration: Calibration) -> np.ndarray:
    """Simulated seconds per iteration of each case under `calibration`."""
    sims: dict[tuple[int, int, int], Simulator] = {}  # cases of one model, cluster and workload share their costs
    out = []
    for c in cases:
        key = (id(c.model), id(c.cluster), id(c.workload))
        sim = sims.get(key)
        if sim is None:
            sim = sims[key] = Simulator(c.model, c.cluster, c.workload, calibration=calibration)
        out.append(sim.simulate(c.plan).iteration_time_s)
    return np.array(out)


def score(pred: np.ndarray, truth: np.ndarray) -> IterationScore:
    """MAPE and Kendall tau-b (None for fewer than two records or no variation)."""
    mape = float(np.mean(np.abs(pred / truth - 1.0))) if len(truth) else float("nan")
    return IterationScore(mape, kendall_tau(pred, truth))


def kendall_tau(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float | None:
    """Kendall's tau-b rank correlation of `a` and `b` (None where undefined)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    i, j = np.triu_indices(len(x), k=1)
    sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    n1, n2 = float(np.count_nonzero(sx)), float(np.count_nonzero(sy))
    if n1 == 0 or n2 == 0:
        return None
    return float(np.sum(sx * sy) / math.sqrt(n1 * n2))


def fit_key(cases: Sequence[IterationCase]) -> str:
    """The device key the shared parameters are filed under: the one device type all cases ran on,
    else `*` (so a calibration of one device type never changes plans on another)."""
    devices = {d.spec.name for c in cases for d in c.cluster.devices}
    return devices.pop() if len(devices) == 1 else ANY_DEVICE


def parameters(cases: Sequence[IterationCase]) -> list[Param]:
    """Every named parameter the cases could inform (unseen ones are dropped later by sensitivity)."""
    devices = sorted({d.spec.name for c in cases for d in c.cluster.devices})
    key = fit_key(cases)
    # the host's time per kernel: runs of eager runtimes (on a GPU a floor of each block, on a CPU added to it:
    # `compute.block_time`). A fused runtime issues one kernel per op: its blocks are rarely host-bound, and on
    # its records a floor only competes with the compute scale for the same short blocks. It starts from the
    # figure an eager run is costed with until fitted: the GPU default, or 0 where the runs are all on CPUs.
    eager = [d.spec.queued for c in cases if c.workload.eager for d in c.cluster.devices]
    host = Param(f"host_dispatch_s/{key}", False, start=None if any(eager) else 0.0)
    params = [Param(f"compute_scale/{d}", True) for d in devices]
    for scope in (INTRA, INTER):
        params += [Param(f"bandwidth_scale/{key}/{scope}", True, max_value=BANDWIDTH_SCALE_MAX),
                   Param(f"latency_s/{key}/{scope}", False)]
    return [*params, Param(f"micro_batch_overhead_s/{key}", False), Param(f"iteration_overhead_s/{key}", False),
            Param(f"p2p_overhead_s/{key}", False), Param(f"collective_overhead_s/{key}", False),
            Param(f"recompute_overhead_s/{key}", False), Param(f"optimizer_scale/{key}", True),
            # the fraction starts half way: fully hidden, the fetches' seconds move no prediction and go unfitted
            Param(f"zero3_comm_scale/{key}", True),
            Param(f"zero3_hidden_fraction/{key}", True, max_value=1.0, start=0.5),
            *([host] if eager else [])]


_SCALES = ("compute_scale", "optimizer_scale", "zero3_comm_scale", "zero3_hidden_fraction")


def read_values(base: Calibration, params: Sequence[Param], unit_s: float) -> np.ndarray:
    """The starting vector: log scales and overheads in units of `unit_s`, as in `base`."""
    out = []
    for p in params:
        head, _, key = p.name.partition("/")
        if head in ("bandwidth_scale", "latency_s"):
            link = base.link_scales.get(key, LinkScale())
            value = link.bandwidth_scale if head == "bandwidth_scale" else link.latency_s
        elif head == "host_dispatch_s":  # from the figure an eager run is costed with until fitted
            table = base.host_dispatch_s
            value = table.get(key, table.get(ANY_DEVICE, base.eager_host_dispatch_s if p.start is None else p.start))
        else:
            table = getattr(base, head)  # as the simulator reads it: the device's figure, else the any-device one
            unset = p.start if p.start is not None else 1.0 if head in _SCALES else 0.0
            value = table.get(key, table.get(ANY_DEVICE, unset))
        out.append(math.log(value) if p.log_scale else value / unit_s)
    return np.array(out, dtype=float)


def write_values(base: Calibration, params: Sequence[Param], x: np.ndarray, unit_s: float) -> Calibration:
    """`base` with the parameters set from vector `x` (inverse of `read_values`)."""
    tables: dict[str, dict[str, float]] = {}
    links = dict(base.link_scales)
    for p, v in zip(params, x, strict=True):
        value = math.exp(v) if p.log_scale else max(float(v), 0.0) * unit_s
        head, _, key = p.name.partition("/")
        if head in ("bandwidth_scale", "latency_s"):
            links[key] = links.get(key, LinkScale()).model_copy(update={head: value})
        else:
            tables.setdefault(head, dict(getattr(base, head)))[key] = value
    return base.model_copy(update={**tables, "link_scales": links})


def fit_parameters(cases: Sequence[IterationCase], base: Calibration, *, max_steps: int = 40,
                   ) -> tuple[Calibration, dict[str, float]]:
    """(`base` with the fitted parameters, {name: value} of those the records inform)."""
    if not cases:
        raise SpecError("iteration calibration needs at least one iteration record")
    truth = np.log([c.measured_s for c in cases])
    unit_s = float(np.median([c.measured_s for c in cases]))
    params = parameters(cases)
    x0 = read_values(base, params, unit_s)

    def residual(x: np.ndarray, active: list[int]) -> np.ndarray:
        full = x0.copy()
        full[active] = x
        return np.log(predict_s(cases, write_values(base, params, full, unit_s))) - truth

    every = list(range(len(params)))
    jac0 = _jacobian(lambda x: residual(x, every), x0, residual(x0, every), [p.upper for p in params])
    active = [k for k in every if np.max(np.abs(jac0[:, k])) > 1e-6]
    if not active:
        return base, {}
    x = _levenberg_marquardt(lambda v: residual(v, active), x0[active], x0[active],
                             [params[k] for k in active], max_steps)
    full = x0.copy()
    full[active] = x
    # only what the records inform: a parameter they cannot see keeps `base`'s figure, not the fit's start
    fitted = write_values(base, [params[k] for k in active], full[active], unit_s)
    values = {params[k].name: float(math.exp(full[k]) if params[k].log_scale else max(full[k], 0.0) * unit_s)
              for k in active}
    return fitted, values


def _jacobian(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray, fx: np.ndarray,
              upper: Sequence[float] | None = None) -> np.ndarray:
    """Forward differences, backward where a step would cross a parameter's `upper` bound (a fraction at 1 would
    otherwise probe only values the model clamps, and look insensitive)."""
    cols = []
    for k in range(len(x)):
        step = -1e-3 if upper is not None and x[k] + 1e-3 > upper[k] else 1e-3
        moved = x.copy()
        moved[k] += step
        cols.append((f(moved) - fx) / step)
    return np.column_stack(cols) if cols else np.zeros((len(fx), 0))


def _project(x: np.ndarray, params: Sequence[Param]) -> np.ndarray:
    out = x.copy()
    for k, p in enumerate(params):
        out[k] = min(max(out[k], SCALE_BOUNDS[0] if p.log_scale else 0.0), p.upper)
    return out


def _levenberg_marquardt(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray, prior: np.ndarray,
                         params: Sequence[Param], max_steps: int) -> np.ndarray:
    """Projected LM on the Huber loss of f(x) plus PRIOR * |x - prior|^2 (IRLS weights per step)."""

    def loss(r: np.ndarray, v: np.ndarray) -> float:
        a = np.abs(r)
        huber = np.where(a <= HUBER_DELTA, 0.5 * a**2, HUBER_DELTA * (a - 0.5 * HUBER_DELTA))
        return float(huber.sum() + 0.5 * PRIOR * np.sum((v - prior) ** 2))

    r = f(x)
    current, damping = loss(r, x), 1e-2
    for _ in range(max_steps):
        w = np.minimum(1.0, HUBER_DELTA / np.maximum(np.abs(r), 1e-12))
        jac = _jacobian(f, x, r, [p.upper for p in params])
        normal = jac.T @ (w[:, None] * jac) + PRIOR * np.eye(len(x))
        gradient = jac.T @ (w * r) + PRIOR * (x - prior)
        improved = False
        for _ in range(8):
            step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-9), -gradient)
            trial = _project(x + step, params)
            r_trial = f(trial)
            trial_loss = loss(r_trial, trial)
            if trial_loss < current:
                improved = current - trial_loss > 1e-7 * max(current, 1e-12)
                x, r, current, damping = trial, r_trial, trial_loss, max(damping / 3, 1e-7)
                break
            damping *= 4
        if not improved:
            break
    return x


def cross_validate(cases: Sequence[IterationCase], base: Calibration, *, folds: int | None = None,
                   ) -> tuple[Calibration, IterationFitReport]:
    """(the fit on all records, the k-fold held-out scores of fitting on top of `base`)."""
    n = len(cases)
    truth = np.array([c.measured_s for c in cases])
    before = score(predict_s(cases, base), truth)
    k = min(folds or MAX_FOLDS, n)
    held = np.zeros(n)
    if k >= 2:
        for fold in range(k):
            test = [i for i in range(n) if i % k == fold]
            train = [cases[i] for i in range(n) if i % k != fold]
            fitted, _ = fit_parameters(train, base)
            held[test] = predict_s([cases[i] for i in test], fitted)
    fitted, values = fit_parameters(cases, base)
    after = score(held, truth) if k >= 2 else IterationScore(float("nan"), None)
    return fitted, IterationFitReport(n, k if k >= 2 else 0, before, after, values, tuple(float(v) for v in held))
