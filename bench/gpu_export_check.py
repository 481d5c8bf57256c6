"""Run tagplan's exported torch program on one GPU and time it: the runtime the planner's plans export to,
measured as `bench/gpu_profile.py` measures the eager reference model of the same shape.

Each case is a one-device plan of a gpt or llama SPEC, written by `export.torch_program` in bf16 autocast
and run by `export.measure` (one rank; NCCL on a GPU host). The records go into an `iterations-export`
bundle (same record kind as the other GPU iterations), each with the workload as the torch program runs
it (`export.capability.runtime_workload`: fp32 gradient reduction, fused SwiGLU), for scoring with the
calibration fitted on the eager iterations (the exported program held out; `bench/fidelity.py` does
not read this bundle yet).

    python3 bench/gpu_export_check.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tagplan.datasets.traces.bundle import IterationRecord, Manifest, now_iso, write_bundle
from tagplan.export.capability import runtime_workload
from tagplan.export.checks import ExportError
from tagplan.export.measure import measure
from tagplan.frontends.cpu import cpu_cluster, gpu_cluster
from tagplan.frontends.model_spec import load_model, parse_model_spec
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, Optimizer, Workload
from tagplan.profiling.device import cpu_device_spec, cuda_device_spec, fingerprint

CASES = (  # (SPEC, seq, global batch, micro-batches, recompute)
    ("gpt?layers=24&hidden=2048&heads=16&vocab=50304", 2048, 8, 1, False),
    ("gpt?layers=24&hidden=2048&heads=16&vocab=50304", 2048, 8, 2, False),
    ("gpt?layers=24&hidden=2048&heads=16&vocab=50304", 2048, 16, 4, True),
    ("gpt?layers=12&hidden=768&heads=12&vocab=50304", 1024, 32, 4, False),
    ("gpt?layers=24&hidden=1024&heads=16&vocab=50304", 1024, 16, 2, False),
    ("llama?layers=16&hidden=2048&heads=32&kv_heads=8&ffn=8192&vocab=128256", 2048, 8, 2, False),
    ("llama?layers=16&hidden=2048&heads=32&kv_heads=8&ffn=8192&vocab=128256", 2048, 8, 2, True),
    ("llama?layers=12&hidden=768&heads=12&kv_heads=4&ffn=2048&vocab=32000", 1024, 16, 4, False),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="a tiny gpt on the CPU in fp32 (checks the code path)")
    args = parser.parse_args()
    cuda = not args.smoke
    spec = cuda_device_spec() if cuda else cpu_device_spec(cores=1)
    dtype = DType.BF16 if cuda else DType.FP32
    cases = CASES if cuda else (("gpt?layers=2&hidden=64&heads=2&vocab=256", 32, 4, 2, True),)
    records = []
    for text, seq, batch, micro, recompute in cases:
        layers = len(load_model(text, seq_len=seq).layers)
        plan = Plan(micro_batches=micro, stages=(Stage(layers=(0, layers), devices=(0,), recompute=recompute),))
        started = time.perf_counter()
        try:
            result = measure(text, plan, seq_len=seq, global_batch=batch, steps=5, warmup=2, dtype=dtype,
                             device="cuda" if cuda else "cpu", timeout_s=90)
        except ExportError as error:  # one case that fails (out of memory on a smaller GPU) leaves the others
            print(f"{text} seq {seq} batch {batch} x{micro}: failed: {error}", flush=True)
            continue
        peak = f", peak {result.peak_memory_bytes / 2**30:.1f} GiB" if result.peak_memory_bytes else ""
        print(f"{text} seq {seq} batch {batch} x{micro}{' recompute' if recompute else ''}: "
              f"{result.median_s * 1e3:.1f} ms ({result.min_s * 1e3:.1f}-{result.max_s * 1e3:.1f}){peak}; "
              f"{time.perf_counter() - started:.0f} s with start-up", flush=True)
        workload = runtime_workload("torch", Workload(global_batch=batch, seq_len=seq, dtype=dtype,
                                                      optimizer=Optimizer.ADAM), parse_model_spec(text))
        records.append(IterationRecord(model=text, cluster=gpu_cluster(spec) if cuda else cpu_cluster(spec),
                                       workload=workload, plan=plan.model_dump(mode="json"),
                                       measured_s=result.median_s, repeats=result.steps,
                                       peak_memory_bytes=result.peak_memory_bytes,
                                       source=f"tagplan exported torch program ({dtype.value} autocast, one rank; "
                                              f"steps {result.min_s:.4g}-{result.max_s:.4g} s)"))
        manifest = Manifest(created=now_iso(), source="bench/gpu_export_check.py", fingerprint=fingerprint(
            "cuda" if cuda else "cpu"), device=spec, notes=f"{len(records)} one-device plans run by the exported "
                            "torch program (export.measure), median of 5 steps after 2 warm-up")
        write_bundle(args.out / "iterations-export", manifest, records)  # after each case: a cut-off run keeps some


if __name__ == "__main__":
    main()
