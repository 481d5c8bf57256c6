"""simulate() latency: a 96-layer model on 1024 devices with 64 micro-batches, a pp64 pipeline with
256 micro-batches (target: median < 20 ms each), and an interleaved pp32 x 3-chunk pipeline with 128.

The search calls the simulator thousands of times with one `Simulator` (shared memo tables), so
the figure that matters is a warm call on a new plan of an already-costed shape; the cold first
call is reported too. Prints a table and writes bench/results/simulator.json, with the machine's
1-minute load average before and after (timings on a shared machine are only as good as its idleness).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.ir.workload import Workload


def plan_for(layers: int, devices: int, tp: int, pp: int, micro_batches: int, zero: int, chunks: int = 1) -> Plan:
    """An even 1F1B plan with the embedding on the first stage and the head on the last; with
    `chunks` > 1, Megatron's interleaved layout (virtual stage k on device group k mod pp)."""
    per_stage = devices // pp
    blocks, parts = layers - 2, pp * chunks
    bounds = [1 + blocks * s // parts for s in range(parts + 1)]
    bounds[0], bounds[-1] = 0, layers
    stages = tuple(Stage(layers=(bounds[k], bounds[k + 1]),
                         devices=tuple(range((k % pp) * per_stage, (k % pp + 1) * per_stage)),
                         dp=per_stage // tp, tp=tp, zero=zero) for k in range(parts))
    schedule = Schedule.INTERLEAVED_1F1B if chunks > 1 else Schedule.ONE_F_ONE_B
    return Plan(micro_batches=micro_batches, schedule=schedule, stages=stages)


def main() -> None:
    model = load_model("gpt3-175b")  # 96 transformer layers
    cluster = load_cluster("dgx-a100-80gb:nodes=128")  # 1024 devices
    sim = Simulator(model, cluster, Workload(global_batch=1024, seq_len=2048))  # 1024 / 256 = 4 per micro-batch
    cases = [("tp8 pp8 dp16", plan_for(len(model.layers), 1024, 8, 8, 64, 1)),
             ("tp8 pp16 dp8", plan_for(len(model.layers), 1024, 8, 16, 64, 1)),
             ("tp4 pp8 dp32 m32", plan_for(len(model.layers), 1024, 4, 8, 32, 0)),
             ("tp8 pp64 dp2 m256", plan_for(len(model.layers), 1024, 8, 64, 256, 1)),
             ("tp4 pp32 vp3 dp8 m128", plan_for(len(model.layers), 1024, 4, 32, 128, 1, chunks=3))]
    rows = []
    load_before = os.getloadavg()[0]
    print(f"{'plan':22s} {'cold ms':>9s} {'warm median ms':>15s} {'warm min ms':>12s}")
    for name, plan in cases:
        start = time.perf_counter()
        sim.simulate(plan)
        cold = (time.perf_counter() - start) * 1e3
        warm = []
        for _ in range(20):
            start = time.perf_counter()
            sim.simulate(plan)
            warm.append((time.perf_counter() - start) * 1e3)
        median = statistics.median(warm)
        rows.append({"plan": name, "cold_ms": cold, "warm_median_ms": median, "warm_min_ms": min(warm)})
        print(f"{name:22s} {cold:9.2f} {statistics.median(warm):15.2f} {min(warm):12.2f}")
    load = [load_before, os.getloadavg()[0]]
    print(f"load average (1 min) before, after: {load[0]:.2f}, {load[1]:.2f} on {os.cpu_count()} cores")
    out = Path(__file__).parent / "results" / "simulator.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "gpt3-175b (96 layers)", "devices": 1024,
                               "micro_batches": "64 (pp64: 256, interleaved: 128)",
                               "target_median_ms": 20, "load_average_1m": load, "cpus": os.cpu_count(), "rows": rows},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
