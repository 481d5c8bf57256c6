"""Planner benchmark against what practitioners do by hand, all judged by the simulator.

Tables (bench/results/planner.json, docs/PLANNER_RESULTS.md):
1. Suite: the planner at its defaults (400 evaluations, 30 s) against the reference baselines, computed
   apart with no time limit and every micro-batch size that fits: the best uniform Megatron grid
   (every tp/pp/dp/micro-batch/recompute/ZeRO-0-1, 1F1B and interleaved with every virtual-stage count,
   nodes in either order), the best data-parallel plan,
   and the best plan on the fastest GPU type's nodes alone. "vs best" divides the best of those by the
   planner's time; every plan gives each replica whole samples.
2. Exhaustive gaps: small cases (two- and three-node mixes) where the whole decision process is
   enumerated apart from the search (its plans never join the planner's pool); and the same on
   `RANDOM_EXHAUSTIVE_CASES` problems drawn at random (`random_cases`, a fixed seed): cases nobody chose.
3. Quality against budget: 50 / 200 / 400 / 1000 / 5000 evaluations (a wall-clock cap per run); the
   search's evaluations form one sequence a budget only cuts, so each column is at least as fast.
4. Guidance: wall-clock seconds of the search (baselines excluded) until its best plan is within 1% of
   the best known, uniform prior against the GNN prior (the median of 3 runs to each side's hit).

Run: `.venv/bin/python bench/planner.py [--quick]` (about 30 minutes on 2 cores; --quick: a smoke run).
`--only SECTION [--cases TEXT]` runs one table (suite, exhaustive, budget or guidance) for the cases
whose name contains TEXT and prints its rows without writing any file. `--markdown` rewrites
docs/PLANNER_RESULTS.md from bench/results/planner.json; `--update-guidance` reruns the guidance table
alone into it (about 6 minutes); `--update-suite`, `--update-exhaustive` and `--update-timing` the others.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tagplan.cost.bounds import lower_bound_s
from tagplan.cost.simulator import Simulator
from tagplan.export.capability import TARGETS, exportable, reduce_overlap, runtime_workload, verdicts
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model, parse_model_spec
from tagplan.gnn.scorer import GNNPrior
from tagplan.ir.workload import Workload
from tagplan.search.baselines import run_baselines
from tagplan.search.mcts import mcts, uniform_prior
from tagplan.search.planner import SimulatorEvaluator, plan
from tagplan.search.problem import PlanProblem
from tagplan.search.rebalance import rebalance_seeds
from tagplan.search.result import Baseline
from tagplan.search.space import PlanSpace, PlanState
from tagplan.training.registry import Registry, class_pays, gnn_prior_factory

# name, model, cluster, global batch, seq, heterogeneous
CASES = [
    ("1.3B on 1 DGX-A100", "gpt3-1.3b", "dgx-a100-80gb", 64, 2048, False),
    ("13B on 4 DGX-A100", "gpt3-13b", "dgx-a100-80gb:nodes=4", 256, 2048, False),
    ("175B on 16 DGX-A100", "gpt3-175b", "dgx-a100-80gb:nodes=16", 512, 2048, False),
    ("Llama-2-70B on 16 DGX-A100", "llama2-70b", "dgx-a100-80gb:nodes=16", 256, 4096, False),
    ("13B on A100 + V100 nodes", "gpt3-13b", "dgx-a100-80gb:nodes=2+p3.16xlarge:nodes=2", 128, 2048, True),
    ("Llama-2-70B on H100 + A100", "llama2-70b", "dgx-h100:nodes=4+dgx-a100-80gb:nodes=4", 256, 4096, True),
    ("1.3B on p3.8xlarge x3 + g4dn", "gpt3-1.3b", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", 32, 1024, True),
    ("T5-3B on p3.8xlarge x3 + g4dn", "t5-3b", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", 64, 512, True),
    ("BERT-large on 8- and 4-GPU nodes", "bert-large", "dgx-a100-80gb+p3.8xlarge", 256, 512, True),
    ("Mixtral-8x7B on H100 + A100", "mixtral-8x7b", "dgx-h100:nodes=2+dgx-a100-80gb:nodes=2", 64, 4096, True),
    ("13B on 4 DGX-A100 over 25 Gb/s", "gpt3-13b", "dgx-a100-80gb:nodes=4:nics=1:nic_speed_Gbps=25", 128, 2048,
     False),
    ("13B on A100 + V100 over 25 Gb/s", "gpt3-13b",
     "dgx-a100-80gb:nodes=2:nics=1:nic_speed_Gbps=25+p3.16xlarge:nodes=2", 128, 2048, True),
    ("1.3B on rtx4090x4 + g4dn", "gpt3-1.3b", "rtx4090x4:nodes=2+g4dn.12xlarge:nodes=2", 32, 1024, True),
    ("175B on 512 A100 + 512 V100", "gpt3-175b", "dgx-a100-80gb:nodes=64+p3.16xlarge:nodes=64", 1536, 2048, True),
    ("175B on 128 DGX-A100 (1024 GPUs)", "gpt3-175b", "dgx-a100-80gb:nodes=128", 1536, 2048, False),
    ("Llama-3-8B at 32k tokens on 2 DGX-H100", "llama3-8b", "dgx-h100:nodes=2", 16, 32768, False),
    # memory-bound: 13B's training state fills 82% of 8 x 24 GB + 4 x 16 GB; no uniform layout fits
    ("13B on rtx4090x4 x2 + g4dn (memory-bound)", "gpt3-13b", "rtx4090x4:nodes=2+g4dn.12xlarge", 32, 2048, True),
]
BASELINES = ("megatron_grid", "split_grid", "data_parallel", "fastest_nodes")
SPLIT_GRID_SEEDS = 64
"""Grid configurations the `split_grid` baseline re-splits by stage speed (the planner's own seeds take 24)."""
# small enough to enumerate: (name, model, cluster, batch, seq)
EXHAUSTIVE = [
    ("GPT 4L on V100 + T4 nodes", "gpt?layers=4&hidden=1024&heads=16&vocab=5000", "p3.8xlarge+g4dn.12xlarge", 16, 512),
    ("Llama 4L on A100 + T4 nodes", "llama?layers=4&hidden=1024&heads=16&vocab=5000", "dgx-a100-80gb+g4dn.12xlarge",
     16, 512),
    ("GPT 6L on 2 V100 nodes", "gpt?layers=6&hidden=1024&heads=16&vocab=5000", "p3.8xlarge:nodes=2", 8, 512),
    ("GPT 6L on A100 + V100 + T4", "gpt?layers=6&hidden=1024&heads=16&vocab=5000",
     "dgx-a100-80gb+p3.8xlarge+g4dn.12xlarge", 16, 512),
    ("GPT 6L on 4090 + V100 + T4", "gpt?layers=6&hidden=2048&heads=16&vocab=5000",
     "rtx4090x4+p3.8xlarge+g4dn.12xlarge", 16, 512),
    ("Llama 4L on H100 + A100 + V100", "llama?layers=4&hidden=2048&heads=16&vocab=5000",
     "dgx-h100+dgx-a100-80gb+p3.16xlarge", 16, 1024),
    ("GPT 4L wide on H100 + A100 + A100-40GB", "gpt?layers=4&hidden=4096&heads=32&vocab=8000",
     "dgx-h100+dgx-a100-80gb+dgx-a100-40gb", 16, 2048),
    ("Llama 4L on B200 + H100 + A100", "llama?layers=4&hidden=3072&heads=24&vocab=8000",
     "dgx-b200+dgx-h100+dgx-a100-80gb", 24, 2048),
    ("GPT 8L, 8B, on 4090 + T4 (memory-bound)", "gpt?layers=8&hidden=9216&heads=72&vocab=8000",
     "rtx4090x4+g4dn.12xlarge", 16, 1024),
]
RANDOM_EXHAUSTIVE_SEED = 7
RANDOM_EXHAUSTIVE_CASES = 10
RANDOM_EXHAUSTIVE_LIMIT = 120_000
"""Plans the random cases enumerate at most (a larger space is reported as such, not enumerated)."""
BUDGETS = (50, 200, 400, 1000, 5000)
BUDGET_CASES = (4, 5, 6, 12)  # heterogeneous suite rows for the budget curve
GUIDANCE_CASES = (4, 6, 7, 12, 1, 0, 5, 8, 10, 11, 2, 3, 9, 13, 14)  # the first five chose GNNPrior's settings
GUIDANCE_EVALUATIONS = 4000
GUIDANCE_REPEATS = 3  # runs timed to each side's hit; the median is reported
GUIDANCE_CAP_S = 20.0  # each run stops at its evaluations or this wall-clock, whichever comes first


def _instance(model: str, cluster: str, batch: int, seq: int) -> tuple[Any, Any, Workload]:
    m, c = load_model(model, seq_len=seq), load_cluster(cluster)
    return m, c, Workload(global_batch=batch, seq_len=m.seq_len)


def suite_row(case: tuple[str, str, str, int, int, bool], *, evaluations: int, budget_s: float) -> dict[str, Any]:
    """The planner at its defaults against each baseline (times in seconds per iteration)."""
    name, model, cluster, batch, seq, het = case
    m, c, w = _instance(model, cluster, batch, seq)
    r = plan(PlanProblem(m, c, w, max_evaluations=evaluations, budget_s=budget_s))
    # the reference baselines: every micro-batch size that fits, no time limit (the planner's own walk stops early)
    sim = Simulator(m, c, w)
    judge = SimulatorEvaluator(PlanSpace(sim))
    reference = run_baselines(sim, judge.candidate, complete=True)
    reference["split_grid"] = split_grid(sim, judge)
    row: dict[str, Any] = {"case": name, "model": model, "cluster": cluster, "batch": batch, "seq": seq,
                           "heterogeneous": het, "best_s": r.best.report.iteration_time_s, "source": r.best.source,
                           "devices": c.num_devices, "idle_devices": len(r.idle_devices), "wall_s": r.search.wall_s,
                           "evaluations": r.search.evaluations, "baseline_evaluations": r.search.baseline_evaluations,
                           "local_evaluations": r.search.local_evaluations}
    for key in BASELINES:
        b = reference[key]
        row[f"{key}_s"] = b.candidate.report.iteration_time_s if b.candidate else None
        row[f"{key}_config"] = b.config or b.reason
    known = [row[f"{k}_s"] for k in BASELINES if row[f"{k}_s"] is not None]
    row["best_baseline_s"] = min(known) if known else None
    row["vs_best"] = row["best_baseline_s"] / row["best_s"] if known else None
    spec = parse_model_spec(model)
    said = verdicts(r.best.plan, m, w, spec=spec, cluster=c)
    row["runs_under"] = [fmt for fmt, reason in said.items() if reason is None]
    row["refusals"] = {fmt: " ".join(reason.split()) for fmt, reason in said.items() if reason is not None}
    row.update(as_run(m, c, w, spec, evaluations=evaluations, budget_s=budget_s))
    return row


MEGATRON_TP_OVERLAP = "megatron --tp-comm-overlap"


def split_grid(sim: Simulator, judge: SimulatorEvaluator, admissible: Any = None) -> Baseline:
    """The grid's configurations (both node orders, and the fastest nodes alone) with their layers split by
    stage speed (`search.rebalance`), the best that fits (and that `admissible` accepts): what a practitioner
    who balances a Megatron pipeline by hand over unequal GPUs reaches (Megatron-Core takes an uneven split as
    its pipeline layout). Judged after `run_baselines` walked the grid into `judge`."""
    grid = [c for c in judge.candidates.values() if c.source == "megatron_grid"]
    split = [c for c in rebalance_seeds(sim, judge.candidate, grid, limit=SPLIT_GRID_SEEDS)
             if c.report.fits and (admissible is None or admissible(c.plan) is None)]
    best = min(split, key=lambda c: c.report.iteration_time_s, default=None)
    if best is None:
        return Baseline("split_grid", None, "no grid configuration gains from a split by stage speed")
    stages = best.plan.stages
    layout = ", ".join(f"{s.layers[1] - s.layers[0]}" for s in stages[:8]) + (", ..." if len(stages) > 8 else "")
    return Baseline("split_grid", best, config=f"{len(stages)} (virtual) stages, {best.plan.schedule}, "
                    f"{best.plan.micro_batches} micro-batches, layers per stage {layout}")


def as_run(m: Any, c: Any, w: Workload, spec: Any, *, evaluations: int, budget_s: float) -> dict[str, Any]:
    """Plans as an export format's runtime runs them: per format (`export.capability.TARGETS`), the
    planner's best plan that format runs and the best baseline plan it runs, both costed with the
    workload and gradient-reduction rule of its runtime (`runtime_workload`, `reduce_overlap`: what
    `plan --exportable FORMAT` does); then the best of each over the formats and their ratio. Megatron
    runs twice: as is, and with `--tp-comm-overlap` (`plan --exportable megatron --tp-comm-overlap`),
    which a practitioner turns on where Transformer Engine's userbuffers run (`megatron.tp_overlap_refusal`:
    tensor-parallel groups inside an NVLink/NVSwitch node of sm80+ GPUs); every plan on either side is
    admitted only where its format runs it."""
    per_format: dict[str, dict[str, Any]] = {}
    for label in (*TARGETS, MEGATRON_TP_OVERLAP):
        fmt, tp_overlap = ("megatron", True) if label == MEGATRON_TP_OVERLAP else (label, False)
        wf = runtime_workload(fmt, w.model_copy(update={"tp_comm_overlap": tp_overlap}), spec)
        overlap = reduce_overlap(fmt, wf, c)

        def admissible(p: Any, fmt: str = fmt, tp_overlap: bool = tp_overlap) -> str | None:
            return exportable(p, fmt, m, global_batch=w.global_batch, spec=spec, cluster=c, tp_comm_overlap=tp_overlap,
                              dtype=w.dtype)

        r = plan(PlanProblem(m, c, wf, max_evaluations=evaluations, budget_s=budget_s), admissible=admissible,
                 reduce_overlap=overlap)
        ok = r.best.report.fits and admissible(r.best.plan) is None
        sim = Simulator(m, c, wf, reduce_overlap=overlap)
        judge = SimulatorEvaluator(PlanSpace(sim))
        found = run_baselines(sim, judge.candidate, complete=True)
        found["split_grid"] = split_grid(sim, judge, admissible)
        runs = {k: b for k, b in found.items() if b.candidate is not None and admissible(b.candidate.plan) is None}
        base = min(runs.items(), key=lambda kv: kv[1].candidate.report.iteration_time_s, default=None)  # type: ignore[union-attr]
        per_format[label] = {"planner_s": r.best.report.iteration_time_s if ok else None,
                           "baseline_s": base[1].candidate.report.iteration_time_s if base else None,  # type: ignore[union-attr]
                           "baseline": f"{base[0]}: {base[1].config}" if base else None}
    planners = [(v["planner_s"], f) for f, v in per_format.items() if v["planner_s"] is not None]
    bases = [(v["baseline_s"], f) for f, v in per_format.items() if v["baseline_s"] is not None]
    best_p, best_b = min(planners, default=None), min(bases, default=None)
    return {"as_run": per_format, "runnable_s": best_p[0] if best_p else None,
            "runnable_format": best_p[1] if best_p else None,
            "runnable_baseline_s": best_b[0] if best_b else None,
            "runnable_baseline_format": best_b[1] if best_b else None,
            "runnable_vs_best": best_b[0] / best_p[0] if best_p and best_b else None}


TIMED_CASES = ("175B on 512 A100 + 512 V100", "175B on 128 DGX-A100 (1024 GPUs)")  # the wall-clock target's
TIMED_REPEATS = 5
TIMED_WORKERS = (1, 2)  # one process, and the baselines in a second one beside the search (`tagplan plan`'s default)


def cold_walls(evaluations: int, budget_s: float, repeats: int = TIMED_REPEATS) -> dict[str, dict[str, list[float]]]:
    """The planner's search wall-clock on each of `TIMED_CASES` with each of `TIMED_WORKERS` processes, `repeats`
    times, each in a fresh process (its caches cold, as a user's first `tagplan plan` is), the worker counts
    alternating: one suite run times a case once, and this VM's speed moves by tens of percent from minute to
    minute, so the target is judged on the median of these."""
    out: dict[str, dict[str, list[float]]] = {}
    for name in TIMED_CASES:
        _, model, cluster, batch, seq, _ = next(c for c in CASES if c[0] == name)
        out[name] = {str(w): [] for w in TIMED_WORKERS}
        for _ in range(repeats):
            for workers in TIMED_WORKERS:
                code = ("import json; from tagplan.frontends.cluster_spec import load_cluster; "
                        "from tagplan.frontends.model_spec import load_model; "
                        "from tagplan.ir.workload import Workload; "
                        "from tagplan.search.planner import plan; from tagplan.search.problem import PlanProblem; "
                        f"m = load_model({model!r}, seq_len={seq}); c = load_cluster({cluster!r}); "
                        f"r = plan(PlanProblem(m, c, Workload(global_batch={batch}, seq_len=m.seq_len), "
                        f"max_evaluations={evaluations}, budget_s={budget_s}, workers={workers})); "
                        "print(json.dumps(r.search.wall_s))")
                run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                out[name][str(workers)].append(float(run.stdout.strip().splitlines()[-1]))
    return out


def exhaustive_row(case: tuple[str, str, str, int, int], limit: int = 200_000) -> dict[str, Any]:
    """The planner at its defaults against the enumerated optimum of its own decision process (up to `limit`
    plans)."""
    name, model, cluster, batch, seq = case
    m, c, w = _instance(model, cluster, batch, seq)
    r = plan(PlanProblem(m, c, w, exhaustive_limit=limit, budget_s=600))
    ex = r.baselines["exhaustive"]
    opt = ex.candidate.report.iteration_time_s if ex.candidate else None
    return {"case": name, "best_s": r.best.report.iteration_time_s, "fits": r.best.report.fits, "exhaustive_s": opt,
            "space": ex.config or ex.reason, "gap": r.best.report.iteration_time_s / opt - 1 if opt else None,
            "evaluations": r.search.evaluations}


def random_cases(seed: int = RANDOM_EXHAUSTIVE_SEED,
                 n: int = RANDOM_EXHAUSTIVE_CASES) -> list[tuple[str, str, str, int, int]]:
    """`n` problems drawn with `seed`: a GPT or Llama of 4-8 layers and hidden 256-16384 (some fill the memory of
    the nodes they get), on 2-3 nodes of V100, T4, RTX 4090 and A100-40GB, at a random batch and sequence."""
    rng = random.Random(seed)
    nodes = ("p3.8xlarge", "g4dn.12xlarge", "rtx4090x4", "dgx-a100-40gb:nodes=1")
    out = []
    for _ in range(n):
        family, layers = rng.choice(["gpt", "llama"]), rng.choice([4, 6, 8])
        hidden = rng.choice([256, 1024, 4096, 8192, 12288, 16384])
        vocab = rng.choice([500, 32000])
        model = f"{family}?layers={layers}&hidden={hidden}&heads={max(hidden // 128, 2)}&vocab={vocab}"
        cluster = "+".join(rng.choice(nodes) for _ in range(rng.choice([2, 2, 3])))
        seq, batch = rng.choice([128, 512, 2048]), rng.choice([4, 8, 16, 32])
        out.append((f"{family} {layers}L h{hidden} on {cluster}, batch {batch} x {seq}", model, cluster, batch, seq))
    return out


def budget_row(case: tuple[str, str, str, int, int, bool], cap_s: float) -> dict[str, Any]:
    """Best iteration time at each evaluation budget (the wall-clock cap may stop a run first)."""
    name, model, cluster, batch, seq, _ = case
    m, c, w = _instance(model, cluster, batch, seq)
    row: dict[str, Any] = {"case": name}
    for n in BUDGETS:
        r = plan(PlanProblem(m, c, w, max_evaluations=n, budget_s=cap_s))
        row[str(n)] = r.best.report.iteration_time_s
        row[f"{n}_stopped_by"] = r.search.stopped_by
    return row


def _trajectory(space: PlanSpace, prior: Any, evaluations: int) -> list[tuple[float, float]]:
    """(seconds since the search started, best value so far) after each evaluation; `prior` None: uniform."""
    judge = SimulatorEvaluator(space)
    trace: list[tuple[float, float]] = []
    best = 0.0
    start = time.perf_counter()

    def evaluate(state: PlanState) -> float:
        nonlocal best
        value = judge(state)
        best = max(best, value)
        trace.append((time.perf_counter() - start, best))
        return value

    mcts(space, PlanState(), prior=prior or uniform_prior, evaluator=evaluate, max_evaluations=evaluations,
         max_wall_s=GUIDANCE_CAP_S, seed=0, gumbel_root=False)
    return trace


def _median_hit_s(m: Any, c: Any, w: Any, factory: Any, hit: tuple[int, float]) -> float:
    """The median over `GUIDANCE_REPEATS` runs of the seconds to the `hit[0]`-th evaluation: the
    search is deterministic (PUCT, seed 0), so each repeat retraces the first run up to the hit, and
    the median damps this VM's timing noise on sub-second searches."""
    times = [hit[1]]
    for _ in range(GUIDANCE_REPEATS - 1):
        space = PlanSpace(Simulator(m, c, w))
        trace = _trajectory(space, factory(space) if factory else None, hit[0])
        times.append(trace[-1][0])
    return statistics.median(times)


class SimulatorScorer:
    """The simulator in the GNN's place inside `GNNPrior` (a measuring device, bench only): the
    prior's own rule (the same decisions, completions, temperature, uniform share and deferral) fed
    exact predictions at no cost, i.e. the prior a perfect model of this form would give. Its
    simulations are not counted as evaluations."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.lower_bound_s = lower_bound_s(sim.model, sim.cluster, sim.workload)

    def predict(self, model_graph: Any, cluster: Any, workload: Any, plans: Any, *,
                calibration: Any) -> tuple[np.ndarray, np.ndarray]:
        reports = [self.sim.simulate(p) for p in plans]
        return (np.log([r.iteration_time_s / self.lower_bound_s for r in reports]),
                np.array([1.0 if r.fits else 0.0 for r in reports]))


def guidance_row(case: tuple[str, str, str, int, int, bool]) -> dict[str, Any]:
    """Wall-clock to within 1% of the best known plan, uniform prior against the GNN's (as
    `--scorer gnn` builds it). A side that never gets there is censored at its whole run: the
    speed-up is then a bound (">=" when only the GNN got there, "<=" when only the uniform prior
    did), and the geometric mean takes the bound, i.e. credits the side that failed with reaching
    the target at the end of its run, the most it could claim.

    Also what bounds guidance of this form: the evaluations the same prior needs when the simulator
    replaces the GNN (`SimulatorScorer`, free), the GNN prior's seconds per plan it scores, and the
    unguided search's seconds per evaluation (simulation and search together)."""
    name, model, cluster, batch, seq, het = case
    m, c, w = _instance(model, cluster, batch, seq)
    gnn = gnn_prior_factory(Registry(), c.num_devices, required=True)
    assert gnn is not None
    runs, priors = {}, {}
    prior_s, prior_plans = 0.0, 0
    for label, factory in (("uniform", None), ("gnn", gnn)):
        space = PlanSpace(Simulator(m, c, w))
        priors[label] = factory(space) if factory else None
        scorer = getattr(priors[label], "scorer", None)
        before = (scorer.predict_s, scorer.plans_scored) if scorer else (0.0, 0)
        runs[label] = _trajectory(space, priors[label], GUIDANCE_EVALUATIONS)
        if scorer:
            prior_s, prior_plans = scorer.predict_s - before[0], scorer.plans_scored - before[1]
    target = max(t[-1][1] for t in runs.values()) / 1.01
    row: dict[str, Any] = {"case": name, "heterogeneous": het, "devices": c.num_devices}
    for label, trace in runs.items():
        hit = next(((i + 1, s) for i, (s, v) in enumerate(trace) if v >= target), None)
        row[f"{label}_evaluations"] = hit[0] if hit else None
        row[f"{label}_s"] = _median_hit_s(m, c, w, (None, gnn)[label == "gnn"], hit) if hit else None
        row[f"{label}_run_evaluations"], row[f"{label}_run_s"] = len(trace), trace[-1][0]
    u, g = row["uniform_s"], row["gnn_s"]
    if u and g:
        row["speedup"], row["bound"] = u / g, ""
    elif g:
        row["speedup"], row["bound"] = row["uniform_run_s"] / g, ">="
    else:
        row["speedup"], row["bound"] = u / row["gnn_run_s"], "<="
    ue, ge = row["uniform_evaluations"], row["gnn_evaluations"]
    row["evaluation_ratio"] = (ue or row["uniform_run_evaluations"]) / (ge or row["gnn_run_evaluations"])
    space = PlanSpace(Simulator(m, c, w))
    oracle = _trajectory(space, GNNPrior(space, SimulatorScorer(Simulator(m, c, w))),  # type: ignore[arg-type]
                         GUIDANCE_EVALUATIONS)
    row["oracle_evaluations"] = next((i + 1 for i, (_, v) in enumerate(oracle) if v >= target), None)
    row["oracle_run_evaluations"] = len(oracle)
    row["oracle_evaluation_ratio"] = (ue or row["uniform_run_evaluations"]) / (
        row["oracle_evaluations"] or len(oracle))
    row["gnn_prior_plans"] = prior_plans
    row["gnn_prior_ms_per_plan"] = 1e3 * prior_s / prior_plans if prior_plans else None
    row["evaluation_ms"] = 1e3 * row["uniform_run_s"] / row["uniform_run_evaluations"]
    return row


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _fmt(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + suffix


def measured_on() -> str:
    """The CPU whose wall-clock seconds a table records (its fingerprint's device type and model name)."""
    from tagplan.profiling.device import fingerprint

    host = fingerprint("cpu")
    return f"{host.device_type} ({host.device_name}, {os.cpu_count()} cores)"


def markdown(results: dict[str, Any]) -> str:
    """The tables of docs/PLANNER_RESULTS.md."""
    rows, summary = results["suite"], results["summary"]
    out = ["# Planner benchmark results", "", "Generated by `bench/planner.py`; every figure is a simulator prediction "
           "(seconds per iteration) and every plan gives each replica whole samples.", "",
           "## Against what practitioners do by hand", "",
           "Baselines: the best uniform Megatron-LM configuration over its whole grid (tp 1-8 inside a node, every "
           "pp and dp, every micro-batch size, recompute off or on (on: the fewest layers per stage that fit, one "
           "count for every stage as Megatron's --recompute-num-layers), ZeRO 0/1, even layer split, 1F1B and "
           "interleaved 1F1B with every virtual-stage count Megatron accepts, nodes in either "
           "order); the best data-parallel plan (ZeRO 0-3, recompute, every micro-batch size; on as many of the "
           "fastest GPUs as the batch splits over in equal whole shares, where that is not every GPU); the best of "
           "both on the "
           "fastest GPU type's nodes alone; and the grid balanced by hand: the grid's pipelined configurations "
           "(up to 64, lowest bound first) with each stage's layers in proportion to its speed, re-split from its own "
           "simulation, also interleaved (`search.rebalance`, what Megatron-Core runs as an uneven pipeline "
           "layout; the column shows the fastest re-split plan, which can be slower than the grid's own best where "
           "that configuration's stages are already balanced). The planner runs at its defaults (400 evaluations, "
           "30 s); its plans "
           "recompute per stage the fewest layers that fit (`search.recompute`), and it also judges the grid's most "
           "promising pipelined configurations with their layers split by stage speed (the same re-split over 24 "
           "configurations of its own quicker grid walk: candidates labelled baseline+split); where that is its best "
           "plan, it gains nothing over the grid balanced by hand. These columns "
           "cost every plan with the default workload (bf16 gradient reductions overlapped with the backward). "
           "\"runs under\" names the export formats that express the planner's best plan "
           "(`export.capability.verdicts`; whether it also fits as that runtime runs it, which `tagplan plan` checks "
           "too, is what the \"as run\" columns answer). The \"as run\" columns cost "
           "plans as an exporter's runtime runs them (`export.capability.runtime_workload` and `reduce_overlap`, "
           "what `plan --exportable FORMAT` does; e.g. Megatron and the torch program reduce gradients in fp32, "
           "and the torch program runs eager PyTorch: the host's time to issue each block's kernels is a floor, "
           "and autocast keeps a 16-bit copy of the weights per micro-batch in flight): "
           "per format the planner's best plan that format runs and the best baseline plan it runs, each the best "
           "over the formats (the format in brackets); Megatron also with `--tp-comm-overlap` where Transformer "
           "Engine's userbuffers run (TP groups inside an NVLink/NVSwitch node of sm80+ GPUs), and Megatron and "
           "DeepSpeed launch the nodes in the plan's rank order, so either side's pipeline may start on any node.", "",
           "| case | planner s | Megatron grid s | grid split by speed s | data parallel s | fastest nodes s | vs best "
           "| idle GPUs | wall s | runs under | planner as run s | best baseline as run s | as run vs best |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['case']} | {r['best_s']:.3f} | {_fmt(r['megatron_grid_s'])} | "
                   f"{_fmt(r.get('split_grid_s'))} | {_fmt(r['data_parallel_s'])} | "
                   f"{_fmt(r['fastest_nodes_s'])} | {_fmt(r['vs_best'], '.2f', 'x')} | {r['idle_devices']}/"
                   f"{r['devices']} | {r['wall_s']:.1f} | {', '.join(r['runs_under']) or 'none'} | "
                   f"{_fmt(r['runnable_s'])} ({r['runnable_format'] or '-'}) | {_fmt(r['runnable_baseline_s'])} "
                   f"({r['runnable_baseline_format'] or '-'}) | {_fmt(r['runnable_vs_best'], '.2f', 'x')} |")
    out += ["", f"- Never worse than a baseline: {summary['never_worse']} (every case).",
            f"- Geometric mean over the heterogeneous cases, against the best baseline: "
            f"{_fmt(summary['heterogeneous_geomean'], '.2f', 'x')} (target 1.25x); as run (plans and baselines "
            "costed as the exporters' runtimes run them): "
            f"{_fmt(summary['heterogeneous_runnable_geomean'], '.2f', 'x')}. Against the baselines set up by hand "
            "without a planner (the grid in either node order, data parallel, the fastest nodes alone; not the grid "
            "split by speed, which is this bench's own heterogeneity-aware baseline): "
            f"{_fmt(summary.get('heterogeneous_by_hand_geomean'), '.2f', 'x')}.",
            f"- Never worse than a baseline as run: {summary['never_worse_as_run']}.",
            f"- Homogeneous cases against the grid: {_fmt(summary['homogeneous_min'], '.3f', 'x')} at worst "
            "(target: within 1%, i.e. >= 0.99x).",
            f"- \"wall s\" is the planner's search on {results.get('suite_measured_on', 'an unrecorded machine')}, "
            "one process; the 175B mixed case's target is under 10 s. `tagplan plan` runs the baselines in other "
            "processes beside the search where cores are free (`--workers`, the same answer):",
            *_cold_lines(results),
            "", "Baseline configurations:", ""]
    out += [f"- {r['case']}: grid {r['megatron_grid_config']}" + (
        f"; split by speed: {r['split_grid_config']}" if r.get("split_grid_s") is not None else "") for r in rows]
    out += ["", "Why no exporter runs a best plan:", ""]
    out += [f"- {r['case']}: " + "; ".join(f"{fmt}: {why}" for fmt, why in r["refusals"].items())
            for r in rows if not r["runs_under"]]
    out += ["", "## Exhaustive gaps (enumerated apart from the search)", "",
            "| case | planner s | exhaustive s | gap | space |", "|---|---|---|---|---|"]
    out += [f"| {e['case']} | {e['best_s']:.4f} | {_fmt(e['exhaustive_s'], '.4f')} | {_fmt(e['gap'], '.2%')} | "
            f"{e['space']} |" for e in results["exhaustive"]]
    drawn = results.get("random_exhaustive", [])
    if drawn:
        gaps = [e["gap"] for e in drawn if e["gap"] is not None]
        out += ["", f"The same on {len(drawn)} problems drawn at random (`random_cases`, seed "
                f"{RANDOM_EXHAUSTIVE_SEED}; "
                f"enumerated up to {RANDOM_EXHAUSTIVE_LIMIT} plans): worst gap "
                f"{_fmt(max(gaps) if gaps else None, '.2%')} over the {len(gaps)} enumerated. A negative gap is the "
                "intra-stage refinement, which reaches plans outside the decision process.", "",
                "| case | planner s | exhaustive s | gap | space |", "|---|---|---|---|---|"]
        out += [f"| {e['case']} | {e['best_s']:.4f}{'' if e.get('fits', True) else ' (does not fit)'} | "
                f"{_fmt(e['exhaustive_s'], '.4f')} | {_fmt(e['gap'], '.2%')} | {e['space']} |" for e in drawn]
    out += ["", "## Quality against budget (iteration s; 120 s cap per run)", "",
            "| case | " + " | ".join(f"{n} evals" for n in BUDGETS) + " |", "|---|" + "---|" * len(BUDGETS)]
    out += [f"| {b['case']} | " + " | ".join(f"{b[str(n)]:.3f}" for n in BUDGETS) + " |" for b in results["budget"]]
    out += ["", "## Guidance: search wall-clock to within 1% of the best known plan", "",
            f"MCTS alone (no baselines, no hill climbing), the simulator judging every plan, up to "
            f"{GUIDANCE_EVALUATIONS} evaluations or {GUIDANCE_CAP_S:.0f} s per run; \"best known\" is the better of "
            "the two runs' final plans. The GNN prior is `--scorer gnn`'s: it scores only the pipeline's shape "
            "(nodes, stages, device groups), keeps half of each prior uniform and asks about a node once it has three "
            "visits (`gnn.scorer.GUIDED_DECISIONS`, `UNIFORM_MIX`, `PRIOR_AFTER_VISITS`, chosen on the first five "
            "cases); a prior call folds interchangeable devices and runs a fused forward pass (docs/GNN.md). "
            "\"-\" marks a run that never got within 1%: its speed-up "
            "is then a bound taken at the whole run, which credits the failed side with reaching the target as its "
            "run ended. What bounds a prior of this form: \"oracle evals\" are the evaluations the same prior "
            "needs when the simulator replaces the GNN (`SimulatorScorer` in this bench: the prior's rule fed exact "
            "predictions at no cost, its simulations not counted), i.e. the most a perfect model could save; "
            "\"prior ms/plan\" is what the GNN prior spent per plan it scored (featurizing, folding, the forward "
            "pass) and \"eval ms\" what one evaluation costs the unguided search (simulation and search).", "",
            "| case | uniform evals | uniform s | GNN evals | GNN s | GNN speed-up (wall) | evaluations ratio "
            "| oracle evals | prior ms/plan | eval ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {g['case']} | {g['uniform_evaluations'] or '-'} | {_fmt(g['uniform_s'], '.2f')} | "
            f"{g['gnn_evaluations'] or '-'} | {_fmt(g['gnn_s'], '.2f')} | "
            f"{g['bound']}{_fmt(g['speedup'], '.2f', 'x')} | "
            f"{g['bound']}{g['evaluation_ratio']:.2f}x | {g.get('oracle_evaluations') or '-'} | "
            f"{_fmt(g.get('gnn_prior_ms_per_plan'), '.2f')} | {_fmt(g.get('evaluation_ms'), '.2f')} |"
            for g in results["guidance"]]
    out += ["", f"Geometric mean GNN wall-clock speed-up: {_fmt(summary['guidance_geomean'], '.2f', 'x')} over "
            f"{len(results['guidance'])} cases (bounds taken as values); evaluations "
            f"{_fmt(summary.get('guidance_evaluation_geomean'), '.2f', 'x')} fewer, against "
            f"{_fmt(summary.get('oracle_evaluation_geomean'), '.2f', 'x')} fewer with the oracle prior; scoring one "
            f"plan costs the GNN prior {_fmt(summary.get('prior_plan_per_evaluation'), '.1f', 'x')} what one "
            "evaluation costs the search (geometric means). A better model of the same form moves the GNN's "
            "evaluations toward the oracle's; it does not make scoring an action cheaper than evaluating a plan. "
            f"`--scorer auto` uses the GNN prior only where "
            "its checkpoint card records a measured wall-clock gain for the problem class (`--record-guidance` "
            "writes these classes into the shipped card; see docs/PLANNER.md); otherwise it is the uniform prior.", ""]
    out += [f"- {'heterogeneous' if k['heterogeneous'] else 'homogeneous'} clusters up to {k['max_devices']} GPUs "
            f"({k['cases']} cases): {k['speedup']:.2f}x, worst case {_fmt(k.get('worst'), '.2f', 'x')}"
            for k in summary["guidance_classes"]]
    out += ["", "`--scorer auto` guides a class only where its geometric mean is above 1x and no case of it is more "
            "than 20% slower (`training.registry.guidance_pays`). On these cases (in sample: the classes are "
            f"measured on them) it is {_fmt(summary.get('auto_geomean'), '.2f', 'x')} of `--scorer simulator`'s speed "
            f"in geometric mean, {_fmt(summary.get('auto_worst'), '.2f', 'x')} at worst (target: never below 0.83x, "
            "i.e. never more than 20% slower)."]
    return "\n".join(out) + "\n"


def _cold_lines(results: dict[str, Any]) -> list[str]:
    walls = results.get("cold_wall_s") or {}
    return [f"- {name}, the search alone in {len(ws)} fresh processes (`cold_walls`), {workers} "
            f"{'process' if workers == '1' else 'processes (the baselines beside the search)'}: median "
            f"{statistics.median(ws):.1f} s ({', '.join(f'{w:.1f}' for w in ws)})."
            for name, by_workers in walls.items() for workers, ws in by_workers.items()]


def _by_hand_s(row: dict[str, Any]) -> float | None:
    """The best of the baselines a practitioner sets up without a planner (the grid in either node order, data
    parallelism, the fastest nodes alone): every baseline but the grid split by speed, which is this bench's own
    heterogeneity-aware strengthening."""
    known = [row[f"{k}_s"] for k in BASELINES if k != "split_grid" and row[f"{k}_s"] is not None]
    return min(known) if known else None


def summarize(rows: list[dict[str, Any]], guidance: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets' figures."""
    het = [r["vs_best"] for r in rows if r["heterogeneous"] and r["vs_best"]]
    het_by_hand = [hand / r["best_s"] for r in rows if r["heterogeneous"] and (hand := _by_hand_s(r)) is not None]
    het_runnable = [r["runnable_vs_best"] for r in rows if r["heterogeneous"] and r["runnable_vs_best"]]
    hom = [r["megatron_grid_s"] / r["best_s"] for r in rows if not r["heterogeneous"] and r["megatron_grid_s"]]
    classes = []
    for kind in (True, False):
        members = [g for g in guidance if g["heterogeneous"] is kind]
        speedups = [g["speedup"] for g in members]
        if members:
            classes.append({"heterogeneous": kind, "max_devices": max(g["devices"] for g in members),
                            "speedup": _geomean(speedups), "worst": min(speedups), "cases": len(members)})
    # --scorer auto against --scorer simulator: the GNN where its class pays (training.registry.guidance_pays)
    paying = [k["heterogeneous"] for k in classes if class_pays(k)]
    auto = [g["speedup"] if g["heterogeneous"] in paying else 1.0 for g in guidance]
    return {"never_worse": all(r["vs_best"] is None or r["vs_best"] >= 1 - 1e-9 for r in rows),
            "never_worse_as_run": all(r["runnable_vs_best"] is None or r["runnable_vs_best"] >= 1 - 1e-9
                                      for r in rows),
            "heterogeneous_geomean": _geomean(het), "heterogeneous_runnable_geomean": _geomean(het_runnable),
            "heterogeneous_by_hand_geomean": _geomean(het_by_hand),
            "homogeneous_min": min(hom) if hom else None,
            "guidance_geomean": _geomean([g["speedup"] for g in guidance]),
            "guidance_evaluation_geomean": _geomean([g["evaluation_ratio"] for g in guidance]),
            "oracle_evaluation_geomean": _geomean([g["oracle_evaluation_ratio"] for g in guidance
                                                   if "oracle_evaluation_ratio" in g]),
            "prior_plan_per_evaluation": _geomean([g["gnn_prior_ms_per_plan"] / g["evaluation_ms"] for g in guidance
                                                   if g.get("gnn_prior_ms_per_plan")]),
            "guidance_classes": classes, "auto_geomean": _geomean(auto), "auto_worst": min(auto) if auto else None}


def _only(section: str, text: str) -> None:
    """One table's rows for the cases whose name contains `text`, printed (nothing is written)."""
    def chosen(cases: list[Any]) -> list[Any]:
        return [c for c in cases if text.lower() in c[0].lower()]

    if section == "suite":
        rows: list[dict[str, Any]] = [suite_row(c, evaluations=400, budget_s=30.0) for c in chosen(CASES)]
    elif section == "exhaustive":
        rows = [exhaustive_row(c) for c in chosen(EXHAUSTIVE)]
    elif section == "budget":
        rows = [budget_row(c, 120.0) for c in chosen(CASES)]
    else:
        rows = [guidance_row(CASES[i]) for i in GUIDANCE_CASES if CASES[i] in chosen(CASES)]
    for row in rows:
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run: few cases, small budgets")
    parser.add_argument("--only", choices=("suite", "exhaustive", "budget", "guidance"),
                        help="run one table and print its rows; writes nothing")
    parser.add_argument("--cases", default="", help="with --only: the cases whose name contains this text")
    parser.add_argument("--markdown", action="store_true",
                        help="recompute the summary of bench/results/planner.json and rewrite docs/PLANNER_RESULTS.md; "
                             "runs nothing")
    parser.add_argument("--update-guidance", action="store_true",
                        help="rerun only the guidance table, put it into bench/results/planner.json and rewrite "
                             "docs/PLANNER_RESULTS.md (when only the search's guidance changed)")
    parser.add_argument("--update-suite", action="store_true",
                        help="rerun only the suite table, put it into bench/results/planner.json and rewrite "
                             "docs/PLANNER_RESULTS.md (when only the costing of the suite's plans changed)")
    parser.add_argument("--update-exhaustive", action="store_true",
                        help="rerun only the exhaustive gaps, put them into bench/results/planner.json and rewrite "
                             "docs/PLANNER_RESULTS.md (when only the decision process changed)")
    parser.add_argument("--update-timing", action="store_true",
                        help="rerun only the cold-start wall-clock of the timed cases (`cold_walls`), put it into "
                             "bench/results/planner.json and rewrite docs/PLANNER_RESULTS.md")
    parser.add_argument("--record-guidance", action="store_true",
                        help="write the measured guidance classes into the shipped GNN card (`--scorer auto` reads it)")
    args = parser.parse_args()
    if (args.markdown or args.update_guidance or args.update_suite or args.update_timing
            or args.update_exhaustive):  # summary from the rows
        path = Path(__file__).parent / "results" / "planner.json"
        results = json.loads(path.read_text())
        if args.update_suite:
            results["suite"] = [suite_row(c, evaluations=results["evaluations"], budget_s=results["budget_s"])
                                for c in CASES]
            results["suite_measured_on"] = measured_on()
        if args.update_exhaustive:
            results["exhaustive"] = [exhaustive_row(c) for c in EXHAUSTIVE]
            results["random_exhaustive"] = [exhaustive_row(c, RANDOM_EXHAUSTIVE_LIMIT) for c in random_cases()]
        if args.update_suite or args.update_timing:
            results["cold_wall_s"] = cold_walls(results["evaluations"], results["budget_s"])
        if args.update_guidance:
            results["guidance"] = []
            for i in GUIDANCE_CASES:
                results["guidance"].append(g := guidance_row(CASES[i]))
                print(json.dumps(g), flush=True)
        results["summary"] = summarize(results["suite"], results["guidance"])
        path.write_text(json.dumps(results, indent=2))
        (Path(__file__).parents[1] / "docs" / "PLANNER_RESULTS.md").write_text(markdown(results))
        if args.record_guidance:
            record_guidance(results["summary"]["guidance_classes"])
        return
    if args.only:
        _only(args.only, args.cases)
        return
    cases = CASES[6:8] if args.quick else CASES
    evaluations, budget = (60, 10.0) if args.quick else (400, 30.0)
    rows = []
    for case in cases:
        rows.append(suite_row(case, evaluations=evaluations, budget_s=budget))
        r = rows[-1]
        print(f"{r['case']:36s} planner {r['best_s']:.3f} s  best baseline {_fmt(r['best_baseline_s'])}  "
              f"vs best {_fmt(r['vs_best'], '.2f')}  wall {r['wall_s']:.1f} s", flush=True)
    exhaustive = [exhaustive_row(c) for c in (EXHAUSTIVE[:1] if args.quick else EXHAUSTIVE)]
    drawn = [exhaustive_row(c, RANDOM_EXHAUSTIVE_LIMIT) for c in random_cases(n=1 if args.quick else
                                                                              RANDOM_EXHAUSTIVE_CASES)]
    for e in exhaustive + drawn:
        print(f"exhaustive: {e['case']:36s} gap {_fmt(e['gap'], '.2%')}  ({e['space']})", flush=True)
    budget_rows = [budget_row(CASES[i], 30.0 if args.quick else 120.0) for i in BUDGET_CASES[:1 if args.quick else 4]]
    for b in budget_rows:
        print("budget: " + b["case"] + "  " + "  ".join(f"{n}: {b[str(n)]:.3f}" for n in BUDGETS), flush=True)
    guidance = []
    for i in GUIDANCE_CASES[:1 if args.quick else len(GUIDANCE_CASES)]:
        guidance.append(g := guidance_row(CASES[i]))
        print(f"guidance: {g['case']:36s} uniform {_fmt(g['uniform_s'], '.2f')} s  gnn {_fmt(g['gnn_s'], '.2f')} s  "
              f"speed-up {g['bound']}{g['speedup']:.2f}x", flush=True)
    results = {"suite": rows, "exhaustive": exhaustive, "random_exhaustive": drawn, "budget": budget_rows,
               "guidance": guidance,
               "summary": summarize(rows, guidance), "evaluations": evaluations, "budget_s": budget,
               "cold_wall_s": {} if args.quick else cold_walls(evaluations, budget), "suite_measured_on": measured_on()}
    out = Path(__file__).parent / "results" / ("planner_quick.json" if args.quick else "planner.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    if not args.quick:
        (Path(__file__).parents[1] / "docs" / "PLANNER_RESULTS.md").write_text(markdown(results))
    if args.record_guidance:
        record_guidance(results["summary"]["guidance_classes"])
    print(json.dumps(results["summary"], indent=2))


def record_guidance(classes: list[dict[str, Any]]) -> None:
    """Write the measured guidance classes into the shipped checkpoint's card, which `--scorer auto`
    reads (`training.registry.guidance_pays`)."""
    card_path = Path(__file__).parents[1] / "tagplan" / "gnn" / "checkpoints" / "default.card.json"
    card = json.loads(card_path.read_text())
    source = "bench/planner.py guidance (uniform s / GNN s: geometric mean over the class, and its worst case)"
    card["guidance"] = [{**k, "source": source}
                        for k in classes]
    card_path.write_text(json.dumps(card, indent=2) + "\n")


if __name__ == "__main__":
    main()
