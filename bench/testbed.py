"""The local testbed of real runs: small GPT and Llama plans measured on this machine's gloo processes.

Each plan (one and two processes: data, tensor and pipeline parallel, micro-batch counts, recompute,
ZeRO) is exported as a torch program, run for warm-up + timed steps by `tagplan.export.measure`, and
written as an `iteration` record to a session bundle, `bench/data/testbed/sessions/<time>/`. Run it on
an otherwise idle machine: timings of processes sharing cores with other jobs measure the scheduler.

One session is not enough on this VM: the same plan's median moves by up to 30-50% from one session
to the next (other tenants, frequency), more than the differences between many plans. So
`bench/data/testbed/` (the tagplan-traces/1 bundle that `bench/fidelity.py` and `tagplan calibrate`
read) holds, per plan, the median of the sessions' medians, rewritten after each session
(`--merge-only` rewrites it from the sessions kept). A bundle is one machine's: `bench/data/testbed/` the AMD
EPYC VM's sessions, `bench/data/testbed-intel/` (`--out`) the Intel Xeon VM's, scored apart by `bench/fidelity.py`.

Run: `.venv/bin/python bench/testbed.py [--out DIR] [--merge-only]` (about 6 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
from itertools import product
from pathlib import Path

from tagplan.datasets.traces.bundle import IterationRecord, Manifest, now_iso, read_bundle, write_bundle
from tagplan.export.checks import ExportError
from tagplan.export.measure import measure
from tagplan.frontends.cpu import cpu_cluster
from tagplan.frontends.model_spec import parse_model_spec
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, Workload
from tagplan.profiling.device import cpu_device_spec, fingerprint

MODELS = [("gpt?layers=4&hidden=128&heads=4&vocab=512&max_positions=64", 64),
          ("gpt?layers=6&hidden=192&heads=6&vocab=512&max_positions=64", 64),
          ("llama?layers=4&hidden=128&heads=4&kv_heads=2&vocab=512", 64)]
BATCH = 8
STEPS, WARMUP = 20, 3  # timed steps (median recorded) after warm-up ones; process start-up and export dominate the run


def plans(layers: int) -> list[Plan]:
    """One- and two-process plans of a model with `layers` layers (embedding and head included)."""
    out = [Plan(micro_batches=m, stages=(Stage(layers=(0, layers), devices=(0,), recompute=r),))
           for m, r in product((1, 2, 4), (False, True))]
    out += [Plan(micro_batches=m, stages=(Stage(layers=(0, layers), devices=(0, 1), dp=2, zero=z),))
            for m, z in ((1, 0), (2, 0), (1, 1))]
    out.append(Plan(micro_batches=1, stages=(Stage(layers=(0, layers), devices=(0, 1), tp=2),)))
    half = layers // 2
    out += [Plan(micro_batches=m, stages=(Stage(layers=(0, half), devices=(0,), recompute=r),
                                          Stage(layers=(half, layers), devices=(1,), recompute=r)))
            for m, r in ((2, False), (4, False), (4, True), (8, False))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "data" / "testbed"))
    parser.add_argument("--merge-only", action="store_true",
                        help="rewrite the bundle from its sessions; measure nothing")
    parser.add_argument("--device-type", default=None,
                        help="merge the sessions measured on this device type (default: the bundle's own, else "
                             "the type most sessions ran on)")
    args = parser.parse_args()
    out = Path(args.out)
    if not args.merge_only:
        session = out / "sessions" / now_iso().replace(":", "").replace("+0000", "Z")
        print(f"wrote {measure_session(session)}")
    sessions = sorted(p for p in (out / "sessions").glob("*") if p.is_dir())
    if not sessions:
        raise SystemExit(f"{out / 'sessions'}: no measured session to merge (run without --merge-only first)")
    device_type = args.device_type
    if device_type is None and (out / "manifest.json").exists():
        device_type = read_bundle(out).manifest.fingerprint.device_type
    path, merged = merge_sessions(sessions, out, device_type=device_type)
    for s in sessions:
        if s not in merged:
            print(f"not merged: {s.name} ran on {read_bundle(s).manifest.fingerprint.device_type}, not on the "
                  f"testbed's {read_bundle(path).manifest.fingerprint.device_type}", flush=True)
    print(f"wrote {path} (the median over {len(merged)} sessions)")


def measure_session(directory: Path) -> Path:
    """Measure every plan once (warm-up, then `STEPS` timed steps) into a session bundle."""
    device = cpu_device_spec(cores=1)
    records = []
    for spec_text, seq in MODELS:
        spec = parse_model_spec(spec_text)
        layers = (spec.blocks or 0) + 2
        for plan in plans(layers):
            try:
                result = measure(spec, plan, seq_len=seq, global_batch=BATCH, steps=STEPS, warmup=WARMUP)
            except ExportError as err:  # a plan the program cannot run: say so, measure the rest
                print(f"{spec_text}: skipped ({str(err).splitlines()[-1][:120]})", flush=True)
                continue
            records.append(IterationRecord(
                model=spec_text, cluster=cpu_cluster(device, len(plan.devices)),
                workload=Workload(global_batch=BATCH, seq_len=seq, dtype=DType.FP32, eager=True),
                plan=plan.model_dump(mode="json"), measured_s=result.median_s, repeats=result.steps,
                source=f"bench/testbed.py (gloo, {len(plan.devices)} processes; "
                       f"{result.min_s:.4g}-{result.max_s:.4g} s)"))
            print(f"{spec_text:55s} {len(plan.stages)} stages x{len(plan.devices)} m{plan.micro_batches}: "
                  f"{result.median_s * 1e3:.1f} ms", flush=True)
    manifest = Manifest(created=now_iso(), source="bench/testbed.py", fingerprint=fingerprint("cpu"), device=device,
                        notes=f"{len(records)} plans measured on local gloo processes (one session)")
    return write_bundle(directory, manifest, records)


def merge_sessions(sessions: list[Path], out: Path, *, device_type: str | None = None) -> tuple[Path, list[Path]]:
    """One record per plan measured in every session of one machine: the median of the sessions'
    medians (its repeats: the steps of all sessions), in the newest session's order. Only sessions
    whose fingerprint names `device_type` are merged (None: the type most sessions ran on, ties to
    the newest): a testbed is one machine, and another CPU's times are not more samples of it.
    Returns the bundle's path and the sessions merged."""
    if not sessions:
        raise SystemExit("merge_sessions: no session given (measure one with bench/testbed.py first)")
    bundles = {s: read_bundle(s) for s in sessions}
    types = [b.manifest.fingerprint.device_type for b in bundles.values()]
    if device_type is None:
        device_type = max(reversed(types), key=types.count)
    chosen = [s for s in sessions if bundles[s].manifest.fingerprint.device_type == device_type]
    if not chosen:
        raise SystemExit(f"no session ran on {device_type!r}; the sessions ran on {sorted(set(types))}")
    by_plan: dict[tuple[str, str], list[IterationRecord]] = {}
    for s in chosen:
        for record in bundles[s].iterations():
            by_plan.setdefault(plan_key(record), []).append(record)
    newest = bundles[chosen[-1]]
    merged = []
    for record in newest.iterations():
        runs = by_plan[plan_key(record)]
        if len(runs) < len(chosen):
            continue
        times = sorted(r.measured_s for r in runs)
        merged.append(record.model_copy(update={
            "measured_s": statistics.median(times), "repeats": sum(r.repeats for r in runs),
            "source": f"bench/testbed.py (gloo; median of {len(runs)} sessions' medians: "
                      + ", ".join(f"{t:.4g}" for t in times) + " s)"}))
    notes = (f"{len(merged)} plans, each the median of {len(chosen)} sessions' medians "
             f"({', '.join(s.name for s in chosen)})")
    manifest = newest.manifest.model_copy(update={"created": now_iso(), "notes": notes})
    return write_bundle(out, manifest, merged), chosen


def plan_key(record: IterationRecord) -> tuple[str, str]:
    """The plan as the current schema reads it: a session written before a field was added (a stage's `cp`,
    `recompute_layers`) names the same plan as one written after."""
    plan = Plan.model_validate(record.plan).model_dump(mode="json")
    return json.dumps(record.model, sort_keys=True), json.dumps(plan, sort_keys=True)


if __name__ == "__main__":
    main()
