"""Score the cost model on MosaicML's published MPT runs under PyTorch FSDP (bench/data/mpt_fsdp_measured.json).

MosaicML published the measured throughput of 201 runs of its MPT models (125M to 70B parameters) trained with
PyTorch FSDP FULL_SHARD under Composer: H100 80GB in bf16 and fp8, A100 80GB and A100 40GB, on 8 to 128 GPUs
(nodes of 8), sequences of 512 to 65,536 tokens, each with its micro-batch size, gradient-accumulation count and
activation checkpointing. No row was used to set any figure of the cost model: FSDP is what the planner calls
ZeRO-3 data parallelism, the runtime the previous ZeRO-3 check (DeepSpeed's of 2021, `fidelity_megatron_a100`)
found the model 1.5-5x too fast on, and the one most users of tagplan run.

Each row becomes the plan it ran: one stage of every layer, every GPU a replica (ZeRO-3), the row's
gradient-accumulation count of micro-batches of its micro-batch size, every block recomputed where the row
checkpoints activations; its workload: bf16 (fp8 for the amp_fp8 rows: Transformer Engine's delayed scaling, its
default), FlashAttention, gradients reduced in fp32 where the row's MP Mode is DEFAULT (Composer's default FSDP
mixed precision reduces in fp32; PURE reduces in bf16), reductions and gathers overlapped with compute (FSDP's
prefetching). The model is tagplan's gpt family at each MPT shape (it counts exactly the row's NumParams). The
runtime is eager PyTorch over 16-bit weights (`Workload.eager_16bit_weights`: FSDP's mixed precision gathers bf16
weights and MPT's low-precision LayerNorm keeps the residual stream in bf16, so nothing is cast and autocast keeps
no copies): the host issues each op's kernels and the unfused kernels' extra traffic is charged
(`Op.eager_uniform_extra_bytes`: the residual stream's gradient sums, the pointwise ops' backward reads, the bias
gradients, the fused QKV's gradient layout). The fp8 rows hold the same bf16 weights, which Transformer Engine's
linear layers cast to fp8.

Scored, per row, predicted against measured tokens/s per GPU (error = predicted / measured - 1), per table the
median and worst |error|, the MAPE of the iteration time and its Kendall tau, and the memory verdicts (a row that
ran is predicted to fit). With `--fit` the iteration calibration (`iteration_fit`, its parameters per device type)
cross-validated over all rows: each row predicted by the fit on the other folds (5, or `--folds K`), and what
the planner makes of the fit on all rows (`PLANNED`).

Run: `.venv/bin/python bench/fidelity_mpt.py [--fit [--folds K]]` (about 2 s; with `--fit` about 2 minutes here);
writes bench/results/fidelity_mpt.json, and with `--fit` bench/results/fidelity_mpt_fit.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from planned import planned

from tagplan.cost.calibration import Calibration
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, LossKernel, Workload
from tagplan.training.iteration_fit import IterationCase, cross_validate, kendall_tau, predict_s, score

DATA = Path(__file__).parent / "data" / "mpt_fsdp_measured.json"
OUT = Path(__file__).parent / "results" / "fidelity_mpt.json"
OUT_FIT = Path(__file__).parent / "results" / "fidelity_mpt_fit.json"
"""`--fit`'s results apart, so that the quick run (`make bench`) never drops them."""
PRESETS = {"a100_80gb": "dgx-a100-80gb", "a100_40gb": "dgx-a100-40gb", "h100_80gb": "dgx-h100"}
"""Published GPU -> cluster preset (8 GPUs a node; the A100 presets' 8 x 200 Gb/s are the tables' 1600 Gb/s)."""
DTYPES = {"amp_bf16": DType.BF16, "bf16": DType.BF16, "amp_fp8": DType.FP8}
PLANNED = ("gpt?layers=32&hidden=4096&heads=32&vocab=50368", "dgx-h100:nodes=2", 256, 2048)
"""`--fit` also plans MPT-7B on 16 H100s (batch 256 x 2048 tokens) with the defaults and with the fitted calibration."""
FOLDS = 5
"""`--fit`'s cross-validation folds (rows dealt round-robin, `iteration_fit.cross_validate`)."""


def model_of(row: dict[str, Any], shapes: dict[str, Any]) -> ModelGraph:
    s = shapes[row["model"]]
    spec = (f"gpt?layers={s['layers']}&hidden={s['hidden']}&heads={s['heads']}&vocab={shapes['vocab']}"
            f"&max_positions={row['seq_len']}")  # MPT's learned positions: max_seq_len rows
    return load_model(spec, seq_len=row["seq_len"], dtype=DTYPES[row["precision"]])


