"""Score the cost model on Megatron-LM's published A100 runs (bench/data/megatron_a100_measured.json).

Narayanan et al. (SC'21) ran GPT models of 1.7B to 1T parameters on up to 3,072 A100s of NVIDIA's
Selene (DGX A100, 8 x 200 Gb/s InfiniBand per node) and published each run's tensor- and
pipeline-parallel degrees, GPU count, batch and achieved teraFLOP/s per GPU: Table 1 (weak scaling)
and Table 2 (the same framework against DeepSpeed's ZeRO-3 without model parallelism, at three GPU
counts each for 175B and 530B). No row was used to set any figure of the cost model: every row is
out of sample for the A100, whose datasheet peak the catalog keeps (no sustained-clock fraction).

Each run becomes the plan it ran, under a workload that describes its runtime as it ran (the data
file's "runtime"): fp16, attention scores materialised (`Workload.fused_attention` false: no
FlashAttention in 2021), every transformer layer recomputed, for Megatron-LM no sequence
parallelism (the norms and pointwise ops replicated over the tensor-parallel group: `no_sequence_
parallel`), the gradient all-reduce after the backward, no distributed optimizer, micro-batch size 1;
for ZeRO-3 one micro-batch of the listed size per GPU, with DeepSpeed's prefetching gathers. The
predicted teraFLOP/s uses the paper's own FLOP count (its Eq. 3), so predicted and published
figures differ only by the iteration time.

Scored, per row, the predicted against the published teraFLOP/s, and over all rows the MAPE of the
iteration time and its Kendall tau:
- defaults: the shipped cost model (1F1B, and the fastest interleaved schedule the layout allows as a
  bound, since the paper does not say which ran);
- with `--fit`: the iteration calibration (`iteration_fit.fit_parameters`) fitted on every row, each row
  scored again, and what the planner makes of it: bench/planner.py's GPT-3 175B on 16 DGX A100s (a current
  runtime: bf16, FlashAttention-2), planned with the defaults and with that calibration; with `--folds K` also
  cross-validated: each row predicted by the fit on the K - 1 folds without it (rows dealt round-robin,
  `iteration_fit.cross_validate`).

Run: `.venv/bin/python bench/fidelity_megatron_a100.py [--fit [--folds K]]` (about 6 s; with `--fit` some
minutes, K + 1 fits with `--folds`: about an hour with 5); writes bench/results/fidelity_megatron_a100.json, and
with `--fit` bench/results/fidelity_megatron_a100_fit.json.
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
from tagplan.cost.sharding import default_strategies
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import ModelGraph, OpKind
from tagplan.ir.plan import Plan, Schedule, ShardStrategy, Stage
from tagplan.ir.workload import DType, LossKernel, Workload
from tagplan.search.baselines import even_bounds
from tagplan.training.iteration_fit import IterationCase, cross_validate, fit_parameters, predict_s, score

DATA = Path(__file__).parent / "data" / "megatron_a100_measured.json"
OUT = Path(__file__).parent / "results" / "fidelity_megatron_a100.json"
OUT_FIT = Path(__file__).parent / "results" / "fidelity_megatron_a100_fit.json"
"""`--fit`'s sections apart, so that the quick run (`make bench`) never drops them."""
SEQ, VOCAB = 2048, 51200
INTERLEAVED_CHUNKS = (2, 3, 4, 5, 6, 8)
"""Virtual-stage counts tried for the interleaved bound (those dividing each stage's blocks)."""
PLANNED = ("gpt3-175b", "dgx-a100-80gb:nodes=16", 512)
"""The planner's problem: bench/planner.py's "175B on 16 DGX-A100" (today's runtime: bf16, FlashAttention-2), whose
best plan under the defaults is ZeRO-3 data parallelism over all 128 GPUs."""


def eq3_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one iteration as the paper counts them (its Eq. 3, the recomputed forward included)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def model_of(row: dict[str, Any]) -> ModelGraph:
    return load_model(f"gpt?layers={row['layers']}&hidden={row['hidden']}&heads={row['heads']}&vocab={VOCAB}",
                      seq_len=SEQ, dtype=DType.FP16)


