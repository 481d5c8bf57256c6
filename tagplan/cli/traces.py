"""`tagplan profile`, `tagplan traces import|show`, `tagplan calibrate`: measurements into the cost model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tagplan.cli.options import Subparsers, add_json_option, emit, folds_count, output_file, positive_int
from tagplan.errors import SpecError
from tagplan.ir.workload import DType

IMPORT_FORMATS = ("auto", "generic", "metis", "galvatron", "kineto", "nccl-tests", "iterations")
"""`traces import --format` choices: auto detects each file's kind; generic is the layer table."""


LAYER_OPTIONS: dict[str, str | int | None] = {"model": None, "seq": 128, "micro_batches": "1,2,4", "tps": "1,2"}
"""`profile --layers`' own options and their defaults: given without --layers, each is refused, not ignored."""


def add_trace_commands(sub: Subparsers) -> None:
    """Add `profile`, `traces` and `calibrate` to the `tagplan` parser."""
    prof = sub.add_parser("profile", help="measure this machine's ops and collectives into a trace bundle")
    prof.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    prof.add_argument("--quick", action="store_true", help="a small grid (under 2 minutes on 2 CPU cores)")
    prof.add_argument("--world", type=positive_int, default=None,
                      help="processes for the collectives (default 2 on CPU)")
    prof.add_argument("--threads", type=positive_int, default=None,
                      help="torch threads for the ops (default: the idle cores, at least 1)")
    prof.add_argument("--iterations", action="store_true",
                      help="also time real training iterations of GPTs on one device (CPU: small shapes, about "
                           "a minute; CUDA: GPT-2 small to 2.7B shapes, a few minutes)")
    prof.add_argument("--layers", action="store_true",
                      help="instead: time the unique blocks of --model over micro-batch sizes and tp degrees")
    prof.add_argument("--model", default=LAYER_OPTIONS["model"],
                      help="with --layers: the model SPEC (gpt?... or llama?...)")
    prof.add_argument("--seq", type=positive_int, default=LAYER_OPTIONS["seq"], help="with --layers: sequence length")
    prof.add_argument("--micro-batches", default=LAYER_OPTIONS["micro_batches"],
                      help="with --layers: micro-batch sizes, comma-separated")
    prof.add_argument("--tps", default=LAYER_OPTIONS["tps"], help="with --layers: tp degrees, comma-separated")
    prof.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                      help="precision of --layers and --iterations (default fp32 on CPU, bf16 on CUDA; "
                           "bf16/fp16 iterations are mixed precision: fp32 weights and Adam states)")
    prof.add_argument("--out", required=True, help="bundle directory to write")
    add_json_option(prof, "{bundle, op_records, collective_records, iteration_records, layer_records}")
    prof.set_defaults(func=_profile)

    traces = sub.add_parser("traces", help="import traces machines already print; show a bundle")
    what = traces.add_subparsers(dest="what", required=True)
    imp = what.add_parser("import", help="Kineto/torch.profiler JSON, nccl-tests logs, iteration records, "
                          "layer tables, Metis and Galvatron profiles")
    imp.add_argument("files", nargs="+")
    imp.add_argument("--device", required=True, help="device type the traces were measured on (catalog name)")
    imp.add_argument("--format", default="auto", choices=IMPORT_FORMATS,
                     help="what the files are (default: told by content; generic = a layer table)")
    imp.add_argument("--model", default=None, help="for layer tables, Metis and Galvatron profiles: the model SPEC "
                     "whose blocks their layers are")
    imp.add_argument("--seq", type=positive_int, default=None,
                     help="for Metis profiles: the sequence length they were measured at (the files do not say)")
    imp.add_argument("--dtype", default=None, choices=[d.value for d in DType],
                     help="for Metis and Galvatron profiles whose file does not state the precision (default bf16)")
    imp.add_argument("--out", required=True, help="bundle directory (created, or appended to)")
    add_json_option(imp, "{bundle, op_records, collective_records, iteration_records, layer_records}")
    imp.set_defaults(func=_traces_import)
    show = what.add_parser("show", help="what a bundle holds")
    show.add_argument("bundle")
    add_json_option(show, "{bundle, manifest, op_records, collective_records, iteration_records, layer_records}")
    show.set_defaults(func=_traces_show)

    cal = sub.add_parser("calibrate", help="fit the cost model to trace bundles; report held-out error")
    cal.add_argument("bundles", nargs="+")
    cal.add_argument("--out", required=True, type=output_file, metavar="CALIB.json")
    cal.add_argument("--pin", default=None, metavar="VERSION",
                     help="also pin the calibration beside this GNN version in the registry")
    cal.add_argument("--device", default=None,
                     help="device type the bundles should have measured; warns on records that disagree")
    cal.add_argument("--folds", type=folds_count, default=None, help="cross-validation folds over iteration "
                     "records, at least 2 (default min(5, records))")
    cal.add_argument("--no-iterations", action="store_true", help="fit ops and links only")
    cal.add_argument("--force", action="store_true",
                     help="write the calibration even when its held-out error is worse than what it replaces")
    add_json_option(cal, "the error report")
    cal.set_defaults(func=_calibrate)


