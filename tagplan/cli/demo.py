"""`tagplan demo`: the default example model and cluster, inspected, then planned."""

from __future__ import annotations

import argparse
import sys

from tagplan.cli.options import Subparsers, add_json_option, console, emit
from tagplan.ir.workload import DType, Workload
from tagplan.search.problem import PlanProblem

DEMO_MODEL = "gpt3-1.3b"
DEMO_CLUSTER = "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1"
DEMO_BATCH, DEMO_SEQ = 32, 1024
DEMO_MAX_EVALUATIONS, DEMO_BUDGET_S = 200, 20.0


def add_demo_command(sub: Subparsers) -> None:
    """Add `demo` to the `tagplan` parser."""
    demo = sub.add_parser("demo", help="inspect the default example model and cluster, then plan for them")
    demo.add_argument("--model", default=DEMO_MODEL, help="model SPEC")
    demo.add_argument("--cluster", default=DEMO_CLUSTER, help="cluster SPEC")
    add_json_option(demo, "{model, cluster, plan} (`inspect` summaries and `plan --json`)")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from tagplan.cli.planning import search
    from tagplan.cli.tables import cluster_table, model_table, plan_result_table
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir.summary import cluster_summary, model_summary

    model = load_model(args.model, seq_len=DEMO_SEQ, dtype=DType.BF16)
    cluster = load_cluster(args.cluster)
    workload = Workload(global_batch=DEMO_BATCH, seq_len=model.seq_len, dtype=DType.BF16)
    problem = PlanProblem(model, cluster, workload, budget_s=DEMO_BUDGET_S, max_evaluations=DEMO_MAX_EVALUATIONS)
    shown = {"model": model_summary(model, batch=DEMO_BATCH), "cluster": cluster_summary(cluster)}
    if not args.json:  # the inputs first, so there is something to read while the search runs
        console().print(model_table(shown["model"]))
        console().print(cluster_table(shown["cluster"]))
    result = search(problem, show_progress=not args.json and sys.stderr.isatty())
    emit({**shown, "plan": result.to_json()} if args.json else result, args.json, plan_result_table)
    return 0
