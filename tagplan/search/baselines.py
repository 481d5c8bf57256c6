"""The baselines a practitioner would run, each computed as well as we can, judged by the simulator.

- `megatron_grid`: the best uniform Megatron-LM configuration over its whole grid: tp in 1, 2, 4, 8
  inside a node, context parallelism cp in 1, 2, 4, 8 from 8k-token sequences (`context_degrees`),
  every pipeline depth and data-parallel degree that divide the devices, every micro-batch size that
  divides a replica's share, recompute off and on, ZeRO 0 and 1 (Megatron's distributed optimizer),
  blocks split evenly with the embedding on the first stage and the head on the last, 1F1B, and
  interleaved 1F1B with every virtual-stage count vp >= 2 that Megatron accepts (the blocks split
  evenly into pp x vp chunks, a micro-batch count divisible by pp); nodes in the cluster's order and
  reversed (which end of the pipeline a node type takes matters on mixed clusters).
- `data_parallel_best`: every device a replica (where the batch does not split into equal whole shares over
  every device, the fastest as many as it does), every micro-batch size, ZeRO 0-3, recompute off/on.
- `fastest_nodes`: the best of both on the nodes of the fastest GPU type alone (mixed clusters),
  the other nodes idle.

Every plan gives each replica whole samples. A configuration's memory only grows with its
micro-batch size, so the walk up the sizes stops at the first that does not fit, which it finds by
counting the plan's memory alone (`Simulator.fits`: the simulator's own memory terms, without stage
times or the event simulation), so a configuration that fits at no size costs one memory count and
the grid picks the same plan as if it had simulated everything. The planner evaluates these first
and keeps them in its pool, so it never returns a plan slower than any of them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from tagplan.cost.report import Report
from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Plan, Schedule, Stage, context_split_whole
from tagplan.search.recompute import fewest_recomputed
from tagplan.search.result import Baseline, Candidate
from tagplan.search.space import CONTEXT_DEGREES, LONG_CONTEXT_TOKENS, divisors

Judge = Callable[[Plan, str], Candidate]
MAX_TP = 8  # Megatron keeps tensor parallelism inside a node, up to 8 GPUs


@dataclass(frozen=True)
class GridPoint:
    """One uniform configuration: degrees, micro-batch size (samples per replica), memory options."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    recompute: bool
    zero: int
    order: str  # "cluster order" or "reversed"
    chunks: int = 1  # virtual pipeline stages per device (Megatron's vp): 1 is 1F1B, more interleaved 1F1B
    cp: int = 1  # context-parallel degree (Megatron's --context-parallel-size)

    def describe(self, plan: Plan) -> str:
        """The configuration as a practitioner writes it (`plan`: this point's plan, for its micro-batch count
        and how many layers per stage it recomputes)."""
        vp = f" vp={self.chunks}" if self.chunks > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        counts = {s.recompute_layers for s in plan.stages if s.recompute}
        recompute = ("off" if not self.recompute else "on" if counts == {None}
                     else f"{max(c for c in counts if c is not None)} layers per stage")
        return (f"tp={self.tp}{cp} pp={self.pp}{vp} dp={self.dp}, micro-batch size {self.micro_batch_size} "
                f"({plan.micro_batches} micro-batches), ZeRO-{self.zero}, recompute {recompute}, "
                f"nodes in {self.order}")


def run_baselines(sim: Simulator, judge: Judge, *, deadline: float | None = None,
                  complete: bool = False) -> dict[str, Baseline]:
    """Every practitioner baseline of this problem, each the best of its family (or why there is none).

    `complete=True` walks every micro-batch size that fits and every virtual-stage count instead of
    stopping past a series' fastest (the benchmark's reference; the planner's seeds use the quicker walk).
    """
    return {name: family(judge) for name, family in baseline_families(sim, deadline=deadline, complete=complete)}


BaselineFamily = Callable[[Judge], Baseline]