def plan_of(row: dict[str, Any], model: ModelGraph) -> Plan:
    """FSDP FULL_SHARD: one stage, every GPU a ZeRO-3 replica, GradAccum micro-batches of MicroBatchSize."""
    gpus = row["gpus"]
    stage = Stage(layers=(0, len(model.layers)), devices=tuple(range(gpus)), dp=gpus, zero=3,
                  recompute=row["activation_checkpointing"])
    return Plan(micro_batches=row["grad_accum"], stages=(stage,))


def workload_of(row: dict[str, Any]) -> Workload:
    return Workload(global_batch=row["global_batch"], seq_len=row["seq_len"], dtype=DTYPES[row["precision"]],
                    fused_attention=True, loss=LossKernel.FUSED,
                    grad_reduce_dtype=DType.FP32 if row["mp_mode"] == "DEFAULT" else None,
                    eager=True, eager_16bit_weights=True)


def cases_of(data: dict[str, Any]) -> list[IterationCase]:
    """Every row as the iteration it ran (measured seconds from its tokens/s per GPU)."""
    models: dict[tuple[str, int, str], ModelGraph] = {}
    clusters: dict[tuple[str, int], Cluster] = {}
    cases = []
    for row in data["rows"]:
        model = models.setdefault((row["model"], row["seq_len"], row["precision"]), model_of(row, data["shapes"]))
        cluster = clusters.setdefault((row["gpu"], row["gpus"]),
                                      load_cluster(f"{PRESETS[row['gpu']]}:nodes={row['gpus'] // 8}"))
        measured_s = row["global_batch"] * row["seq_len"] / (row["tokens_per_s_per_gpu"] * row["gpus"])
        cases.append(IterationCase(model, cluster, workload_of(row), plan_of(row, model), measured_s))
    return cases


def row_scores(data: dict[str, Any], cases: list[IterationCase], predicted: np.ndarray) -> list[dict[str, Any]]:
    out = []
    for row, case, seconds in zip(data["rows"], cases, predicted, strict=True):
        out.append({"table": row["table"], "model": row["model"], "seq_len": row["seq_len"], "gpus": row["gpus"],
                    "micro_batch_size": row["micro_batch_size"], "grad_accum": row["grad_accum"],
                    "checkpointing": row["activation_checkpointing"],
                    "tokens_per_gpu": row["global_batch"] * row["seq_len"] / row["gpus"], "measured_s": case.measured_s,
                    "predicted_s": float(seconds), "error": case.measured_s / float(seconds) - 1})
    return out


def summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(e["error"]) for e in entries]
    measured = np.array([e["measured_s"] for e in entries])
    predicted = np.array([e["predicted_s"] for e in entries])
    s = score(predicted, measured)
    return {"rows": len(entries), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "median_error": statistics.median(e["error"] for e in entries), "mape": s.mape,
            "kendall_tau": s.kendall_tau, "kendall_tau_within_model": within_model_tau(entries)}


def within_model_tau(entries: list[dict[str, Any]]) -> float | None:
    """The median over the models (of one table) with four rows or more of the Kendall tau between predicted and
    measured tokens/s per GPU among that model's rows: how well the runs of one model (sequence lengths, GPU
    counts, micro-batches, checkpointing) are ranked, which the tau over all rows, spanning 0.3 s to 160 s
    iterations, hardly tests."""
    models: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in entries:
        models.setdefault((e["table"], e["model"]), []).append(e)
    taus = [kendall_tau([e["tokens_per_gpu"] / e["predicted_s"] for e in rows],
                        [e["tokens_per_gpu"] / e["measured_s"] for e in rows])
            for rows in models.values() if len(rows) >= 4]
    found = [t for t in taus if t is not None]
    return statistics.median(found) if found else None


