"""`tagplan export` and `tagplan verify`: a plan as a program, and proof that it runs as planned."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tagplan.errors import SpecError


def add_export_commands(sub: argparse._SubParsersAction) -> None:
    """Add `export` and `verify` to the `tagplan` parser."""
    exp = sub.add_parser("export", help="write a plan as a torch program, Megatron-LM arguments or a DeepSpeed config")
    exp.add_argument("--model", required=True, help="model SPEC")
    exp.add_argument("--cluster", default=None, help="cluster SPEC (checked against the plan's devices)")
    exp.add_argument("--plan", required=True, help="a Plan JSON file")
    exp.add_argument("--format", choices=["torch", "megatron", "deepspeed"], default="torch", dest="fmt")
    exp.add_argument("--batch", type=int, default=8, help="global batch in samples")
    exp.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the model's)")
    exp.add_argument("--out", required=True, help="directory to write")
    exp.set_defaults(func=_export)

    ver = sub.add_parser("verify", help="run the exported plan on CPU (gloo) on a scaled-down model and check it "
                                        "against a one-process reference")
    ver.add_argument("--model", required=True, help="model SPEC (scaled down, same family and layer count)")
    ver.add_argument("--plan", required=True, help="a Plan JSON file")
    ver.add_argument("--procs", type=int, default=None, help="local processes (default: the plan's devices)")
    ver.add_argument("--calibration", default=None, metavar="CALIB.json",
                     help="CPU calibration for the predicted step time (from `tagplan calibrate`)")
    ver.add_argument("--json", action="store_true")
    ver.set_defaults(func=_verify)


def _export(args: argparse.Namespace) -> int:
    from tagplan.cost.plan_file import load_plan
    from tagplan.export import export

    plan = load_plan(args.plan)
    cluster = None
    if args.cluster:
        from tagplan.frontends.cluster_spec import load_cluster

        cluster = load_cluster(args.cluster)
    written = export(args.model, plan, Path(args.out), fmt=args.fmt, seq_len=args.seq, global_batch=args.batch,
                     cluster=cluster)
    print(json.dumps({"format": args.fmt, "files": [str(p) for p in written]}, indent=2))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tagplan.cost.plan_file import load_plan
    from tagplan.export.verify import predicted_vs_measured, verify

    plan = load_plan(args.plan)
    report = verify(args.model, plan, procs=args.procs)
    out = {k: v for k, v in dataclasses.asdict(report).items() if k != "plan"}
    if report.passed:
        try:
            out["predicted_vs_measured"] = dataclasses.asdict(
                predicted_vs_measured(report, calibration=args.calibration))
        except (SpecError, ValueError) as err:
            out["predicted_vs_measured"] = {"error": str(err)}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        verdict = "PASSED" if report.passed else "FAILED"
        print(f"verify {verdict}: {report.message}")
        loss = "none" if report.loss is None else f"{report.loss:.6g}"
        print(f"  loss {loss} vs one-process reference {report.reference_loss:.6g}; "
              f"max |error| {report.max_abs_error:.3g}, max relative {report.max_rel_error:.3g} "
              f"(worst: {report.worst_parameter})")
        for rank, seconds in sorted(report.step_time_s.items()):
            print(f"  rank {rank} (stages {report.rank_stages.get(rank, ())}): {seconds * 1e3:.1f} ms per step")
        pvm = out.get("predicted_vs_measured", {})
        if "ratio" in pvm:
            print(f"  measured {pvm['measured_s'] * 1e3:.1f} ms vs predicted {pvm['predicted_s'] * 1e3:.1f} ms "
                  f"(ratio {pvm['ratio']:.2f})")
    if not report.passed:
        print(f"tagplan verify: FAILED: {report.message}", file=sys.stderr)
        return 1
    return 0