def baseline_families(sim: Simulator, *, deadline: float | None = None,
                      complete: bool = False) -> list[tuple[str, BaselineFamily]]:
    """The baselines as independent computations, in the order `run_baselines` runs them: each judges its plans
    with the judge it is given and shares nothing with the others (the planner runs them in other processes
    beside its search: `search.background`)."""
    nodes = tuple(range(len(sim.cluster.nodes)))
    fastest = fastest_type_nodes(sim)

    def grid(judge: Judge) -> Baseline:
        return megatron_grid(sim, judge, nodes, deadline=deadline, complete=complete)

    def data_parallel(judge: Judge) -> Baseline:
        return data_parallel_best(sim, judge, nodes, complete=complete)

    def fastest_nodes(judge: Judge) -> Baseline:
        if fastest == nodes:
            return Baseline("fastest_nodes", None, "the cluster has one GPU type")
        found = [b for b in (megatron_grid(sim, judge, fastest, deadline=deadline, complete=complete),
                             data_parallel_best(sim, judge, fastest, complete=complete)) if b.candidate is not None]
        best = min(found, key=_time, default=None)
        type_name = sim.cluster.nodes[fastest[0]].device.name
        if best is None:
            return Baseline("fastest_nodes", None, f"nothing fits on the {type_name} nodes alone")
        return Baseline("fastest_nodes", best.candidate, config=f"{best.config}; only the {len(fastest)} "
                                                                  f"{type_name} nodes")

    return [("megatron_grid", grid), ("data_parallel", data_parallel), ("fastest_nodes", fastest_nodes)]


def fastest_type_nodes(sim: Simulator) -> tuple[int, ...]:
    """The nodes of the GPU type with the highest dense peak in the workload's dtype."""
    dtype = sim.workload.dtype
    best = max(sim.cluster.nodes, key=lambda n: n.device.sustained_peak_flops(dtype)).device.name
    return tuple(i for i, n in enumerate(sim.cluster.nodes) if n.device.name == best)


