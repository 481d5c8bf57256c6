"""`tagplan profile`, `tagplan traces import`, `tagplan calibrate`: measurements into the cost model.

Kept apart from `cli.py` so that the planning commands do not grow with the measurement ones;
`cli.build_parser` adds these through `add_trace_commands`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError


def add_trace_commands(sub: argparse._SubParsersAction) -> None:
    """Add `profile`, `traces` and `calibrate` to the `tagplan` parser."""
    prof = sub.add_parser("profile", help="measure this machine's ops and collectives into a trace bundle")
    prof.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    prof.add_argument("--quick", action="store_true", help="a small grid (under 2 minutes on 2 CPU cores)")
    prof.add_argument("--world", type=int, default=None, help="processes for the collectives (default 2 on CPU)")
    prof.add_argument("--threads", type=int, default=None,
                      help="torch threads for the ops (default: the idle cores, at least 1)")
    prof.add_argument("--iterations", action="store_true",
                      help="also time real training iterations of small GPTs (CPU, one device; about a minute)")
    prof.add_argument("--out", required=True, help="bundle directory to write")
    prof.set_defaults(func=_profile)

    traces = sub.add_parser("traces", help="import traces machines already print; show a bundle")
    what = traces.add_subparsers(dest="what", required=True)
    imp = what.add_parser("import", help="Kineto/torch.profiler JSON, nccl-tests logs, iteration records")
    imp.add_argument("files", nargs="+")
    imp.add_argument("--device", required=True, help="device type the traces were measured on (catalog name)")
    imp.add_argument("--out", required=True, help="bundle directory (created, or appended to)")
    imp.set_defaults(func=_traces_import)
    show = what.add_parser("show", help="what a bundle holds")
    show.add_argument("bundle")
    show.set_defaults(func=_traces_show)

    cal = sub.add_parser("calibrate", help="fit the cost model to trace bundles; report held-out error")
    cal.add_argument("bundles", nargs="+")
    cal.add_argument("--out", required=True, metavar="CALIB.json")
    cal.add_argument("--pin", default=None, metavar="VERSION",
                     help="also pin the calibration beside this GNN version in the registry")
    cal.add_argument("--json", action="store_true", help="the error report as JSON on stdout")
    cal.set_defaults(func=_calibrate)


def _profile(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.profiling import profile

    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.iterations and args.device != "cpu":
        raise SpecError("--iterations: real iterations are timed on the CPU only (--device cpu)")
    threads = args.threads
    if args.iterations and threads is None:  # the iterations must run on the cores the device figures count
        import torch

        from tagplan.profiling.device import idle_cores

        threads = min(torch.get_num_threads(), idle_cores())
    out = profile(Path(args.out), device=args.device, quick=args.quick, world=args.world, threads=threads,
                  progress=say)
    if args.iterations:
        import torch

        from tagplan.datasets.traces.bundle import write_bundle
        from tagplan.profiling.iterations import iteration_records

        bundle = read_bundle(out)
        spec = bundle.manifest.device
        if spec is None:
            raise SpecError(f"{out}: the profile wrote no device figures; cannot describe the measured cluster")
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            measured = list(iteration_records(spec, progress=say))
        finally:
            torch.set_num_threads(before)
        manifest = bundle.manifest.model_copy(update={"source": bundle.manifest.source + " --iterations"})
        write_bundle(out, manifest, (*bundle.records, *measured))
    print(json.dumps({"bundle": str(out), **_counts(read_bundle(out))}, indent=2))
    return 0


def _traces_import(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.datasets.traces.importing import import_to_bundle

    out = import_to_bundle([Path(f) for f in args.files], Path(args.out), device=args.device,
                           source="tagplan traces import " + " ".join(args.files))
    print(json.dumps({"bundle": str(out), **_counts(read_bundle(out))}, indent=2))
    return 0


def _traces_show(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle

    bundle = read_bundle(args.bundle)
    print(json.dumps({"manifest": bundle.manifest.model_dump(mode="json"), **_counts(bundle)}, indent=2))
    return 0


def _counts(bundle: Any) -> dict[str, int]:
    return {"op_records": len(bundle.ops()), "collective_records": len(bundle.collectives()),
            "iteration_records": len(bundle.iterations())}


def _calibrate(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.calibrate import fit_calibration

    bundles = [read_bundle(b) for b in args.bundles]
    fit = fit_calibration(bundles, name=Path(args.out).stem)
    Path(args.out).write_text(fit.calibration.model_dump_json(indent=2) + "\n")
    if args.pin:
        from tagplan.training.registry import Registry

        Registry().pin_calibration(args.pin, Path(args.out))
    report = {"calibration": args.out, **fit.summary(),
              "rows": [row.__dict__ for row in fit.rows],
              "links": {k: v.model_dump() for k, v in fit.calibration.links.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.table import Table

    from tagplan.cli import _console

    table = Table(title=f"held-out error of the simulator's op and collective times ({args.out})")
    for column in ("device", "what", "fitted on", "held out", "MAPE before", "MAPE after"):
        table.add_column(column, justify="right" if column not in ("device", "what") else "left")
    for row in fit.rows:
        before = "-" if row.mape_before is None else f"{row.mape_before:.1%}"
        table.add_row(row.device, row.what, str(row.fitted_on), str(row.held_out), before, f"{row.mape_after:.1%}")
    _console().print(table)
    summary = fit.summary()
    if summary["ops_mape_before"] is not None:
        print(f"ops, all held out: MAPE {summary['ops_mape_before']:.1%} before -> "
              f"{summary['ops_mape_after']:.1%} after")
    return 0


def load_calibration_option(path: str | None) -> Any:
    """The calibration a command should use: `--calibration FILE`, else the one pinned beside the
    registry's active GNN version, else the shipped defaults."""
    from tagplan.cost.calibration import DEFAULT_CALIBRATION, load_calibration

    if path:
        return load_calibration(path)
    from tagplan.training.registry import Registry

    pinned = Registry().calibration_path()
    if pinned is None:
        return DEFAULT_CALIBRATION
    try:
        return load_calibration(pinned)
    except SpecError as err:
        raise SpecError(f"the calibration pinned in the registry is unreadable: {err}") from None
