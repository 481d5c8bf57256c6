"""`tagplan simulate` (predict one plan) and `tagplan plan` (search the best one).

Both take the problem options of `cli.options`; `plan` turns them into one `PlanProblem`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from tagplan.cli.options import (
    EXIT_INFEASIBLE,
    Subparsers,
    add_json_option,
    add_problem_options,
    console,
    emit,
    load_calibration_option,
    load_problem,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
)
from tagplan.cost.comm import CommMode
from tagplan.errors import SpecError
from tagplan.frontends.model_spec import ModelSpec, parse_model_spec
from tagplan.frontends.plan_file import plan_file_json, searched_for
from tagplan.ir.workload import LOSS_KERNEL_TEXT, LossKernel
from tagplan.search.problem import DEFAULT_BUDGET_S, DEFAULT_MAX_EVALUATIONS, WORKERS, Objective, PlanProblem, Scorer
from tagplan.search.result import PlanResult


def add_planning_commands(sub: Subparsers) -> None:
    """Add `simulate` and `plan` to the `tagplan` parser."""
    sim = sub.add_parser("simulate", help="predict one iteration of a plan: time, memory, breakdown, timeline")
    add_problem_options(sim)
    sim.add_argument("--plan", required=True,
                     help="a Plan JSON file, or a fixed rule: dp (every GPU a replica) | megatron (tp = GPUs per node, "
                          "the fewest pipeline stages that fit, micro-batch 1); `plan` reports its searched baselines, "
                          "whose plans `plan --json` gives")
    _add_comm_mode(sim)
    sim.add_argument("--timeline", default=None, type=output_file, metavar="OUT.json",
                     help="write a Chrome trace (open in Perfetto)")
    sim.add_argument("--plan-out", default=None, type=output_file, metavar="PLAN.json",
                     help="write the simulated plan (for baselines)")
    sim.add_argument("--exportable", choices=["torch", "megatron", "deepspeed"], default=None,
                     help="cost the plan as that format's runtime runs it, as `plan --exportable FORMAT` does (its "
                          "gradient reduction, kernels, loss and memory), and say whether the format runs it and fits "
                          "it (--json: {report, exportable: {FORMAT: null or why not}})")
    sim.add_argument("--predictor", choices=["simulator", "gnn"], default="simulator",
                     help="gnn: also the active GNN's prediction, when it was fine-tuned on measured iterations of "
                          "this cluster's GPU types and beat the simulator on held-out records")
    add_json_option(sim, "the Report (with --predictor gnn: {report, predicted_time_s, gnn})")
    sim.set_defaults(func=_simulate)

    cmd = sub.add_parser("plan", help="search the best plan: MCTS judged by the simulator, with baselines")
    add_problem_options(cmd)
    cmd.add_argument("--budget-s", type=positive_float, default=DEFAULT_BUDGET_S,
                     help=f"wall-clock budget of the search in seconds (default {DEFAULT_BUDGET_S:g})")
    cmd.add_argument("--max-evaluations", type=positive_int, default=DEFAULT_MAX_EVALUATIONS,
                     help=f"plans simulated at most (default {DEFAULT_MAX_EVALUATIONS})")
    cmd.add_argument("--objective", choices=[o.value for o in Objective], default=Objective.TIME.value)
    cmd.add_argument("--time-bound-s", type=positive_float, default=None,
                     help="for --objective memory|gpus: slowest acceptable iteration (default 1.25 x the fastest)")
    cmd.add_argument("--exhaustive-limit", type=non_negative_int, default=0,
                     help="also enumerate the whole space when it has at most this many plans")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--workers", type=int, choices=WORKERS, default=None,
                     help="processes: 2 runs the practitioner baselines in a second process beside the search, 3 "
                          "splits them over two (the same answer, sooner); default: as many as this process has "
                          "cores, up to 3")
    cmd.add_argument("--scorer", choices=[s.value for s in Scorer], default=Scorer.AUTO.value,
                     help="search prior: the GNN, or uniform (simulator); auto: the GNN only where its checkpoint's "
                          "card records a measured wall-clock gain for this class of problem (docs/PLANNER.md); "
                          "plans are always ranked by the simulator")
    _add_comm_mode(cmd)
    cmd.add_argument("--out", default=None, type=output_file, metavar="PLAN.json",
                     help="write the best plan (Plan JSON v1)")
    cmd.add_argument("--timeline", default=None, type=output_file, metavar="OUT.json",
                     help="write the best plan's Chrome trace")
    cmd.add_argument("--exportable", choices=["torch", "megatron", "deepspeed"], default=None,
                     help="return only plans this export format runs")
    cmd.add_argument("--allow-infeasible", action="store_true",
                     help="when no plan fits in memory (with --exportable: none that format runs), still write "
                          "--out and exit 0")
    add_json_option(cmd, "the full result (`PlanResult.to_json`)")
    cmd.set_defaults(func=_plan)


def _add_comm_mode(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comm-mode", choices=[m.value for m in CommMode], default=CommMode.TOPOLOGY.value,
                        help="bytes_only ignores the topology (an ablation; its times only compare with each other)")


def _simulate(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import report_table
    from tagplan.cost.baselines import data_parallel, megatron
    from tagplan.cost.simulator import Simulator
    from tagplan.cost.timeline import chrome_trace
    from tagplan.frontends.plan_file import load_plan_file, searched_workload
    from tagplan.search.planner import dtype_notes

    if args.plan not in ("dp", "megatron") and not Path(args.plan).is_file():
        raise SpecError(f"--plan {args.plan[:80]!r}: no such file; accepted: a Plan JSON file, dp or megatron")
    plan_file = None if args.plan in ("dp", "megatron") else load_plan_file(args.plan)
    if plan_file is not None:  # --batch and --seq default to what the plan was searched for
        args.batch, args.seq = searched_workload(args.batch, args.seq, plan_file[1], args.plan)
    model, cluster, workload = load_problem(args)
    overlap = None
    if args.exportable:  # as `plan --exportable` costs it
        from tagplan.export.capability import reduce_overlap, runtime_workload

        workload = runtime_workload(args.exportable, workload, parse_model_spec(args.model))
        overlap = reduce_overlap(args.exportable, workload, cluster)
    sim = Simulator(model, cluster, workload, comm_mode=CommMode(args.comm_mode),
                    calibration=load_calibration_option(args), reduce_overlap=overlap)
    if args.plan in ("dp", "megatron"):
        baseline = (data_parallel if args.plan == "dp" else megatron)(sim)
        if baseline.plan is None:
            raise SpecError(f"--plan {args.plan}: the baseline does not apply: {baseline.reason}")
        plan = baseline.plan
    else:
        assert plan_file is not None
        plan = plan_file[0]
    result = sim.run(plan, record_tasks=bool(args.timeline))
    for note in dtype_notes(cluster, workload.dtype, plan.devices):  # on stderr: --json keeps stdout the report's
        print(f"note: {note}", file=sys.stderr)
    if args.timeline:
        Path(args.timeline).write_text(json.dumps(chrome_trace(result)))
    if args.plan_out:
        Path(args.plan_out).write_text(plan_file_json(plan, searched_for(workload, model.seq_len)))
    if args.predictor == "gnn":
        return _with_correction(args, result.report, plan, (model, cluster, workload), sim.calibration)
    if not args.exportable:
        emit(result.report, args.json, lambda report: report_table(report, plan))
        return 0
    from tagplan.cli.tables import workload_line
    from tagplan.export.capability import exportable, memory_refusal

    why = (exportable(plan, args.exportable, model, global_batch=workload.global_batch,
                      spec=parse_model_spec(args.model), cluster=cluster, tp_comm_overlap=workload.tp_comm_overlap,
                      dtype=workload.dtype) or memory_refusal(plan, args.exportable, sim))
    if args.json:
        emit({"report": result.report.model_dump(mode="json"), "exportable": {args.exportable: why}}, True, str)
        return 0
    console().print(report_table(result.report, plan))
    print(workload_line(workload))
    print(f"{args.exportable} runs this plan" if why is None else f"{args.exportable} does not run this plan: "
          f"{' '.join(why.split())}")
    return 0


def _with_correction(args: argparse.Namespace, report: Any, plan: Any, problem: tuple[Any, Any, Any],
                     calibration: Any) -> int:
    """`simulate --predictor gnn`: both predictions; SpecError when no learned correction applies."""
    from tagplan.training.registry import Registry, correction

    fix = correction(Registry(), *problem, calibration=calibration)
    if fix is None:
        raise SpecError("--predictor gnn: the active GNN version was not fine-tuned on measured iterations of "
                        "this cluster's GPU types (or did not beat the simulator on them); see `tagplan models list`")
    corrected = float(fix.predict_s([plan])[0])
    if args.json:
        emit({"report": report.model_dump(mode="json"), "gnn": fix.version,
              "predicted_time_s": {"simulator": report.iteration_time_s, "corrected": corrected}}, True, str)
    else:
        from tagplan.cli.tables import report_table

        console().print(report_table(report, plan))
        print(f"corrected by GNN {fix.version}: {corrected:.4f} s (simulator {report.iteration_time_s:.4f} s)")
    return 0


def plan_problem(args: argparse.Namespace) -> PlanProblem:
    """The one PlanProblem the `plan` options describe; with `--exportable`, the workload as that
    format's runtime runs it (`export.capability.runtime_workload`)."""
    model, cluster, workload = load_problem(args)
    if getattr(args, "exportable", None):
        from tagplan.export.capability import runtime_workload

        workload = runtime_workload(args.exportable, workload, parse_model_spec(args.model))
    return PlanProblem(model, cluster, workload, objective=Objective(args.objective), budget_s=args.budget_s,
                       max_evaluations=args.max_evaluations, seed=args.seed, time_bound_s=args.time_bound_s,
                       calibration=load_calibration_option(args), scorer=Scorer(args.scorer),
                       comm_mode=CommMode(args.comm_mode), exhaustive_limit=args.exhaustive_limit,
                       workers=_workers(getattr(args, "workers", None)))


