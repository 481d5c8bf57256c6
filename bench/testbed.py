"""The local testbed of real runs: small GPT and Llama plans measured on this machine's gloo processes.

Each plan (one and two processes: data, tensor and pipeline parallel, micro-batch counts, recompute,
ZeRO) is exported as a torch program, run for warm-up + timed steps by `tagplan.export.measure`, and
appended as an `iteration` record to `bench/data/testbed/` (a tagplan-traces/1 bundle that
`bench/fidelity.py` and `tagplan calibrate` read). Run it on an otherwise idle machine: timings of
processes sharing cores with other jobs measure the scheduler.

Run: `.venv/bin/python bench/testbed.py [--out DIR]` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
from itertools import product
from pathlib import Path

from tagplan.datasets.traces.bundle import IterationRecord, Manifest, now_iso, write_bundle
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
    args = parser.parse_args()
    device = cpu_device_spec(cores=1)
    records = []
    for spec_text, seq in MODELS:
        spec = parse_model_spec(spec_text)
        layers = (spec.blocks or 0) + 2
        for plan in plans(layers):
            try:
                result = measure(spec, plan, seq_len=seq, global_batch=BATCH, steps=5, warmup=2)
            except ExportError as err:  # a plan the program cannot run: say so, measure the rest
                print(f"{spec_text}: skipped ({str(err).splitlines()[-1][:120]})", flush=True)
                continue
            records.append(IterationRecord(
                model=spec_text, cluster=cpu_cluster(device, len(plan.devices)),
                workload=Workload(global_batch=BATCH, seq_len=seq, dtype=DType.FP32),
                plan=plan.model_dump(mode="json"), measured_s=result.median_s, repeats=result.steps,
                source=f"bench/testbed.py (gloo, {len(plan.devices)} processes; "
                       f"{result.min_s:.4g}-{result.max_s:.4g} s)"))
            print(f"{spec_text:55s} {len(plan.stages)} stages x{len(plan.devices)} m{plan.micro_batches}: "
                  f"{result.median_s * 1e3:.1f} ms", flush=True)
    manifest = Manifest(created=now_iso(), source="bench/testbed.py", fingerprint=fingerprint("cpu"), device=device,
                        notes=f"{len(records)} plans measured on local gloo processes")
    print(f"wrote {write_bundle(args.out, manifest, records)} ({len(records)} records)")


if __name__ == "__main__":
    main()