def megatron_grid(sim: Simulator, judge: Judge, nodes: Sequence[int], *,
                  deadline: float | None = None, complete: bool = False) -> Baseline:
    """The fastest uniform Megatron configuration on `nodes` (module docstring).

    1F1B first, every configuration; then interleaving, for the configurations with a pipeline whose
    1F1B plan fits, most promising first. With `complete`, every count of every configuration.
    Otherwise a count vp is skipped when it looks unable to beat the best found: at a given
    micro-batch size, interleaving vp ways divides the 1F1B bubble by vp at most, can hide the
    gradient reduction behind the backward, and makes nothing else faster, so it is no faster than
    the 1F1B time less (1 - 1/vp) of its bubble and its data-parallel time; the floor is the least
    of that over the sizes the 1F1B walk simulated (a heuristic: a larger size it did not reach may
    go lower). The counts are walked down from the largest (the least bubble) until one is slower
    than the one before (past the optimum, fewer chunks save less point-to-point time than the
    bubble they add) or fits at no size (the first device holds pp + (pp - 1) / vp stages'
    activations, more as vp falls). A configuration whose 1F1B plan fits at no size is not
    interleaved (1F1B holds pp stages'). Phase 2 runs only on time left after phase 1."""
    cluster = sim.cluster
    gpus = {cluster.nodes[n].gpus for n in nodes}
    tps = [t for t in (1, 2, 4, 8) if t <= min(min(gpus), MAX_TP) and all(g % t == 0 for g in gpus)]
    orders = {"cluster order": list(nodes)}
    if len({cluster.nodes[n].device.name for n in nodes}) > 1:
        orders["reversed"] = list(reversed(nodes))
    best: tuple[Candidate, str] | None = None
    interleavable: list[tuple[float, list[Report], Iterator[tuple[int, Iterator[tuple[GridPoint, Plan]]]]]] = []

    def keep(found: tuple[Candidate, str] | None) -> None:
        nonlocal best
        if found is not None and (best is None or _faster(found[0], best[0])):
            best = found

    def best_s() -> float:
        return best[0].report.iteration_time_s if best is not None else math.inf

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    for order_name, order in orders.items():
        devices = tuple(d for n in order for d in cluster.node_devices(n))
        for tp, cp in ((t, c) for t in tps for c in context_degrees(sim, len(devices) // t, t)):
            for pp in divisors(len(devices) // (tp * cp)):
                for by_chunks in _configurations(sim, devices, tp, pp, order_name, cp):
                    fitted: list[Report] = []
                    found = _walk(sim, next(by_chunks)[1], judge, "megatron_grid", complete=complete, fitted=fitted)
                    keep(found)
                    if complete:
                        for _, series in by_chunks:
                            keep(_walk(sim, series, judge, "megatron_grid", complete=True))
                    elif fitted and pp > 1:
                        floor_s = _interleaved_floor_s(fitted, _chunk_counts(sim, pp)[-1])
                        interleavable.append((floor_s, fitted, by_chunks))
                if out_of_time():
                    return _grid_result(best, "stopped at its time limit before any configuration fit")
    # phase 2 (quick walk): interleave the most promising first, while time is left
    for floor_s, fitted, by_chunks in sorted(interleavable, key=lambda item: item[0]):
        if floor_s >= best_s():
            break
        previous_s = math.inf
        for chunks, series in reversed(list(by_chunks)):  # down the counts until one is slower than the last
            if out_of_time():
                return _grid_result(best, "stopped at its time limit before any configuration fit")
            if _interleaved_floor_s(fitted, chunks) >= best_s():
                continue
            found = _walk(sim, series, judge, "megatron_grid", complete=False)
            if found is None:  # a smaller count holds more activations: none of them fits
                break
            if found[0].report.iteration_time_s > previous_s:  # past the optimum: the bubble outgrows the p2p saved
                break
            previous_s = found[0].report.iteration_time_s
            keep(found)
    return _grid_result(best, "no uniform configuration fits in memory or gives every replica a whole sample")


def _walk(sim: Simulator, series: Iterable[tuple[GridPoint, Plan]], judge: Judge, source: str, *,
          complete: bool, fitted: list[Report] | None = None) -> tuple[Candidate, str] | None:
    """The fastest configuration of a series ordered by micro-batch size: up the sizes until one does
    not fit (memory only grows with the size) or, unless `complete`, is slower than the one before
    (past the optimum: a larger micro-batch trades kernel efficiency for pipeline bubble). A size
    that does not fit is found by its memory alone (`Simulator.fits`) and never timed, so a series
    that fits at no size costs one memory count. `fitted` collects the report of every size
    simulated that fits."""
    best: tuple[Candidate, str] | None = None
    previous = math.inf
    for point, full in series:
        if not sim.fits(full):  # memory alone decides it: no need to time a plan the walk stops at
            break
        plan = fewest_recomputed(sim, full)  # recompute only as many layers as memory needs
        cand = judge(plan, source)
        if fitted is not None and cand.report.fits:
            fitted.append(cand.report)
        if not cand.report.fits or (not complete and cand.report.iteration_time_s > previous):
            break
        previous = cand.report.iteration_time_s
        if best is None or _faster(cand, best[0]):
            best = (cand, point.describe(plan))
    return best


def _interleaved_floor_s(one_f_one_b: Sequence[Report], chunks: int) -> float:
    """The least time interleaving `chunks` ways could reach from these 1F1B reports of one
    configuration at several micro-batch sizes (`megatron_grid`): at each size, the 1F1B time less
    (1 - 1/chunks) of its bubble and its data-parallel time."""
    return min(r.iteration_time_s - r.breakdown.bubble * (1.0 - 1.0 / chunks) - r.breakdown.dp_comm
               for r in one_f_one_b)


def _faster(a: Candidate, b: Candidate) -> bool:
    return a.report.iteration_time_s < b.report.iteration_time_s


def _grid_result(best: tuple[Candidate, str] | None, reason: str) -> Baseline:
    if best is None:
        return Baseline("megatron_grid", None, reason)
    return Baseline("megatron_grid", best[0], config=best[1])


def _configurations(sim: Simulator, devices: tuple[int, ...], tp: int, pp: int, order: str,
                    cp: int = 1) -> Iterator[Iterator[tuple[int, Iterator[tuple[GridPoint, Plan]]]]]:
    """Per memory option (recompute, ZeRO), per virtual-stage count (1 first, then ascending), the
    count and its (point, plan) series in ascending micro-batch size (each plan built when a walk
    gets to it)."""
    layers = len(sim.model.layers)
    blocks = layers - 2 if layers > 2 else layers
    batch = sim.workload.global_batch
    dp = len(devices) // (tp * pp * cp)
    if pp > blocks or batch % dp:
        return
    for recompute in (False, True):
        for zero in ((0, 1) if dp * cp > 1 else (0,)):
            yield _by_chunks(sim, devices, GridPoint(tp, pp, dp, 0, recompute, zero, order, cp=cp),
                             _chunk_counts(sim, pp))


def context_degrees(sim: Simulator, devices: int, tp: int = 1) -> list[int]:
    """The context-parallel degrees the grid tries on `devices` GPUs per tensor-parallel rank at `tp`: 1, and
    from `LONG_CONTEXT_TOKENS` every power of two up to 8 that divides them, whose 2 * cp divides the sequence
    (Megatron's load-balanced split) and whose share of the sequence tp divides (sequence parallelism)."""
    seq = sim.workload.seq_len
    if seq < LONG_CONTEXT_TOKENS:
        return [1]
    return [cp for cp in CONTEXT_DEGREES if devices % cp == 0 and context_split_whole(seq, cp, tp)]


def _chunk_counts(sim: Simulator, pp: int) -> list[int]:
    """1 (1F1B), then every virtual-stage count Megatron accepts for `pp` stages, ascending: those
    dividing the blocks per stage."""
    layers = len(sim.model.layers)
    blocks = layers - 2 if layers > 2 else layers
    return [1] + ([v for v in divisors(blocks // pp) if v > 1] if pp > 1 and blocks % pp == 0 else [])


def _by_chunks(sim: Simulator, devices: tuple[int, ...], point: GridPoint,
               chunk_counts: list[int]) -> Iterator[tuple[int, Iterator[tuple[GridPoint, Plan]]]]:
    """`point`'s series, one per virtual-stage count (a function, so that a walk deferred past the
    caller's loop still sees this point's memory option)."""
    for chunks in chunk_counts:
        yield chunks, _series(sim, devices, replace(point, chunks=chunks))


def _series(sim: Simulator, devices: tuple[int, ...], point: GridPoint) -> Iterator[tuple[GridPoint, Plan]]:
    """`point`'s plans in ascending micro-batch size: every size that divides a replica's share
    (interleaved: whose micro-batch count pp divides, as Megatron requires)."""
    layers, batch, pp, chunks = len(sim.model.layers), sim.workload.global_batch, point.pp, point.chunks
    per_stage = len(devices) // pp
    bounds = even_bounds(layers, pp * chunks)
    schedule = Schedule.ONE_F_ONE_B if chunks == 1 else Schedule.INTERLEAVED_1F1B
    # virtual stage k = c * pp + s runs on device group s (Megatron's round-robin layout)
    stages = tuple(Stage(layers=(bounds[k], bounds[k + 1]),
                         devices=devices[(k % pp) * per_stage:(k % pp + 1) * per_stage], dp=point.dp,
                         cp=point.cp, tp=point.tp, zero=point.zero, recompute=point.recompute)
                   for k in range(pp * chunks))
    for size in divisors(batch // point.dp):
        micro_batches = batch // (point.dp * size)
        if chunks == 1 or micro_batches % pp == 0:
            yield replace(point, micro_batch_size=size), Plan(micro_batches=micro_batches, schedule=schedule,
                                                              stages=stages)


def even_bounds(layers: int, parts: int) -> list[int]:
    """Boundaries of `parts` consecutive stages splitting the blocks evenly, the embedding on the
    first part, the head on the last."""
    if layers <= 2:
        return [layers * s // parts for s in range(parts + 1)]
    blocks = layers - 2
    bounds = [1 + blocks * s // parts for s in range(parts + 1)]
    bounds[0], bounds[-1] = 0, layers
    return bounds


def data_parallel_best(sim: Simulator, judge: Judge, nodes: Sequence[int], *, complete: bool = False) -> Baseline:
    """The fastest pure data-parallel plan on `nodes`: every device a whole-model replica, each with the same whole
    number of samples. Where the global batch does not split so over all of them, as a practitioner runs it: on
    as many devices as it does split over (the fastest of them; the rest idle)."""
    on = tuple(d for n in nodes for d in sim.cluster.node_devices(n))
    batch = sim.workload.global_batch
    n = max(d for d in divisors(batch) if d <= len(on))
    dtype = sim.workload.dtype
    fastest = sorted(on, key=lambda d: -sim.cluster.devices[d].spec.sustained_peak_flops(dtype))[:n]
    devices = tuple(sorted(fastest))
    idle = f", on the {n} fastest of the {len(on)} devices (the global batch {batch} splits evenly over no more)" \
        if n < len(on) else ""
    best: tuple[Candidate, str] | None = None
    for recompute in (False, True):
        for zero in range(4) if n > 1 else (0,):
            stage = Stage(layers=(0, len(sim.model.layers)), devices=devices, dp=n, tp=1, zero=zero,
                          recompute=recompute)
            series = [(GridPoint(1, 1, n, size, recompute, zero, "cluster order"),
                       Plan(micro_batches=batch // (n * size), schedule=Schedule.ONE_F_ONE_B, stages=(stage,)))
                      for size in divisors(batch // n)]
            found = _walk(sim, series, judge, "data_parallel", complete=complete)
            if found is not None and (best is None or _faster(found[0], best[0])):
                best = found
    if best is None:
        return Baseline("data_parallel", None, "a whole-model replica does not fit in memory at any ZeRO stage")
    return Baseline("data_parallel", best[0], config=best[1] + idle)


def _time(b: Baseline) -> float:
    return b.candidate.report.iteration_time_s if b.candidate is not None else math.inf
