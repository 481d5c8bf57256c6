"""The `tagplan` command. Bad input prints one clear message and exits with code 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tagplan.cost.comm import CommMode
from tagplan.errors import SpecError
from tagplan.ir.workload import DType, Optimizer, Workload
from tagplan.search.result import Objective

EXIT_BAD_INPUT = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    inspect = sub.add_parser("inspect", help="show a model or a cluster as tagplan sees it")
    kinds = inspect.add_subparsers(dest="what", required=True)
    model = kinds.add_parser("model", help="a model SPEC: zoo name, FAMILY?k=v, hf:ConfigClass?k=v, or a file")
    model.add_argument("spec")
    model.add_argument("--batch", type=_positive_int, default=1, help="samples (for flops_per_batch)")
    model.add_argument("--seq", type=_positive_int, default=None, help="tokens per sample (default: the model's)")
    model.add_argument("--dtype", choices=[d.value for d in DType], default="bf16")
    model.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    model.set_defaults(func=_inspect_model)
    cluster = kinds.add_parser("cluster", help="a cluster SPEC: PRESET[:nodes=N][+...] or a file")
    cluster.add_argument("spec")
    cluster.add_argument("--nodes", type=_positive_int, default=None, help="nodes, for one-node topology files")
    cluster.add_argument("--gpu", default=None, help="GPU type, for topology files that do not name it")
    cluster.add_argument("--nic-gbps", type=float, default=None, help="NIC speed in Gb/s, for topology files")
    cluster.add_argument("--network-latency-us", type=float, default=None,
                         help="one-way latency between nodes in microseconds (default: by NIC class)")
    cluster.add_argument("--nccl-tests", action="append", default=None, metavar="LOG",
                         help="nccl-tests output whose measured bandwidth replaces the catalog's (repeatable)")
    cluster.add_argument("--dtype", choices=[d.value for d in DType], default="bf16")
    cluster.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    cluster.set_defaults(func=_inspect_cluster)


def _inspect_model(args: argparse.Namespace) -> int:
    from tagplan.frontends.model_spec import load_model
    from tagplan.views import model_summary, model_table

    graph = load_model(args.spec, seq_len=args.seq, dtype=DType(args.dtype))
    summary = model_summary(graph, batch=args.batch)
    _emit(summary, args.json, model_table)
    return 0


def _inspect_cluster(args: argparse.Namespace) -> int:
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.views import cluster_summary, cluster_table

    cluster = load_cluster(args.spec, nodes=args.nodes, gpu=args.gpu, nic_speed_Gbps=args.nic_gbps,
                           network_latency_us=args.network_latency_us, nccl_tests=args.nccl_tests)
    _emit(cluster_summary(cluster, dtype=DType(args.dtype)), args.json, cluster_table)
    return 0


def _emit(summary: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], Any]) -> None:
    if as_json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    # Piped output gets a wide page rather than rich's 80-column default.
    _console().print(table(summary))


def _add_problem_args(parser: argparse.ArgumentParser) -> None:
    """--model, --cluster and the workload options shared by `simulate` and `plan`."""
    parser.add_argument("--model", required=True, help="model SPEC")
    parser.add_argument("--cluster", required=True, help="cluster SPEC")
    parser.add_argument("--batch", type=_positive_int, default=None, help="global batch in samples (default 8)")
    parser.add_argument("--seq", type=_positive_int, default=None, help="tokens per sample (default: the model's)")
    parser.add_argument("--dtype", choices=[d.value for d in DType], default="bf16")
    parser.add_argument("--optimizer", choices=[o.value for o in Optimizer], default="adam")
    parser.add_argument("--calibration", default=None, metavar="CALIB.json",
                        help="cost-model calibration from `tagplan calibrate` (default: the one pinned beside "
                             "the active GNN version, else the shipped defaults)")


def _load_problem(args: argparse.Namespace) -> tuple[Any, Any, Workload]:
    """(ModelGraph, Cluster, Workload) from the options `_add_problem_args` defines."""
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model

    dtype = DType(args.dtype)
    model = load_model(args.model, seq_len=args.seq, dtype=dtype)
    workload = Workload(global_batch=args.batch or 8, seq_len=model.seq_len, dtype=dtype,
                        optimizer=Optimizer(args.optimizer))
    return model, load_cluster(args.cluster), workload


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="predict one iteration of a plan: time, memory, breakdown, timeline")
    _add_problem_args(sim)
    sim.add_argument("--plan", required=True, help="a Plan JSON file, or a baseline: dp | megatron")
    sim.add_argument("--comm-mode", choices=[m.value for m in CommMode], default="topology",
                     help="bytes_only ignores the topology (an ablation; its times only compare with each other)")
    sim.add_argument("--timeline", default=None, metavar="OUT.json", help="write a Chrome trace (open in Perfetto)")
    sim.add_argument("--plan-out", default=None, metavar="PLAN.json", help="write the simulated plan (for baselines)")
    sim.add_argument("--json", action="store_true", help="the Report as JSON on stdout")
    sim.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from tagplan.cli_traces import load_calibration_option
    from tagplan.cost.baselines import data_parallel, megatron
    from tagplan.cost.plan_file import load_plan
    from tagplan.cost.simulator import Simulator
    from tagplan.cost.timeline import chrome_trace
    from tagplan.views import report_table

    model, cluster, workload = _load_problem(args)
    sim = Simulator(model, cluster, workload, comm_mode=CommMode(args.comm_mode),
                    calibration=load_calibration_option(args.calibration))
    if args.plan in ("dp", "megatron"):
        baseline = (data_parallel if args.plan == "dp" else megatron)(sim)
        if baseline.plan is None:
            raise SpecError(f"--plan {args.plan}: the baseline does not apply: {baseline.reason}")
        plan = baseline.plan
    else:
        plan = load_plan(args.plan)
    result = sim.run(plan)
    if args.timeline:
        Path(args.timeline).write_text(json.dumps(chrome_trace(result)))
    if args.plan_out:
        Path(args.plan_out).write_text(plan.model_dump_json(indent=2))
    if args.json:
        sys.stdout.write(result.report.model_dump_json(indent=2) + "\n")
    else:
        _console().print(report_table(result.report, plan))
    return 0


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("plan", help="search the best plan: MCTS judged by the simulator, with baselines")
    _add_problem_args(cmd)
    cmd.add_argument("--budget-s", type=float, default=30.0, help="wall-clock budget of the search (seconds)")
    cmd.add_argument("--max-evaluations", type=_positive_int, default=400, help="plans simulated at most")
    cmd.add_argument("--objective", choices=[o.value for o in Objective], default="time")
    cmd.add_argument("--time-bound-s", type=float, default=None,
                     help="for --objective memory|gpus: slowest acceptable iteration (default 1.25 x the fastest)")
    cmd.add_argument("--exhaustive-limit", type=int, default=0,
                     help="also enumerate the whole space when it has at most this many plans")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--scorer", choices=["auto", "gnn", "simulator"], default="auto",
                     help="search prior: the GNN (auto: when a checkpoint is installed) or uniform; "
                          "plans are always ranked by the simulator")
    cmd.add_argument("--out", default=None, metavar="PLAN.json", help="write the best plan (Plan JSON v1)")
    cmd.add_argument("--json", action="store_true", help="the full result as JSON on stdout")
    cmd.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from tagplan.search.planner import plan
    from tagplan.views import plan_result_table

    if args.budget_s <= 0:
        raise SpecError(f"--budget-s {args.budget_s}: must be a positive number of seconds")
    from tagplan.cli_traces import load_calibration_option

    model, cluster, workload = _load_problem(args)
    calibration = load_calibration_option(args.calibration)
    with _progress(args.max_evaluations, enabled=not args.json and sys.stderr.isatty()) as tick:
        result = plan(model, cluster, workload, objective=Objective(args.objective), budget_s=args.budget_s,
                      max_evaluations=args.max_evaluations, seed=args.seed, time_bound_s=args.time_bound_s,
                      exhaustive_limit=args.exhaustive_limit, progress=tick, calibration=calibration,
                      prior_factory=_gnn_prior(args.scorer, cluster.num_devices))
    if args.out:
        Path(args.out).write_text(result.best.plan.model_dump_json(indent=2))
    if args.json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
    else:
        _console().print(plan_result_table(result))
    return 0


def _gnn_prior(choice: str, devices: int) -> Callable[[Any], Any] | None:
    """A factory of the GNN prior from the registry's active checkpoint (or the packaged one)."""
    if choice == "simulator":
        return None
    from tagplan.training.registry import Registry, gnn_prior_factory

    try:
        return gnn_prior_factory(Registry(), devices, required=choice == "gnn")
    except SpecError as err:
        raise SpecError(f"--scorer gnn: {err}") from None


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


