"""Measure one GPU into trace bundles: real bf16 training iterations (GPT, Llama), an op grid, layer profiles.

What a session lent a GPU runs (one call, a few minutes): the bundles are committed under
`bench/data/gpu/<device>/` and scored by `bench/fidelity.py --only gpu` against the simulator.

    python3 bench/gpu_profile.py --out DIR            # on the GPU machine, every part
    python3 bench/gpu_profile.py --out DIR --only llama,repeat
    python3 bench/gpu_profile.py --out DIR --smoke    # a tiny CPU run of the same code path

It imports only tagplan's measuring layers (torch, numpy, pydantic, pyyaml), so it runs under the
GPU image's Python with pydantic carried as wheels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tagplan.datasets.traces.bundle import Manifest, now_iso, write_bundle
from tagplan.ir.workload import DType
from tagplan.profiling.device import cpu_device_spec, cuda_device_spec, fingerprint
from tagplan.profiling.grids import op_grid
from tagplan.profiling.iterations import (
    CUDA_CASES,
    CUDA_LLAMA_CASES,
    QUICK_CASES,
    IterationCase,
    iteration_records,
    out_of_memory_note,
)
from tagplan.profiling.layers import layer_records
from tagplan.profiling.machine import profile

OUT_OF_MEMORY_FILE = "out-of-memory.json"
"""Beside an iteration bundle: the cases (`IterationCase` fields) the GPU ran out of memory on."""

LAYER_MODELS = {
    "gpt?layers=24&hidden=2048&heads=16&vocab=50304": 2048,
    "llama?layers=32&hidden=4096&heads=32&kv_heads=8&ffn=14336&vocab=128256": 4096,
}
"""Models whose unique blocks are timed, with their sequence length (GPT 1.3B, Llama-3-8B)."""


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny cases on the CPU (checks the code path)")
    parser.add_argument("--only", default="iterations,ops,layers,llama,repeat",
                        help="comma-separated parts: iterations (GPT), llama (Llama iterations), repeat (every "
                             "third GPT case again: the run-to-run spread), ops, layers")
    args = parser.parse_args()
    parts = set(filter(None, args.only.split(",")))
    device = "cpu" if args.smoke else "cuda"
    spec = cpu_device_spec() if args.smoke else cuda_device_spec()
    dtype = DType.FP32 if args.smoke else DType.BF16
    say(f"device {spec.name}")
    iteration_parts: dict[str, tuple[str, tuple[IterationCase, ...]]] = {
        "iterations": ("iterations", CUDA_CASES), "llama": ("iterations-llama", CUDA_LLAMA_CASES),
        "repeat": ("iterations-repeat", CUDA_CASES[::3])}
    for part, (folder, cases) in iteration_parts.items():
        if part not in parts:
            continue
        if args.smoke:
            cases = (IterationCase(2, 64, 4, 128, 16, 4, 2, True, "llama", 2, 96),) if part == "llama" else \
                QUICK_CASES[:2]
        skipped: list[IterationCase] = []
        records = list(iteration_records(spec, cases, device=device, dtype=dtype, progress=say,
                                         out_of_memory=skipped))
        manifest = Manifest(created=now_iso(), source=f"bench/gpu_profile.py ({part})",
                            fingerprint=fingerprint(device), device=spec,
                            notes=f"{len(records)} one-device training iterations, {dtype.value} mixed precision, "
                                  f"Adam, torch eager, median of 5 steps after 2 warm-up{out_of_memory_note(skipped)}")
        write_bundle(args.out / folder, manifest, records)
        if skipped:  # the cases the memory model should say do not fit (bench/fidelity.py reads them)
            (args.out / folder / OUT_OF_MEMORY_FILE).write_text(
                json.dumps([asdict(c) for c in skipped], indent=1) + "\n")
    if "ops" in parts:
        grid = op_grid(device, quick=True) if args.smoke else op_grid(device, quick=False)
        profile(args.out / "ops", device=device, quick=True, grid=grid, world=1, progress=say)
    if "layers" in parts:
        records = []
        for spec_text, seq in LAYER_MODELS.items():
            if args.smoke:
                spec_text, seq = "gpt?layers=2&hidden=64&heads=2&vocab=256", 32
            records += layer_records(spec_text, device=device, device_type=spec.name, seq_len=seq,
                                     dtype=DType.FP32 if args.smoke else DType.BF16,
                                     micro_batches=(1, 2) if args.smoke else (1, 2, 4),
                                     tps=(1, 2) if args.smoke else (1, 2, 4, 8), progress=say)
            if args.smoke:
                break
        manifest = Manifest(created=now_iso(), source="bench/gpu_profile.py (layers)", fingerprint=fingerprint(device),
                            device=spec, notes=f"layer profiles of {', '.join(LAYER_MODELS)}")
        write_bundle(args.out / "layers", manifest, records)
    say("done")


if __name__ == "__main__":
    main()
