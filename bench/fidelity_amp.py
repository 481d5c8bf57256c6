"""Score the cost model on AMP's published measured runs (bench/data/amp_measured.json).

AMP (Li et al., NeurIPS 2022) ran GPT-2 medium (24 layers, hidden 1024, sequence 1024, global batch
32, fp16, no activation checkpointing, no ZeRO, gradients all-reduced in fp32) under DeepSpeed +
Megatron-LM v1.1.5 on AWS:
- homogeneous: 4 x g4dn.12xlarge (4 T4 on PCIe each, 50 Gb/s Ethernet), 47 measured layouts;
- heterogeneous: 3 x p3.8xlarge (4 V100 on NVLink, 10 Gb/s) + 1 x g4dn.12xlarge, 43 measured layouts;
each a (tp, pp, dp, micro-batch size, layer split), timed as the mean of iterations 20-39.

Each run becomes the plan it ran: stage s holds ranks s*tp*dp .. (s+1)*tp*dp - 1 (DeepSpeed's pipe
topology, nodes in rank order), its transformer layers as AMP's partition gives them, the embedding
on the first stage and the head on the last, ZeRO 0, 1F1B. Runs whose partition gives a middle stage
no transformer layer are not expressible (the layer graph has no empty stage) and are listed apart.

Variants, each scored by MAPE, Kendall tau and first-choice regret (measured time of the layout the
variant ranks first / fastest measured - 1) per experiment:
- defaults: the shipped cost model, nothing fitted;
- the memory model's fit verdict on every layout against whether AMP's run of it finished (a run
  that finished must fit; one that failed may have run out of memory or failed otherwise);
- fit on the homogeneous runs (`iteration_fit.fit_parameters`), scored on the heterogeneous ones
  (a cluster the fit never saw, and a GPU type it never saw), and the homogeneous runs' own k-fold
  cross-validation.

Run: `.venv/bin/python bench/fidelity_amp.py` (about 6 minutes on 2 cores, the fits most of it); writes
bench/results/fidelity_amp.json.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tagplan.cost.calibration import Calibration
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.ir.workload import DType, LossKernel, Workload
from tagplan.training.iteration_fit import IterationCase, cross_validate, fit_parameters, predict_s, score

DATA = Path(__file__).parent / "data" / "amp_measured.json"
OUT = Path(__file__).parent / "results" / "fidelity_amp.json"
CLUSTERS = {"homogeneous": "g4dn.12xlarge:nodes=4", "heterogeneous": "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1"}
"""The AMP clusters as presets, nodes in rank order (the T4 node last in the mixed one)."""


def load_model_of(data: dict[str, Any]) -> ModelGraph:
    m = data["model"]
    spec = f"gpt?layers={m['layers']}&hidden={m['hidden']}&heads={m['heads']}&vocab={m['vocab']}"
    return load_model(spec, seq_len=m["seq_len"], dtype=DType.FP16)


def plan_of(run: dict[str, Any], layers: int) -> Plan | str:
    """The plan AMP ran, or why it cannot be written as one."""
    blocks = run["transformer_layers_per_stage"]
    pp, per = run["pp"], run["tp"] * run["dp"]
    if any(n == 0 for n in blocks[1:-1]):
        return "a middle stage holds no transformer layer"
    bounds = [0] + [1 + sum(blocks[:k]) for k in range(1, pp)] + [layers]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        return "a stage holds no layer of the graph"
    stages = tuple(Stage(layers=(bounds[k], bounds[k + 1]), dp=run["dp"], tp=run["tp"], zero=0,
                         devices=tuple(range(k * per, (k + 1) * per))) for k in range(pp))
    return Plan(micro_batches=run["micro_batches"], schedule=Schedule.ONE_F_ONE_B, stages=stages)


def workload_of(data: dict[str, Any]) -> Workload:
    """The workload as AMP's runs ran it: fp16, gradients all-reduced in fp32 after the flush, Megatron-LM's
    vocab-parallel cross-entropy (the fp32 softmax turned into the gradient in place), and DeepSpeed's pipeline
    engine keeping each micro-batch's received input and stage output until its backward (its last stage also the
    previous micro-batch's fp32 logits: GPT2ModelPipe ends in an fp32 cast)."""
    return Workload(global_batch=data["global_batch"], seq_len=data["model"]["seq_len"], dtype=DType.FP16,
                    grad_reduce_dtype=DType(data["framework"]["grad_reduce_dtype"]),
                    grad_reduce_overlap=data["framework"]["grad_reduce_overlap"], loss=LossKernel.IN_PLACE,
                    keeps_stage_outputs=True)