def no_sequence_parallel(model: ModelGraph) -> dict[str, ShardStrategy]:
    """Per-op strategies of Megatron-LM before sequence parallelism: the ops tagplan's default splits by sequence
    over the tensor-parallel group (norms, dropout, residual adds) run whole on every rank instead."""
    out: dict[str, ShardStrategy] = {}
    for block in model.blocks:
        kinds = {op.name: op.kind for op in block.ops}
        out.update({name: ShardStrategy.REPLICATE for name, strategy in default_strategies(block).items()
                    if strategy is ShardStrategy.SEQUENCE and kinds[name] is not OpKind.EMBEDDING})
    return out


def ptdp_plan(row: dict[str, Any], model: ModelGraph, chunks: int = 1, *, sequence_parallel: bool = False) -> Plan:
    """Megatron-LM's plan of a Table 1/2 row: even split into pp x chunks (virtual) stages, micro-batch size 1
    (`sequence_parallel`: tagplan's default sharding instead of the runtime's of 2021)."""
    layers, tp, pp, gpus = len(model.layers), row["tp"], row["pp"], row["gpus"]
    per_stage, dp = gpus // pp, gpus // (tp * pp)
    parts = pp * chunks
    bounds = even_bounds(layers, parts)  # the grid baseline's split: blocks even, the embedding and head at the ends
    sharding = no_sequence_parallel(model) if tp > 1 and not sequence_parallel else None
    stages = tuple(Stage(layers=(bounds[k], bounds[k + 1]), devices=tuple(range((k % pp) * per_stage,
                                                                               (k % pp + 1) * per_stage)),
                         dp=dp, tp=tp, zero=0, recompute=True, sharding=sharding) for k in range(parts))
    return Plan(micro_batches=row["batch"] // dp, stages=stages,
                schedule=Schedule.ONE_F_ONE_B if chunks == 1 else Schedule.INTERLEAVED_1F1B)


