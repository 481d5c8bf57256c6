"""Predicted vs published TFLOP/s per GPU for the Megatron-Core H100 table (reference/validation.md).

Each row is simulated with its own TP/PP/DP, an even layer split, 1F1B, the distributed
optimizer (ZeRO-1) and sequence parallelism (the simulator's TP default), micro-batch size 1 as in
the Megatron-LM GPT examples (`baselines.megatron_plan`), the overlaps the README states for these
runs (`--overlap-grad-reduce --overlap-param-gather`, the simulator's default, and `--tp-comm-overlap`:
`Workload.tp_comm_overlap`), and the shipped default calibration: one set of defaults for every row,
nothing tuned per row. The H100's sustained clock (`catalog.SUSTAINED_PEAK_FRACTION`) is the one figure
fitted to this table, by bench/fit_sustained_clock.py, which reports its leave-one-out error.

Prints a table and writes bench/results/validate_megatron.json. Run: `.venv/bin/python bench/validate_megatron.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tagplan.cost.baselines import megatron_plan
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.workload import LossKernel, Workload

# model, heads, hidden, layers, TP, PP, DP, GPUs, global batch, published TFLOP/s per GPU, MFU
ROWS = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
VOCAB, SEQ = 131072, 4096


def simulate_row(heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, *,
                 sustained_peak_fraction: float | None = None) -> dict[str, float]:
    """The simulator's figures for one table row (with the H100 at `sustained_peak_fraction` instead of
    the catalog's, where given: `fit_sustained_clock` fits it)."""
    model = load_model(f"gpt?layers={layers}&hidden={hidden}&heads={heads}&vocab={VOCAB}", seq_len=SEQ)
    cluster = load_cluster(f"dgx-h100:nodes={gpus // 8}")
    if sustained_peak_fraction is not None:
        cluster = cluster.with_device_figures("H100-SXM", sustained_peak_fraction=sustained_peak_fraction)
    workload = Workload(global_batch=batch, seq_len=SEQ, tp_comm_overlap=True, fused_activation=True,
                        loss=LossKernel.IN_PLACE)  # Megatron-Core, its own cross-entropy
    sim = Simulator(model, cluster, workload)
    baseline = megatron_plan(sim, tp=tp, pp=pp)
    if baseline.plan is None:
        raise RuntimeError(f"row {layers}x{hidden}: {baseline.reason}")
    report = sim.simulate(baseline.plan)
    b = report.breakdown
    return {"tflops_per_gpu": report.tflops_per_device, "mfu": report.mfu, "iteration_s": report.iteration_time_s,
            "micro_batches": baseline.plan.micro_batches, "peak_memory_gb": report.peak_memory_bytes / 1e9,
            "fits": report.fits, "compute_s": b.compute, "tp_comm_s": b.tp_comm, "dp_comm_s": b.dp_comm,
            "pp_comm_s": b.pp_comm, "bubble_s": b.bubble, "optimizer_s": b.optimizer}


def main() -> None:
    results = []
    print(f"{'model':>6s} {'TP':>3s} {'PP':>3s} {'DP':>3s} {'mb':>4s} {'published':>10s} {'predicted':>10s} "
          f"{'error':>7s} {'bubble':>7s} {'tp':>6s} {'dp':>6s} {'mem GB':>7s}")
    for name, heads, hidden, layers, tp, pp, dp, gpus, batch, published in ROWS:
        row = simulate_row(heads, hidden, layers, tp, pp, gpus, batch)
        error = row["tflops_per_gpu"] / published - 1
        it = row["iteration_s"]
        print(f"{name:>6s} {tp:3d} {pp:3d} {dp:3d} {row['micro_batches']:4d} {published:10.1f} "
              f"{row['tflops_per_gpu']:10.1f} {error:+7.1%} {row['bubble_s'] / it:7.1%} "
              f"{row['tp_comm_s'] / it:6.1%} {row['dp_comm_s'] / it:6.1%} {row['peak_memory_gb']:7.1f}")
        results.append({"model": name, "tp": tp, "pp": pp, "dp": dp, "gpus": gpus, "global_batch": batch,
                        "published_tflops_per_gpu": published, "error": error, **row})
    worst = max(abs(r["error"]) for r in results)
    mape = sum(abs(r["error"]) for r in results) / len(results)
    print(f"worst |error| {worst:.1%}, mean |error| {mape:.1%} (target: every row within 15%)")
    out = Path(__file__).parent / "results" / "validate_megatron.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": results, "worst_abs_error": worst, "mean_abs_error": mape}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