def fit_verdicts(data: dict[str, Any], experiment: dict[str, Any], model: ModelGraph) -> dict[str, Any]:
    """The memory model's fit verdict on every expressible layout, against whether AMP's run of it
    finished: a run that finished must fit; a failed one (out of memory, or a crash or hang) may not."""
    sim = Simulator(model, load_cluster(CLUSTERS[experiment["name"]]), workload_of(data))
    verdicts: dict[str, list[dict[str, Any]]] = {"ran": [], "failed": []}
    for run in experiment["runs"]:
        plan = plan_of(run, len(model.layers))
        if isinstance(plan, str):
            continue
        report = sim.simulate(plan)
        verdicts["ran" if run["measured_s"] is not None else "failed"].append(
            {"amp_rank": run["amp_rank"], "fits": report.fits, "peak_gb": round(report.peak_memory_bytes / 1e9, 2)})
    ran, failed = verdicts["ran"], verdicts["failed"]
    return {"ran": len(ran), "ran_predicted_to_fit": sum(v["fits"] for v in ran),
            "failed": len(failed), "failed_predicted_not_to_fit": sum(not v["fits"] for v in failed),
            "largest_peak_gb_of_a_run_that_ran": max((v["peak_gb"] for v in ran), default=0.0),
            "failed_runs": failed}


def cases_of(data: dict[str, Any], experiment: dict[str, Any], model: ModelGraph,
             ) -> tuple[list[IterationCase], list[dict[str, Any]], list[dict[str, Any]]]:
    """(cases, their runs, runs left out with the reason) of one experiment's measured runs."""
    cluster = load_cluster(CLUSTERS[experiment["name"]])
    workload = workload_of(data)
    cases, runs, skipped = [], [], []
    for run in experiment["runs"]:
        if run["measured_s"] is None:
            skipped.append({**run, "reason": "failed in AMP's run (no time recorded)"})
            continue
        plan = plan_of(run, len(model.layers))
        if isinstance(plan, str):
            skipped.append({**run, "reason": plan})
            continue
        cases.append(IterationCase(model, cluster, workload, plan, float(run["measured_s"])))
        runs.append(run)
    return cases, runs, skipped


def scores(cases: list[IterationCase], calibration: Calibration) -> dict[str, Any]:
    pred = predict_s(cases, calibration)
    truth = np.array([c.measured_s for c in cases])
    s = score(pred, truth)
    return {"mape": s.mape, "kendall_tau": s.kendall_tau,
            "median_measured_over_predicted": float(np.median(truth / pred)),
            "first_choice_regret": float(truth[int(np.argmin(pred))] / truth.min() - 1), "predicted_s": pred.tolist()}


def _rest(cases: list[IterationCase]) -> list[IterationCase]:
    return [c for i, c in enumerate(cases) if i % 3]


def _variant(name: str, train: list[IterationCase], tests: dict[str, list[IterationCase]]) -> dict[str, Any]:
    """Named parameters fitted on `train` (on top of the defaults), scored on each held-out set."""
    fitted, values = fit_parameters(train, Calibration())
    return {"fitted_on": name, "records": len(train), "parameters": {k: round(float(v), 5) for k, v in values.items()},
            "held_out": {k: {"runs": len(c)} | {m: v for m, v in scores(c, fitted).items() if m != "predicted_s"}
                         for k, c in tests.items()}}