def zero3_plan(row: dict[str, Any], model: ModelGraph) -> Plan:
    """DeepSpeed ZeRO-3 of a Table 2 row: every GPU a replica, one micro-batch of the listed size."""
    gpus = row["gpus"]
    stage = Stage(layers=(0, len(model.layers)), devices=tuple(range(gpus)), dp=gpus, zero=3, recompute=True)
    return Plan(micro_batches=row["batch"] // (gpus * row["micro_batch_size"]), stages=(stage,))


def workload_of(row: dict[str, Any], *, zero3: bool) -> Workload:
    # Megatron-LM's local DDP all-reduced after the backward; DeepSpeed's ZeRO-3 prefetches its gathers; both ran
    # Megatron's GPT model, whose vocab-parallel cross-entropy turns the fp32 softmax into the gradient in place
    return Workload(global_batch=row["batch"], seq_len=SEQ, dtype=DType.FP16, fused_attention=False,
                    grad_reduce_overlap=zero3, loss=LossKernel.IN_PLACE)


def cases_of(data: dict[str, Any]) -> tuple[list[IterationCase], list[dict[str, Any]]]:
    """Every row as the iteration it ran (measured seconds from the published teraFLOP/s), and its row."""
    cases, rows = [], []
    models: dict[tuple[int, int], ModelGraph] = {}
    clusters: dict[int, Any] = {}
    for kind in ("ptdp", "zero3"):
        for row in data[kind]:
            model = models.setdefault((row["layers"], row["hidden"]), model_of(row))
            cluster = clusters.setdefault(row["gpus"], load_cluster(f"dgx-a100-80gb:nodes={row['gpus'] // 8}"))
            plan = ptdp_plan(row, model) if kind == "ptdp" else zero3_plan(row, model)
            measured_s = eq3_flops(row["batch"], row["layers"], row["hidden"]) / (
                row["tflops_per_gpu"] * 1e12 * row["gpus"])
            cases.append(IterationCase(model, cluster, workload_of(row, zero3=kind == "zero3"), plan, measured_s))
            rows.append({**row, "runtime": kind, "measured_s": measured_s})
    return cases, rows


def tflops(row: dict[str, Any], seconds: float) -> float:
    return eq3_flops(row["batch"], row["layers"], row["hidden"]) / (seconds * row["gpus"] * 1e12)


RUNTIME_VARIANTS = {
    "as it ran": {},
    "with sequence parallelism": {"sequence_parallel": True},
    "with sequence parallelism and FlashAttention-2 (tagplan's A100 default)": {"sequence_parallel": True,
                                                                              "fused_attention": None},
}
"""How much describing the 2021 runtime matters: the Megatron-LM rows with later runtimes' features."""


def runtime_variant(cases: list[IterationCase], rows: list[dict[str, Any]], change: dict[str, Any]) -> dict[str, Any]:
    """The Megatron-LM rows re-simulated with `change` (sequence_parallel, fused_attention) to their runtime."""
    errors = []
    for case, row in zip(cases, rows, strict=True):
        if row["runtime"] != "ptdp":
            continue
        plan = ptdp_plan(row, case.model, sequence_parallel=change.get("sequence_parallel", False))
        workload = case.workload.model_copy(update={"fused_attention": change.get("fused_attention", False)})
        seconds = predict_s([IterationCase(case.model, case.cluster, workload, plan, 1.0)], Calibration())[0]
        errors.append({"params_b": row["params_b"], "gpus": row["gpus"],
                       "error": tflops(row, float(seconds)) / row["tflops_per_gpu"] - 1})
    return {"per_row": errors, **summary(errors)}


def interleaved_bound(row: dict[str, Any], case: IterationCase, calibration: Calibration) -> float | None:
    """The fastest interleaved schedule the row's layout allows (teraFLOP/s), None without a pipeline."""
    if row["pp"] == 1:
        return None
    blocks, pp = len(case.model.layers) - 2, row["pp"]
    chunks = [v for v in INTERLEAVED_CHUNKS if blocks % (pp * v) == 0 and case.plan.micro_batches % pp == 0]
    best = None
    for v in chunks:
        plan = ptdp_plan(row, case.model, v)
        seconds = predict_s([IterationCase(case.model, case.cluster, case.workload, plan, 1.0)], calibration)[0]
        best = max(best or 0.0, tflops(row, float(seconds)))
    return best


def row_scores(cases: list[IterationCase], rows: list[dict[str, Any]], calibration: Calibration, *,
               interleaved: bool = True) -> list[dict[str, Any]]:
    predicted = predict_s(cases, calibration)
    out = []
    for row, case, seconds in zip(rows, cases, predicted, strict=True):
        entry = {**row, "predicted_s": float(seconds), "predicted_tflops_per_gpu": tflops(row, float(seconds)),
                 "error": tflops(row, float(seconds)) / row["tflops_per_gpu"] - 1}
        if interleaved and row["runtime"] == "ptdp":
            bound = interleaved_bound(row, case, calibration)
            entry["interleaved_tflops_per_gpu"] = bound
            entry["interleaved_error"] = None if bound is None else bound / row["tflops_per_gpu"] - 1
        out.append(entry)
    return out


def summary(entries: list[dict[str, Any]], key: str = "error") -> dict[str, float]:
    errors = [abs(e[key]) for e in entries if e.get(key) is not None]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors), "rows": len(errors)}