def _add_learning(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("dataset", help="simulator-labelled training data for the GNN")
    data_sub = data.add_subparsers(dest="what", required=True)
    gen = data_sub.add_parser("generate", help="generate train/ and heldout_gpus/ sample sets")
    gen.add_argument("--out", required=True, help="directory to write")
    gen.add_argument("--instances", type=_positive_int, default=200, help="(model, cluster, workload) instances")
    gen.add_argument("--plans-per-instance", type=_positive_int, default=16)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--workers", type=_positive_int, default=2)
    gen.set_defaults(func=_dataset_generate)
    train = sub.add_parser("train", help="train the GNN; registers a new version")
    train.add_argument("--data", default=None, help="a directory from `tagplan dataset generate`")
    train.add_argument("--traces", nargs="+", default=None, metavar="BUNDLE",
                       help="instead: fine-tune the active GNN on these bundles' measured iterations; the new "
                            "version is activated only if its held-out error is lower")
    train.add_argument("--calibration", default=None, metavar="CALIB.json",
                       help="with --traces: the calibration the corrected simulator uses (default: the pinned one)")
    train.add_argument("--epochs", type=_positive_int, default=40)
    train.add_argument("--out", default="gnn-run", help="directory for model.pt and card.json")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--hidden", type=_positive_int, default=64)
    train.add_argument("--lr", type=float, default=None, help="learning rate (default: TrainConfig's)")
    train.add_argument("--no-register", action="store_true", help="do not add the checkpoint to the registry")
    train.add_argument("--activate", action="store_true", help="make the new version the active one")
    train.set_defaults(func=_train)
    models = sub.add_parser("models", help="list or activate GNN versions in the registry")
    models.add_argument("action", choices=["list", "activate"])
    models.add_argument("version", nargs="?")
    models.set_defaults(func=_models)


def _dataset_generate(args: argparse.Namespace) -> int:
    from tagplan.datasets.clusters import HELD_OUT_GPU_TYPES, TRAIN_GPU_TYPES
    from tagplan.datasets.synthetic import generate

    out = Path(args.out)
    generate(out / "train", instances=args.instances, plans_per_instance=args.plans_per_instance, seed=args.seed,
             workers=args.workers, gpu_types=TRAIN_GPU_TYPES, progress=sys.stderr.isatty())
    generate(out / "heldout_gpus", instances=max(args.instances // 4, 1), plans_per_instance=args.plans_per_instance,
             seed=args.seed + 1_000_003, workers=args.workers, gpu_types=HELD_OUT_GPU_TYPES,
             progress=sys.stderr.isatty())
    print(f"wrote {out / 'train'} and {out / 'heldout_gpus'}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from tagplan.training.registry import Registry
    from tagplan.training.train import TrainConfig, train

    if args.traces:
        return _train_traces(args)
    if not args.data:
        raise SpecError("train: give --data DIR (synthetic samples) or --traces BUNDLE... (measurements)")
    data = Path(args.data)
    if not (data / "train" / "samples.jsonl").exists():
        raise SpecError(f"--data {args.data}: no train/samples.jsonl; create it with `tagplan dataset generate`")
    config = TrainConfig(epochs=args.epochs, seed=args.seed, hidden=args.hidden,
                         **({"lr": args.lr} if args.lr is not None else {}))
    path, card = train(data, Path(args.out), config,
                       on_epoch=lambda e, t, v: print(f"epoch {e:3d}  train {t:.4f}  val mse(log) {v:.4f}",
                                                      file=sys.stderr))
    Path(args.out, "card.json").write_text(json.dumps(card, indent=2, default=str))
    summary = {split: {k: round(v, 4) for k, v in m.items()} for split, m in card["metrics"].items()}
    print(json.dumps({"checkpoint": str(path), "metrics": summary}, indent=2))
    if not args.no_register:
        version = Registry().register(path, card, activate=args.activate)
        print(f"registered as {version}" + (" (active)" if args.activate else ""))
    return 0


def _train_traces(args: argparse.Namespace) -> int:
    from tagplan.cli_traces import load_calibration_option
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.traces import finetune_on_traces

    bundles = [read_bundle(b) for b in args.traces]
    card = finetune_on_traces(bundles, Path(args.out), calibration=load_calibration_option(args.calibration),
                              register=not args.no_register)
    Path(args.out, "card.json").write_text(json.dumps(card, indent=2, default=str))
    print(json.dumps({"checkpoint": str(Path(args.out) / "model.pt"), "held_out": card["metrics"]["held_out"],
                      "version": card.get("version"), "activated": card.get("activated", False)}, indent=2))
    return 0


def _models(args: argparse.Namespace) -> int:
    from tagplan.training.registry import Registry

    registry = Registry()
    if args.action == "activate":
        if not args.version:
            raise SpecError("models activate: give a VERSION (see `tagplan models list`)")
        registry.activate(args.version)
    active = registry.active()
    rows = [{"version": v, "active": v == active, "metrics": registry.card(v).get("metrics", {})}
            for v in registry.versions()]
    print(json.dumps({"active": active, "fallback": str(registry.checkpoint(None)) if not active else None,
                      "versions": rows}, indent=2))
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="inspect the default example model and cluster")
    demo.add_argument("--model", default="gpt3-1.3b")
    demo.add_argument("--cluster", default="p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    for what, spec in (("model", args.model), ("cluster", args.cluster)):
        ns = build_parser().parse_args(["inspect", what, spec])
        ns.func(ns)
    ns = build_parser().parse_args(["plan", "--model", args.model, "--cluster", args.cluster, "--batch", "32",
                                    "--seq", "1024", "--max-evaluations", "200", "--budget-s", "20"])
    return int(ns.func(ns))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="tagplan", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_inspect(sub)
    _add_simulate(sub)
    _add_plan(sub)
    _add_learning(sub)
    _add_demo(sub)
    from tagplan.cli_traces import add_trace_commands

    add_trace_commands(sub)
    from tagplan.cli_service import add_service_commands

    add_service_commands(sub)
    from tagplan.cli_export import add_export_commands

    add_export_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.func(args))
    except SpecError as exc:
        print(f"tagplan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `tagplan ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