def by_table(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    tables: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        tables.setdefault(e["table"], []).append(e)
    return {name: summary(rows) for name, rows in tables.items()}


def memory_verdicts(cases: list[IterationCase], data: dict[str, Any]) -> dict[str, Any]:
    """How many rows that ran the memory model says fit, per table, and the rows it says do not."""
    per_table: dict[str, list[int]] = {}
    refused = []
    for row, c in zip(data["rows"], cases, strict=True):
        sim = Simulator(c.model, c.cluster, c.workload)  # every row has a workload of its own (batch, sequence)
        peak = max(sim.memory_bytes(c.plan).values())
        fits = sim.fits(c.plan)
        counts = per_table.setdefault(row["table"], [0, 0])
        counts[0] += fits
        counts[1] += 1
        if not fits:
            refused.append({"table": row["table"], "model": row["model"], "seq_len": row["seq_len"],
                            "micro_batch_size": row["micro_batch_size"],
                            "checkpointing": row["activation_checkpointing"],
                            "predicted_peak_GiB": peak / 2**30,
                            "device_GiB": c.cluster.devices[0].spec.mem_bytes / 2**30})
    return {"fit": {name: f"{ok} of {n}" for name, (ok, n) in per_table.items()}, "predicted_not_to_fit": refused}


def print_table(title: str, tables: dict[str, dict[str, Any]], whole: dict[str, Any]) -> None:
    print(title)
    print(f"  {'table':58s} {'rows':>4s} {'median |err|':>12s} {'worst':>7s} {'median err':>10s} {'MAPE':>6s} "
          f"{'tau':>5s} {'tau within model':>16s}")
    for name, s in [*tables.items(), ("all rows", whole)]:
        within = s.get("kendall_tau_within_model")
        print(f"  {name:58s} {s['rows']:4d} {s['median_abs_error']:12.1%} {s['worst_abs_error']:7.1%} "
              f"{s['median_error']:+10.1%} {s['mape']:6.1%} {s['kendall_tau']:5.2f} "
              f"{'' if within is None else f'{within:.2f}':>16s}")


def main() -> int:
    start = time.perf_counter()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(DATA.read_text())
    cases = cases_of(data)
    defaults = row_scores(data, cases, predict_s(cases, Calibration()))
    out: dict[str, Any] = {"source": data["source"], "runtime": data["runtime"], "defaults": defaults,
                           "defaults_by_table": by_table(defaults), "defaults_all": summary(defaults),
                           "memory": memory_verdicts(cases, data)}
    print_table("defaults (error = predicted / measured tokens/s per GPU - 1):", out["defaults_by_table"],
                out["defaults_all"])
    print("rows that ran, predicted to fit:", out["memory"]["fit"])
    worst = sorted(defaults, key=lambda e: -abs(e["error"]))[:8]
    for e in worst:
        print(f"  worst: {e['table'][:14]} {e['model']:>4s} seq {e['seq_len']:6d} x{e['gpus']:3d} "
              f"mbs {e['micro_batch_size']:3d} ga {e['grad_accum']:2d} ckpt {int(e['checkpointing'])} "
              f"{e['error']:+.1%}")
    if "--fit" in sys.argv[1:]:
        folds = int(sys.argv[sys.argv.index("--folds") + 1]) if "--folds" in sys.argv else FOLDS
        fitted, report = cross_validate(cases, Calibration(), folds=folds)
        held = row_scores(data, cases, np.array(report.held_out_predictions_s))
        in_sample = row_scores(data, cases, predict_s(cases, fitted))
        fit = {"folds": folds, "parameters_on_all": dict(report.parameters),
               "held_out_by_table": by_table(held), "held_out": summary(held),
               "in_sample_by_table": by_table(in_sample), "in_sample": summary(in_sample), "held_out_rows": held,
               "wall_s": time.perf_counter() - start}
        spec, cluster_spec, batch, seq = PLANNED
        model = load_model(spec, seq_len=seq)
        workload = Workload(global_batch=batch, seq_len=seq, loss=LossKernel.FUSED, eager=True,
                            eager_16bit_weights=True)
        fit["planner"] = {name: planned(model, cluster_spec, workload, c)
                          for name, c in (("defaults", Calibration()), ("fitted", fitted))}
        for name, p in fit["planner"].items():
            print(f"planner ({name}): {p['configuration']}, predicted {p['predicted_s']:.2f} s")
        print("fitted on all rows:", {k: round(v, 4) for k, v in report.parameters.items()})
        print_table(f"each row predicted by the fit on the other {folds - 1} of {folds} folds:",
                    fit["held_out_by_table"], fit["held_out"])
        OUT_FIT.write_text(json.dumps(fit, indent=2))
        print(f"wrote {OUT_FIT}")
    out["wall_s"] = time.perf_counter() - start
    OUT.write_text(json.dumps(out, indent=2))
    print(f"wrote {OUT} in {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