def _workers(asked: int | None) -> int:
    """`--workers`, or by default as many processes as this one has cores, up to the most the planner runs."""
    if asked is not None:
        return asked
    from tagplan.search.background import usable_cores

    return min(usable_cores(), max(WORKERS))


def search(problem: PlanProblem, *, show_progress: bool, exportable: str | None = None,
           spec: ModelSpec | None = None) -> PlanResult:
    """`search.planner.plan` with the prior `problem.scorer` asks for, and a progress bar if asked;
    with `exportable`, only plans that export format runs (`spec`: the model's SPEC, which lets the
    torch check build Hugging Face classes and user modules), costed as its runtime reduces gradients
    (`export.capability.reduce_overlap`). The result says which formats run its best plan and why
    the others do not (`export.capability.verdicts`)."""
    from tagplan.search.planner import plan
    from tagplan.training.registry import Registry, correction, prior_factory

    admissible = overlap = None
    if exportable is not None:
        from tagplan.export.capability import exportable as can_export
        from tagplan.export.capability import model_refusal, reduce_overlap

        if (why := model_refusal(exportable, problem.model, spec, problem.cluster)) is not None:
            raise SpecError(f"--exportable {exportable}: no plan of this model runs in that format here: {why}")

        batch = problem.workload.global_batch
        admissible = lambda p: can_export(p, exportable, problem.model, global_batch=batch, spec=spec,  # noqa: E731
                                          cluster=problem.cluster, tp_comm_overlap=problem.workload.tp_comm_overlap,
                                          dtype=problem.workload.dtype)
        overlap = reduce_overlap(exportable, problem.workload, problem.cluster)

    prior = prior_factory(problem.scorer, Registry(), problem.cluster.num_devices,
                          heterogeneous=len({d.spec.name for d in problem.cluster.devices}) > 1)
    fix = correction(Registry(), problem.model, problem.cluster, problem.workload, calibration=problem.calibration)
    from tagplan.export.capability import with_verdicts

    with _progress(problem.max_evaluations, enabled=show_progress) as tick:
        result = plan(problem, prior_factory=prior, progress=tick, admissible=admissible, correction=fix,
                      reduce_overlap=overlap)
    return with_verdicts(result, problem.model, problem.workload, spec=spec, cluster=problem.cluster,
                         calibration=problem.calibration, exportable_option="--exportable")