def main() -> int:
    start = time.perf_counter()
    data = json.loads(DATA.read_text())
    cases, rows = cases_of(data)
    defaults = row_scores(cases, rows, Calibration())
    truth = np.array([c.measured_s for c in cases])
    ptdp = [i for i, r in enumerate(rows) if r["runtime"] == "ptdp"]
    zero3 = [i for i, r in enumerate(rows) if r["runtime"] == "zero3"]
    out: dict[str, Any] = {"source": data["source"], "runtime": data["runtime"], "defaults": defaults,
                           "defaults_ptdp": summary([defaults[i] for i in ptdp]),
                           "defaults_ptdp_interleaved": summary([defaults[i] for i in ptdp], "interleaved_error"),
                           "defaults_zero3": summary([defaults[i] for i in zero3]),
                           "defaults_score": {"mape": score(predict_s(cases, Calibration()), truth).mape,
                                              "kendall_tau": score(predict_s(cases, Calibration()), truth).kendall_tau}}
    print(f"{'runtime':7s} {'params':>7s} {'tp':>3s} {'pp':>3s} {'GPUs':>5s} {'batch':>5s} {'published':>9s} "
          f"{'predicted':>9s} {'error':>7s} {'interleaved':>11s}")
    for e in defaults:
        inter = e.get("interleaved_error")
        print(f"{e['runtime']:7s} {e['params_b']:7.1f} {e.get('tp', 1):3d} {e.get('pp', 1):3d} {e['gpus']:5d} "
              f"{e['batch']:5d} {e['tflops_per_gpu']:9.0f} {e['predicted_tflops_per_gpu']:9.1f} {e['error']:+7.1%} "
              f"{'' if inter is None else f'{inter:+.1%}':>11s}")
    out["runtime_variants"] = {name: runtime_variant(cases, rows, change) for name, change in RUNTIME_VARIANTS.items()}
    for name, v in out["runtime_variants"].items():
        print(f"Megatron-LM rows {name}: median |error| {v['median_abs_error']:.1%}, worst {v['worst_abs_error']:.1%}; "
              + " ".join(f"{e['error']:+.0%}" for e in v["per_row"]))
    for key in ("defaults_ptdp", "defaults_ptdp_interleaved", "defaults_zero3"):
        print(f"{key}: median |error| {out[key]['median_abs_error']:.1%}, worst {out[key]['worst_abs_error']:.1%}")
    out["wall_s"] = time.perf_counter() - start
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2))
    print(f"wrote {OUT} in {out['wall_s']:.0f} s")
    if "--fit" in sys.argv[1:]:
        fit_start = time.perf_counter()
        folds = int(sys.argv[sys.argv.index("--folds") + 1]) if "--folds" in sys.argv else 0
        held_out: dict[str, Any] | None = None
        if folds >= 2:  # each row also predicted by a fit on the folds without it
            fitted, report = cross_validate(cases, Calibration(), folds=folds)
            values = dict(report.parameters)
            held_s = np.array(report.held_out_predictions_s)
            held = [{"params_b": r["params_b"], "gpus": r["gpus"], "runtime": r["runtime"], "held_out_s": float(t),
                     "error": tflops(r, float(t)) / r["tflops_per_gpu"] - 1} for r, t in zip(rows, held_s, strict=True)]
            held_out = {"folds": folds, "rows": held, "ptdp": summary([held[i] for i in ptdp]),
                        "zero3": summary([held[i] for i in zero3]),
                        "score": {"mape": score(held_s, truth).mape, "kendall_tau": score(held_s, truth).kendall_tau}}
            print(f"held out ({folds} folds): MAPE {held_out['score']['mape']:.1%}, "
                  f"tau {held_out['score']['kendall_tau']:.2f}; Megatron-LM rows median "
                  f"{held_out['ptdp']['median_abs_error']:.1%}, worst {held_out['ptdp']['worst_abs_error']:.1%}; "
                  f"ZeRO-3 rows median {held_out['zero3']['median_abs_error']:.1%}, "
                  f"worst {held_out['zero3']['worst_abs_error']:.1%}")
        else:
            fitted, values = fit_parameters(cases, Calibration())
        refit = row_scores(cases, rows, fitted, interleaved=False)
        fit: dict[str, Any] = {"parameters": values, "rows": refit,
                               "ptdp": summary([refit[i] for i in ptdp]), "zero3": summary([refit[i] for i in zero3]),
                               "score": {"mape": score(predict_s(cases, fitted), truth).mape,
                                         "kendall_tau": score(predict_s(cases, fitted), truth).kendall_tau}}
        print("fitted on every row:", {k: round(v, 4) for k, v in values.items()})
        for e in refit:
            print(f"  {e['runtime']:7s} {e['params_b']:7.1f} {e['gpus']:5d} {e['error']:+7.1%}")
        spec, cluster_spec, batch = PLANNED
        model, workload = load_model(spec, seq_len=SEQ), Workload(global_batch=batch, seq_len=SEQ)
        planner = {name: planned(model, cluster_spec, workload, c)
                   for name, c in (("defaults", Calibration()), ("fitted", fitted))}
        for name, p in planner.items():
            print(f"planner ({name}): {p['configuration']}, predicted {p['predicted_s']:.1f} s")
        OUT_FIT.write_text(json.dumps({"fitted_on_all": fit, "held_out": held_out, "planner": planner,
                                       "wall_s": time.perf_counter() - fit_start}, indent=2))
        print(f"wrote {OUT_FIT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