def _profile(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.profiling import profile

    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.layers:
        return _profile_layers(args, say)
    for name, default in LAYER_OPTIONS.items():  # --layers' own options (--dtype is shared)
        given = getattr(args, name)
        if given != default:
            raise SpecError(f"--{name.replace('_', '-')} {given} is an option of --layers, which profiles a model's "
                            "blocks; without --layers, profile measures ops and collectives (add --layers)")
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
        from tagplan.profiling.iterations import (
            CUDA_CASES,
            QUICK_CASES,
            IterationCase,
            iteration_records,
            out_of_memory_note,
        )

        bundle = read_bundle(out)
        spec = bundle.manifest.device
        if spec is None:
            raise SpecError(f"{out}: the profile wrote no device figures; cannot describe the measured cluster")
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        skipped: list[IterationCase] = []  # a GPU smaller than the cases were sized on runs the rest
        try:
            cases = CUDA_CASES if args.device == "cuda" else QUICK_CASES
            measured = list(iteration_records(spec, cases, device=args.device, dtype=_dtype(args), progress=say,
                                              out_of_memory=skipped))
        finally:
            torch.set_num_threads(before)
        manifest = bundle.manifest.model_copy(update={"source": bundle.manifest.source + " --iterations",
                                                      "notes": bundle.manifest.notes + out_of_memory_note(skipped)})
        write_bundle(out, manifest, (*bundle.records, *measured))
    _emit_counts(str(out), read_bundle(out), args.json)
    return 0


def _dtype(args: argparse.Namespace) -> DType:
    """--dtype, else fp32 on the CPU and bf16 on a GPU."""
    return DType(args.dtype or ("fp32" if args.device == "cpu" else "bf16"))


def _profile_layers(args: argparse.Namespace, say: Any) -> int:
    """`profile --layers`: a bundle of layer records of --model measured on this device."""
    from tagplan.datasets.traces.bundle import Manifest, now_iso, read_bundle, write_bundle
    from tagplan.profiling.device import cpu_device_spec, cuda_device_spec, fingerprint
    from tagplan.profiling.layers import layer_records

    if not args.model:
        raise SpecError("profile --layers: give --model SPEC (the model whose blocks to time)")
    try:
        sizes = [int(v) for v in args.micro_batches.split(",") if v]
        tps = [int(v) for v in args.tps.split(",") if v]
    except ValueError:
        raise SpecError(f"profile --layers: --micro-batches {args.micro_batches!r} and --tps {args.tps!r} must be "
                        "comma-separated integers") from None
    spec = cpu_device_spec() if args.device == "cpu" else cuda_device_spec()
    records = list(layer_records(args.model, device=args.device, device_type=spec.name, seq_len=args.seq,
                                 dtype=_dtype(args), micro_batches=sizes, tps=tps, progress=say))
    manifest = Manifest(created=now_iso(), source=f"tagplan profile --layers --model {args.model} --seq {args.seq}",
                        fingerprint=fingerprint(args.device), device=spec,
                        notes=f"layer profile: micro-batches {sizes}, tp {tps}")
    out = write_bundle(args.out, manifest, records)
    _emit_counts(str(out), read_bundle(out), args.json)
    return 0


def _traces_import(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.datasets.traces.importing import import_to_bundle

    out = import_to_bundle([Path(f) for f in args.files], Path(args.out), device=args.device,
                           source="tagplan traces import " + " ".join(args.files),
                           warn=lambda line: print(f"warning: {line}", file=sys.stderr), model=args.model,
                           kind=None if args.format == "auto" else args.format, seq_len=args.seq, dtype=args.dtype)
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
               "collective_records": len(bundle.collectives()), "iteration_records": len(bundle.iterations()),
               "layer_records": len(bundle.layers())}
    emit(summary, as_json, bundle_line)


def _calibrate(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import calibration_table
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.calibrate import calibrated_devices, compare_with, fingerprint_warnings, fit_calibration

    bundles = [read_bundle(b) for b in args.bundles]
    if args.device:
        from tagplan.datasets.traces.importing import catalog_name

        for line in fingerprint_warnings(bundles, catalog_name(args.device, None)):
            print(f"warning: {line}", file=sys.stderr)
    out = Path(args.out)
    fit = fit_calibration(bundles, name=out.stem, iterations=not args.no_iterations, folds=args.folds)
    replaced_name, replaced = _replaced_calibration(out, args.pin)
    comparison = compare_with(fit, replaced, bundles)
    report: dict[str, Any] = {"calibration": args.out, **fit.summary(), "rows": [row.__dict__ for row in fit.rows],
                              "links": {k: v.model_dump() for k, v in fit.calibration.links.items()}}
    report["layer_records"] = sum(len(b.layers()) for b in bundles)  # taken as measured; the table's caption says so
    cal = fit.calibration
    if (cal.causal_time_fraction, cal.causal_diagonal_tokens) != (1.0, 0.0):  # fitted from causal and unmasked pairs
        report["causal_attention"] = {"time_fraction": cal.causal_time_fraction,
                                      "diagonal_tokens": cal.causal_diagonal_tokens}
    if fit.iterations is not None:
        report["iteration_parameters"] = fit.iterations.parameters
        report["iteration_records"] = fit.iterations.records
    if comparison is not None:
        report["held_out"] = {"metric": comparison.metric, "new": comparison.new, "replaced": comparison.replaced,
                              "replaced_calibration": replaced_name}
    if not args.json:
        _say_iterations(fit, comparison, replaced_name)
    unchecked = comparison is None and any(b.iterations() or b.layers() for b in bundles)
    overwritten = out.is_file() or args.pin is not None  # a calibration in the registry is not replaced otherwise
    lost = calibrated_devices(replaced) - calibrated_devices(cal) if overwritten else set()
    refusal = _write_refusal(comparison, replaced_name, lost, unchecked=unchecked)
    if refusal and not args.force:
        raise SpecError(f"calibrate: {args.out} not written: {refusal}; pass --force to write it anyway")
    if args.pin:
        from tagplan.training.registry import Registry

        Registry().card(args.pin)  # SpecError for an unknown version, before --out is replaced
    out.write_text(fit.calibration.model_dump_json(indent=2) + "\n")
    if args.pin:
        Registry().pin_calibration(args.pin, out)
    emit(report, args.json, calibration_table)
    return 0


def _write_refusal(comparison: Any, replaced_name: str, lost: set[tuple[str, str]], *,
                   unchecked: bool = False) -> str | None:
    """Why a new calibration may not replace the old one unasked (None: it may): no held-out error checks what it
    fitted from iteration or layer records (`unchecked`; a link fit from nccl-tests logs reports its own held-out
    sizes), it is worse on held-out records, or it drops device types the file or pin it overwrites calibrated."""
    if unchecked:
        return ("the bundles give no held-out error to check it against "
                f"{replaced_name} (cross-validation needs at least 2 iteration records, or op records at held-out "
                "shapes; layer records are used as measured and not held out), so it could make predictions "
                "worse unnoticed")
    if comparison is not None and comparison.worse:
        return (f"the new calibration's held-out {comparison.metric} is {comparison.new:.1%}, worse than the "
                f"{comparison.replaced:.1%} of {replaced_name}, which it would replace")
    if lost:
        shown = ", ".join(f"{what} of {device}" for what, device in sorted(lost, key=lambda p: (p[1], p[0]))[:8])
        return (f"{replaced_name} also holds {shown}{', ...' if len(lost) > 8 else ''}, which these bundles do not "
                "measure: the new file would drop them (calibrate all the bundles together, or write it to a new "
                "--out)")
    return None


def _replaced_calibration(out: Path, pin: str | None) -> tuple[str, Any]:
    """(name, calibration) a new one replaces: the file at --out, else the pinned one, else the defaults."""
    from tagplan.cost.calibration import DEFAULT_CALIBRATION
    from tagplan.training.calibrations import load_calibration, resolve_calibration
    from tagplan.training.registry import Registry

    if out.is_file():
        try:
            return f"the existing {out}", load_calibration(out)
        except SpecError as err:
            print(f"warning: {err}; comparing with the shipped defaults", file=sys.stderr)
            return "the shipped defaults", DEFAULT_CALIBRATION
    try:
        pinned = resolve_calibration(pin, Registry(), allow_paths=False)
    except SpecError:
        pinned = DEFAULT_CALIBRATION
    if pinned is DEFAULT_CALIBRATION:
        return "the shipped defaults", DEFAULT_CALIBRATION
    return f"the calibration pinned {'beside ' + pin if pin else 'in the registry'}", pinned


def _say_iterations(fit: Any, comparison: Any, replaced_name: str) -> None:
    """Held-out iteration error before and after, and the comparison, for people (stderr)."""
    it = fit.iterations
    if it is not None:
        tau = lambda t: "-" if t is None else f"{t:.2f}"  # noqa: E731
        print(f"iterations: {it.records} records, {it.folds}-fold held out: MAPE {it.before.mape:.1%} -> "
              f"{it.after.mape:.1%}, Kendall tau {tau(it.before.kendall_tau)} -> {tau(it.after.kendall_tau)}",
              file=sys.stderr)
        shown = ", ".join(f"{k} {v:.4g}" for k, v in it.parameters.items())
        print(f"fitted parameters: {shown or 'none the records inform'}", file=sys.stderr)
    if comparison is not None:
        print(f"held-out {comparison.metric}: new {comparison.new:.1%}, {replaced_name} {comparison.replaced:.1%}",
              file=sys.stderr)
