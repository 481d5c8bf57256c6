"""`tagplan profile`, `tagplan traces import|show`, `tagplan calibrate`: measurements into the cost model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tagplan.cli.options import Subparsers, add_json_option, emit
from tagplan.errors import SpecError


def add_trace_commands(sub: Subparsers) -> None:
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
    add_json_option(prof, "{bundle, op_records, collective_records, iteration_records}")
    prof.set_defaults(func=_profile)

    traces = sub.add_parser("traces", help="import traces machines already print; show a bundle")
    what = traces.add_subparsers(dest="what", required=True)
    imp = what.add_parser("import", help="Kineto/torch.profiler JSON, nccl-tests logs, iteration records")
    imp.add_argument("files", nargs="+")
    imp.add_argument("--device", required=True, help="device type the traces were measured on (catalog name)")
    imp.add_argument("--out", required=True, help="bundle directory (created, or appended to)")
    add_json_option(imp, "{bundle, op_records, collective_records, iteration_records}")
    imp.set_defaults(func=_traces_import)
    show = what.add_parser("show", help="what a bundle holds")
    show.add_argument("bundle")
    add_json_option(show, "{bundle, manifest, op_records, collective_records, iteration_records}")
    show.set_defaults(func=_traces_show)

    cal = sub.add_parser("calibrate", help="fit the cost model to trace bundles; report held-out error")
    cal.add_argument("bundles", nargs="+")
    cal.add_argument("--out", required=True, metavar="CALIB.json")
    cal.add_argument("--pin", default=None, metavar="VERSION",
                     help="also pin the calibration beside this GNN version in the registry")
    add_json_option(cal, "the error report")
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
    _emit_counts(str(out), read_bundle(out), args.json)
    return 0


def _traces_import(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.datasets.traces.importing import import_to_bundle

    out = import_to_bundle([Path(f) for f in args.files], Path(args.out), device=args.device,
                           source="tagplan traces import " + " ".join(args.files))
    _emit_counts(str(out), read_bundle(out), args.json)
    return 0


def _traces_show(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle

    bundle = read_bundle(args.bundle)
    _emit_counts(str(args.bundle), bundle, args.json, manifest=bundle.manifest.model_dump(mode="json"))
    return 0


def _emit_counts(path: str, bundle: Any, as_json: bool, **extra: Any) -> None:
    """A bundle's record counts, as JSON or one line for people."""
    from tagplan.cli.tables import bundle_line

    summary = {"bundle": path, **extra, "op_records": len(bundle.ops()),
               "collective_records": len(bundle.collectives()), "iteration_records": len(bundle.iterations())}
    emit(summary, as_json, bundle_line)


def _calibrate(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import calibration_table
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
    emit(report, args.json, calibration_table)
    return 0