def _plan(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import plan_result_table
    from tagplan.export.checks import exported_loss

    problem = plan_problem(args)
    result = search(problem, show_progress=not args.json and sys.stderr.isatty(),
                    exportable=args.exportable, spec=parse_model_spec(args.model))
    given = getattr(args, "loss", None)
    asked = LossKernel(given or LossKernel.EAGER.value)
    if args.exportable and (runs := exported_loss(args.exportable, asked)) is not asked:  # as runtime_workload costed
        said = f"--loss {asked.value}" if given else "the default --loss eager"
        result = replace(result, notes=(*result.notes, f"{said}: {args.exportable} runs the {runs.value} cross-entropy "
                                        f"({LOSS_KERNEL_TEXT[runs]}) as exported, and every plan was costed as it "
                                        "runs"))
    refused = result.exporters.get(args.exportable) if args.exportable else None
    feasible = result.best.report.fits and refused is None
    if args.out and (feasible or args.allow_infeasible):
        costed = result.workload or problem.workload  # as `--exportable` costed it (its runtime's reduction)
        Path(args.out).write_text(plan_file_json(result.best.plan, searched_for(costed, problem.model.seq_len)))
    if args.timeline and (feasible or args.allow_infeasible):
        Path(args.timeline).write_text(json.dumps(result.timeline()))
    emit(result.to_json() if args.json else result, args.json, plan_result_table)
    if feasible or args.allow_infeasible:
        return 0
    what = f"plan that {args.exportable} runs" if args.exportable else "plan"
    why = (f"no {what} fits in memory: the best needs {result.best.report.peak_memory_bytes / 2**30:.1f} GiB "
           f"on device {result.best.report.worst_device}" if not result.best.report.fits else
           f"--exportable {args.exportable}: the search found no plan that format runs and that fits in memory; "
           f"the plan shown is not one ({refused})")
    unwritten = [f"{flag} {path}" for flag, path in (("--out", args.out), ("--timeline", args.timeline)) if path]
    said = f"; {' and '.join(unwritten)} not written (--allow-infeasible writes them)" if unwritten else ""
    print(why + said, file=sys.stderr)  # stderr, with --json too: stdout holds the JSON alone
    return EXIT_INFEASIBLE


@contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on a terminal; nothing when piped."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("searching plans", total=total)
        yield lambda done, _total: bar.update(task, completed=done)

