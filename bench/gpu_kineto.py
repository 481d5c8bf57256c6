"""One profiled training step per case on a GPU: Kineto Chrome traces and per-kernel tables.

What a session lent a GPU runs after `bench/gpu_profile.py`: for a few of its iteration cases
(a compute-bound GPT and Llama, a host-bound Llama) it times warm-up steps, then records one step
with `torch.profiler` (CPU and CUDA activity) and writes
- `<case>.trace.json.gz`: the Chrome trace, which `tagplan traces import` reads (kineto format);
- `kernels.json`: per case, the step's wall seconds, the GPU's busy seconds (kernels, copies), the
  host's launch count, and the kernels grouped by name (count, seconds).
The numbers say where eager PyTorch spends a step that the op model does not see.

    python3 bench/gpu_kineto.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from tagplan.ir.workload import DType
from tagplan.profiling.iterations import CUDA_CASES, CUDA_LLAMA_CASES, IterationCase, training_step

CASES = {"gpt-1.3b": CUDA_CASES[15], "gpt-small-x8": CUDA_CASES[4], "llama-8b-8l": CUDA_LLAMA_CASES[0],
         "llama-small-x4": CUDA_LLAMA_CASES[11]}


def run(case: IterationCase, device: str, out: Path, name: str) -> dict[str, object]:
    cuda = device == "cuda"
    step = training_step(case, device=device, dtype=DType.BF16 if cuda else DType.FP32)
    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    trace = out / f"{name}.trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    import gzip

    with gzip.open(out / f"{name}.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace.unlink()
    kernels: dict[str, list[float]] = {}
    busy = 0.0
    launches = 0
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            busy += e.get("dur", 0) / 1e6
            kernels.setdefault(e["name"][:120], []).append(e.get("dur", 0) / 1e6)
        elif e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", ""):
            launches += 1
    top = sorted(((k, len(v), sum(v)) for k, v in kernels.items()), key=lambda t: -t[2])
    return {"case": case.spec, "seq_len": case.seq_len, "global_batch": case.global_batch,
            "micro_batches": case.micro_batches, "wall_s": wall, "device_busy_s": busy, "launches": launches,
            "kernel_count": sum(len(v) for v in kernels.values()),
            "kernels": [{"name": k, "count": n, "seconds": s} for k, n, s in top[:60]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU (checks the code path)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    cases = {"tiny": IterationCase(2, 64, 4, 128, 16, 4, 2, False, "llama", 2, 96)} if args.smoke else CASES
    table = {}
    for name, case in cases.items():
        table[name] = run(case, device, args.out, name)
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{name}: wall {table[name]['wall_s'] * 1e3:.1f} ms, device busy {table[name]['device_busy_s'] * 1e3:.1f}"
              f" ms, {table[name]['launches']} launches, {table[name]['kernel_count']} kernels", flush=True)
    (args.out / "kernels.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