def breakdown(case: IterationCase, calibration: Calibration) -> dict[str, float]:
    report = Simulator(case.model, case.cluster, case.workload, calibration=calibration).simulate(case.plan)
    return {k: round(float(v), 4) for k, v in report.breakdown.model_dump().items()} | {"fits": report.fits}


def main() -> int:
    data = json.loads(DATA.read_text())
    model = load_model_of(data)
    defaults = Calibration()
    out: dict[str, Any] = {"source": data["source"]["paper"], "experiments": {}}
    every: dict[str, list[IterationCase]] = {}
    for experiment in data["experiments"]:
        cases, runs, skipped = cases_of(data, experiment, model)
        every[experiment["name"]] = cases
        d = scores(cases, defaults)
        out["experiments"][experiment["name"]] = {
            "cluster": CLUSTERS[experiment["name"]], "scored": len(cases),
            "left_out": [{"amp_rank": r["amp_rank"], "reason": r["reason"]} for r in skipped],
            "fit_verdicts": fit_verdicts(data, experiment, model),
            "defaults": {k: v for k, v in d.items() if k != "predicted_s"},
            "rows": [{"tp": r["tp"], "pp": r["pp"], "dp": r["dp"], "micro_batch_size": r["micro_batch_size"],
                      "measured_s": c.measured_s, "predicted_s": round(p, 4), "breakdown": breakdown(c, defaults)}
                     for r, c, p in zip(runs, cases, d["predicted_s"], strict=True)],
        }
    homo, het = every["homogeneous"], every["heterogeneous"]
    out["calibrated"] = [
        _variant("a third of the homogeneous runs", homo[::3], {"homogeneous": _rest(homo), "heterogeneous": het}),
        _variant("all homogeneous runs", homo, {"heterogeneous": het}),
        _variant("a third of the heterogeneous runs", het[::3], {"heterogeneous": _rest(het)}),
    ]
    _, cv = cross_validate(homo, defaults)
    out["homogeneous_kfold"] = {"folds": cv.folds, "mape": cv.after.mape, "kendall_tau": cv.after.kendall_tau}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(_table(out))
    return 0


def _table(out: dict[str, Any]) -> str:
    lines = ["| scored on | runs | calibration | MAPE | Kendall tau | measured / predicted (median) "
             "| first-choice regret |",
             "|---|---|---|---|---|---|---|"]
    rows = [(name, e["scored"], "defaults", e["defaults"]) for name, e in out["experiments"].items()]
    rows += [(f"{k} (held out)", v["runs"], f"fitted on {c['fitted_on']} ({c['records']})", v)
             for c in out["calibrated"] for k, v in c["held_out"].items()]
    for where, n, how, s in rows:
        lines.append(f"| {where} | {n} | {how} | {s['mape']:.1%} | {s['kendall_tau']:.2f} | "
                     f"{s['median_measured_over_predicted']:.2f} | {s['first_choice_regret']:.1%} |")
    lines.append("\n| cluster | runs that ran predicted to fit | failed runs predicted not to fit | "
                 "largest predicted peak of a run that ran |\n|---|---|---|---|")
    for name, e in out["experiments"].items():
        v = e["fit_verdicts"]
        lines.append(f"| {name} | {v['ran_predicted_to_fit']} of {v['ran']} | {v['failed_predicted_not_to_fit']} of "
                     f"{v['failed']} | {v['largest_peak_gb_of_a_run_that_ran']:.1f} GB |")
    cv = out["homogeneous_kfold"]
    lines.append(f"\nHomogeneous, {cv['folds']}-fold cross-validated fit: MAPE {cv['mape']:.1%}, Kendall tau "
                 f"{cv['kendall_tau']:.2f}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
