"""How close the cost model comes to real runs: the testbed bundle and the published tables.

(a) Testbed: the committed CPU bundle `tests/fixtures/traces/cpu-quick` (12 measured training
iterations of small GPTs on one CPU core; small). Every third record (0, 3, 6, 9) calibrates;
the other 8 are scored: MAPE and Kendall tau of predicted vs measured seconds, for
- defaults: the shipped calibration;
- ops: op and link calibration from the bundle's op/collective records;
- iterations: the named physical parameters fitted on the 4 calibration iterations (on defaults);
- ops+iterations: both;
- layers+iterations: layer profiles of the same shapes measured now on this machine
  (`profiling.layers`, tp 1, micro-batches 1-8), then the parameters fitted on top;
and the planner's first choice: per (model, workload) group of the testbed plans, how much
slower the plan each variant ranks first ran than the fastest measured one.
(a'') GPU: the bundles a session lent a GPU measured (`bench/gpu_profile.py`, committed under
`bench/data/gpu/<device>/`): one-GPU bf16 training iterations of GPT-2 small to 2.7B shapes in eager
PyTorch, an op grid and layer profiles. Same protocol as (a): every third iteration calibrates, the
rest are scored, for defaults, ops (the bundle's op records), iterations, ops+iterations and
layers+iterations, and where the bundle has Kineto steps (`kineto/*.trace.json.gz`) traced ops (the op fit from
the steps' own kernels, imported as `tagplan traces import` reads them) and traced ops+iterations; each
variant with its MAPE, Kendall tau, median signed error and first-choice regret; each iteration's
measured peak memory against the memory model, and the model's fit
verdict on the runs that ran and on those the GPU had no memory for. Across GPUs (`across_devices`): the
time ratio of two GPUs on the cases both ran, predicted against measured, and one GPU's fit filed under the
other's name (`as_device`) and scored on every run of the other.
(b) Published tables: the Megatron-Core H100 table (reference/validation.md) with the shipped
defaults; the NeMo/Megatron-Bridge summary (bench/data/): every dense FP8/BF16 row on DGX H100/B200
without context parallelism, as `fidelity_nemo.py` says.

Run: `.venv/bin/python bench/fidelity.py` (about 3 minutes on 2 cores). Writes bench/results/fidelity.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from fidelity_nemo import nemo
from testbed import plan_key

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.datasets.traces.bundle import IterationRecord, read_bundle
from tagplan.datasets.traces.importing import import_to_bundle
from tagplan.ir.cluster import DeviceSpec
from tagplan.training.calibrate import fit_calibration, layer_times
from tagplan.training.iteration_fit import (
    IterationCase,
    cross_validate,
    fit_parameters,
    kendall_tau,
    predict_s,
    rebuild_cases,
    score,
)

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "tests" / "fixtures" / "traces" / "cpu-quick"
TESTBED = ROOT / "bench" / "data" / "testbed"
TESTBED_INTEL = ROOT / "bench" / "data" / "testbed-intel"
"""The same testbed measured on a second machine (an Intel Xeon VM; `bench/testbed.py --out`)."""
GPU = ROOT / "bench" / "data" / "gpu"


def testbed() -> dict[str, Any]:
    """Part (a): per variant, held-out MAPE, Kendall tau and first-choice regret."""
    bundle = read_bundle(BUNDLE)
    records = bundle.iterations()
    cases = rebuild_cases(records)
    train = [c for i, c in enumerate(cases) if i % 3 == 0]
    test = [c for i, c in enumerate(cases) if i % 3]
    ops = fit_calibration([bundle], iterations=False).calibration
    variants: dict[str, Calibration] = {
        "defaults": DEFAULT_CALIBRATION,
        "ops": ops,
        "iterations": fit_parameters(train, DEFAULT_CALIBRATION)[0],
        "ops+iterations": fit_parameters(train, ops)[0],
    }
    profiles, why_not = _profile_layers(bundle, cases)
    if profiles is not None:
        layered = DEFAULT_CALIBRATION.model_copy(update={"layers": layer_times(profiles)})
        variants |= {"layers": layered, "layers+iterations": fit_parameters(train, layered)[0]}
    truth = np.array([c.measured_s for c in test])
    out: dict[str, Any] = {"records": len(cases), "calibrated_on": len(train), "scored": len(test), "variants": {},
                           "layers_not_measured": why_not}
    for name, calibration in variants.items():
        predicted = predict_s(test, calibration)
        s = score(predicted, truth)
        out["variants"][name] = {"mape": s.mape, "kendall_tau": s.kendall_tau,
                                 "median_error": float(np.median(predicted / truth - 1.0)),
                                 "first_choice_regret": _regret(cases, calibration),
                                 "parameters": _parameters(calibration)}
    out["gnn"] = "measured on the gloo testbed (local_testbed: 'gnn correction'); this bundle has too few records"
    return out


def local_testbed(folder: Path = TESTBED) -> dict[str, Any] | None:
    """Part (a'): a testbed of `bench/testbed.py` (one- and two-process plans on gloo; `folder` per machine),
    calibrated on a third of its plans (iterations) on top of the op and link fit of the machine's own op and
    collective records (`folder`/ops, `tagplan profile --quick`), else of `cpu-quick` where that bundle was
    measured on the same CPU; also the iteration calibration without the CPU's dispatch time per
    kernel (the records scored as a non-eager runtime's), which shows what that parameter adds."""
    if not (folder / "manifest.json").is_file():
        return None
    bundle = read_bundle(folder)
    cases = rebuild_cases(bundle.iterations())
    train = [c for i, c in enumerate(cases) if i % 3 == 0]
    test = [c for i, c in enumerate(cases) if i % 3]
    variants = {"defaults": DEFAULT_CALIBRATION, "iterations": fit_parameters(train, DEFAULT_CALIBRATION)[0]}
    op_bundle = read_bundle(folder / "ops" if (folder / "ops" / "manifest.json").is_file() else BUNDLE)
    same_cpu = op_bundle.manifest.fingerprint.device_type == bundle.manifest.fingerprint.device_type
    if same_cpu:
        ops = fit_calibration([op_bundle], iterations=False).calibration
        variants |= {"ops": ops, "ops+iterations": fit_parameters(train, ops)[0]}
    profiles, why_not = _profile_layers(bundle, cases, tps=(1, 2))
    if profiles is not None:
        layered = DEFAULT_CALIBRATION.model_copy(update={"layers": layer_times(profiles)})
        variants["layers+iterations"] = fit_parameters(train, layered)[0]
    truth = np.array([c.measured_s for c in test])
    out: dict[str, Any] = {"device": bundle.manifest.fingerprint.device_type, "records": len(cases),
                           "calibrated_on": len(train), "scored": len(test), "variants": {},
                           "layers_not_measured": why_not,
                           "ops_not_fitted": None if same_cpu else "no op records of this CPU (cpu-quick's: another)",
                           "op_records": op_bundle.manifest.source if same_cpu else None}
    for name, calibration in variants.items():
        s = score(predict_s(test, calibration), truth)
        out["variants"][name] = {"mape": s.mape, "kendall_tau": s.kendall_tau,
                                 "first_choice_regret": _regret(cases, calibration),
                                 "host_dispatch_s": calibration.host_dispatch_s}
    flat = [replace(c, workload=c.workload.model_copy(update={"eager": False})) for c in cases]
    flat_fit = fit_parameters(flat[::3], DEFAULT_CALIBRATION)[0]
    s = score(predict_s([c for i, c in enumerate(flat) if i % 3], flat_fit), truth)
    out["variants"]["iterations, no dispatch time"] = {"mape": s.mape, "kendall_tau": s.kendall_tau,
                                                       "first_choice_regret": _regret(flat, flat_fit)}
    base = variants["ops+iterations" if same_cpu else "iterations"]
    out["variants"]["gnn correction"] = _gnn_correction(bundle, base, cases)
    out["sessions_agreement"] = sessions_agreement(folder, [r for i, r in enumerate(bundle.iterations()) if i % 3])
    start = "ops" if same_cpu else "defaults"
    _, folds = cross_validate(cases, variants[start])  # each plan scored by a fit on the folds without it
    out["iterations_cross_validated"] = {"folds": folds.folds, "records": folds.records, "mape": folds.after.mape,
                                         "kendall_tau": folds.after.kendall_tau, "on": start}
    return out


def sessions_agreement(folder: Path, scored: list[IterationRecord]) -> dict[str, Any] | None:
    """How well the testbed's own measuring sessions agree on the scored plans: what a model of the machine can
    be held to, since the times it is scored against carry the same noise. Per pair of sessions, Kendall tau and
    MAPE after the pair's median ratio (a session runs the machine at its own speed); per split of the sessions
    into two halves, tau between the halves' medians, and the first-choice regret of one half's fastest plan per
    model as the other half measured it (both ways). None where fewer than two sessions of the bundle's machine
    are kept, or where one of them did not measure a scored plan."""
    sessions = sorted(p for p in (folder / "sessions").glob("*") if (p / "manifest.json").is_file())
    device = read_bundle(folder).manifest.fingerprint.device_type
    times = []
    for path in sessions:
        bundle = read_bundle(path)
        if bundle.manifest.fingerprint.device_type == device:
            times.append({plan_key(r): r.measured_s for r in bundle.iterations()})
    if len(times) < 2:
        return None
    keys = [plan_key(r) for r in scored]
    if any(k not in t for t in times for k in keys):
        return None
    table = np.array([[t[k] for k in keys] for t in times])  # sessions x scored plans
    pairs = []
    for a, b in itertools.combinations(range(len(times)), 2):
        ratio = float(np.median(table[b] / table[a]))
        pairs.append({"kendall_tau": kendall_tau(table[a], table[b]),
                      "mape": float(np.mean(np.abs(table[a] * ratio / table[b] - 1)))})
    models = [r.model if isinstance(r.model, str) else json.dumps(r.model, sort_keys=True) for r in scored]
    halves = []
    for first in itertools.combinations(range(len(times)), len(times) // 2):
        if len(times) % 2 == 0 and 0 not in first:
            continue  # each split once
        second = [i for i in range(len(times)) if i not in first]
        one, two = np.median(table[list(first)], axis=0), np.median(table[second], axis=0)
        regret = max([*group_regrets(one, two, models).values(), *group_regrets(two, one, models).values(), 0.0])
        halves.append({"sessions": [list(first), second], "kendall_tau": kendall_tau(one, two),
                       "first_choice_regret": regret})
    taus = sorted(p["kendall_tau"] for p in pairs)
    return {"sessions": len(times), "plans": len(keys), "pairs": pairs, "halves": halves,
            "pair_tau_median": float(np.median(taus)), "pair_tau_range": [taus[0], taus[-1]],
            "pair_mape_median": float(np.median([p["mape"] for p in pairs])),
            "half_tau_median": float(np.median([h["kendall_tau"] for h in halves])),
            "half_regret_worst": max(h["first_choice_regret"] for h in halves)}


def gpu() -> dict[str, Any]:
    """Part (a''): per GPU bundle, held-out MAPE, Kendall tau, first-choice regret, and memory."""
    out: dict[str, Any] = {}
    for folder in sorted(p for p in GPU.glob("*") if (p / "iterations" / "manifest.json").is_file()):
        iterations = read_bundle(folder / "iterations")
        records = iterations.iterations()
        cases = rebuild_cases(records)
        train = [c for i, c in enumerate(cases) if i % 3 == 0]
        test = [c for i, c in enumerate(cases) if i % 3]
        ops = fit_calibration([read_bundle(folder / "ops")], iterations=False).calibration
        layered = ops.model_copy(update={"layers": layer_times(read_bundle(folder / "layers").layers())})
        variants = {"defaults": DEFAULT_CALIBRATION, "ops": ops,
                    "iterations": fit_parameters(train, DEFAULT_CALIBRATION)[0],
                    "ops+iterations": fit_parameters(train, ops)[0],
                    "ops+layers+iterations": fit_parameters(train, layered)[0]}
        if (traced := _traced_ops(folder, iterations.manifest.device)) is not None:
            variants |= {"traced ops": traced, "traced ops+iterations": fit_parameters(train, traced)[0]}
        truth = np.array([c.measured_s for c in test])
        scored: dict[str, Any] = {}
        for name, calibration in variants.items():
            predicted = predict_s(test, calibration)
            s = score(predicted, truth)
            scored[name] = {"mape": s.mape, "kendall_tau": s.kendall_tau,
                            "median_error": float(np.median(predicted / truth - 1.0)),
                            "first_choice_regret": _regret(cases, calibration), "parameters": _parameters(calibration)}
        out[folder.name] = {"device": iterations.manifest.device.name if iterations.manifest.device else None,
                            "records": len(cases), "calibrated_on": len(train), "scored": len(test),
                            "variants": scored, "memory": _memory(cases, records),
                            "other_family": _other_family(folder, cases, ops), "repeat": _repeat(folder, records),
                            "fits": _fits(folder), "exported": _exported(folder, cases, ops)}
    folders = sorted(p for p in GPU.glob("*") if (p / "iterations" / "manifest.json").is_file())
    pairs = {f"{a.name}->{b.name}": _across(a, b) for a, b in itertools.permutations(folders, 2)}
    if pairs:
        out["across_devices"] = pairs
    return out


def _traced_ops(folder: Path, device: DeviceSpec | None) -> Calibration | None:
    """The op calibration fitted from the folder's Kineto steps (`kineto/*.trace.json.gz`, imported as `tagplan
    traces import` does): the kernels of real training steps, where `ops` times each op alone."""
    traces = sorted((folder / "kineto").glob("*.trace.json.gz"))
    if not traces or device is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        bundle = import_to_bundle(traces, Path(tmp) / "traced", device=device.name, source="bench/fidelity.py",
                                  kind="kineto")
        return fit_calibration([read_bundle(bundle)], iterations=False).calibration


def _exported(folder: Path, eager: list[IterationCase], ops: Calibration) -> dict[str, Any] | None:
    """tagplan's exported torch program run on the GPU (`iterations-export`, `bench/gpu_export_check.py`), held out:
    scored with the defaults and with the op fit plus every eager GPT iteration's parameters; each run beside the
    eager run of the same shape, and its peak memory against the memory model."""
    if not (folder / "iterations-export" / "manifest.json").is_file():
        return None
    records = read_bundle(folder / "iterations-export").iterations()
    cases = rebuild_cases(records)
    truth = np.array([c.measured_s for c in cases])
    variants = {"defaults": DEFAULT_CALIBRATION, "ops+eager gpt iterations": fit_parameters(eager, ops)[0]}
    scored = {}
    for name, calibration in variants.items():
        predicted = predict_s(cases, calibration)
        sc = score(predicted, truth)
        scored[name] = {"mape": sc.mape, "kendall_tau": sc.kendall_tau,
                        "errors": [float(e) for e in predicted / truth - 1]}
    eager_s = {(c.model.name, c.workload.seq_len, c.workload.global_batch, c.plan.micro_batches,
                c.plan.stages[0].recompute): c.measured_s for c in _gpu_cases(folder)[1]}
    rows = [{"model": c.model.name, "seq_len": c.workload.seq_len, "global_batch": c.workload.global_batch,
             "micro_batches": c.plan.micro_batches, "recompute": c.plan.stages[0].recompute,
             "measured_s": c.measured_s,
             "eager_s": eager_s.get((c.model.name, c.workload.seq_len, c.workload.global_batch,
                                     c.plan.micro_batches, c.plan.stages[0].recompute))}
            for c in cases]
    return {"records": len(cases), "variants": scored, "rows": rows, "memory": _memory(cases, records)}


def _fits(folder: Path) -> dict[str, Any]:
    """The memory model's verdict (shipped defaults) on every case the GPU ran and every case it ran out
    of memory on (`out-of-memory.json` beside a bundle, written by `bench/gpu_profile.py`): the cases
    it says do not fit though they ran, and those it says fit though they did not."""
    from gpu_profile import OUT_OF_MEMORY_FILE

    from tagplan.cost.simulator import Simulator
    from tagplan.frontends.cluster_file import parse_cluster_data
    from tagplan.frontends.cpu import gpu_cluster
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir.workload import DType
    from tagplan.profiling.iterations import IterationCase as Shape
    from tagplan.profiling.iterations import case_workload_plan

    records, cases = _gpu_cases(folder)
    device = cases[0].cluster.devices[0].spec
    ran_refused = [{"model": c.model.name, "seq_len": c.workload.seq_len, "micro_batches": c.plan.micro_batches,
                    "recompute": c.plan.stages[0].recompute, "measured_gib": r.peak_memory_bytes / 2**30}
                   for r, c in zip(records, cases, strict=True) if r.peak_memory_bytes
                   and not Simulator(c.model, c.cluster, c.workload, calibration=DEFAULT_CALIBRATION).fits(c.plan)]
    cluster = parse_cluster_data(gpu_cluster(device))
    refused = []
    for path in sorted(folder.glob(f"*/{OUT_OF_MEMORY_FILE}")):
        for fields in json.loads(path.read_text()):
            shape = Shape(**fields)
            workload, plan = case_workload_plan(shape, DType.BF16)
            report = Simulator(load_model(shape.spec, seq_len=shape.seq_len, dtype=DType.BF16), cluster, workload,
                               calibration=DEFAULT_CALIBRATION).simulate(plan)
            refused.append({"model": shape.spec, "seq_len": shape.seq_len, "micro_batches": shape.micro_batches,
                            "recompute": shape.recompute, "predicted_gib": report.peak_memory_bytes / 2**30,
                            "predicted_fits": report.fits})
    return {"device": device.name, "capacity_gib": device.mem_bytes / 2**30, "ran": len(cases),
            "ran_but_predicted_not_to_fit": ran_refused, "out_of_memory": refused,
            "out_of_memory_predicted_to_fit": sum(r["predicted_fits"] for r in refused)}


def _gpu_cases(folder: Path) -> tuple[list[IterationRecord], list[IterationCase]]:
    """Every one-GPU iteration of a device folder, GPT then Llama."""
    records = [r for part in ("iterations", "iterations-llama") if (folder / part / "manifest.json").is_file()
               for r in read_bundle(folder / part).iterations()]
    return records, rebuild_cases(records)


def as_device(calibration: Calibration, source: str, target: str) -> Calibration:
    """`calibration` with every figure fitted for device type `source` filed under `target` (layer
    records, which are absolute seconds of the source device, dropped): what a user without
    measurements of `target` would apply from a sibling."""
    def renamed(table: dict[str, Any]) -> dict[str, Any]:
        return {(target + k[len(source):] if k == source or k.startswith(source + "/") else k): v
                for k, v in table.items()}

    fields = ("compute", "memory_efficiency", "links", "launch_by_device", "compute_scale", "link_scales",
              "micro_batch_overhead_s", "iteration_overhead_s", "p2p_overhead_s", "collective_overhead_s",
              "recompute_overhead_s", "optimizer_scale", "host_dispatch_s", "zero3_comm_scale", "zero3_hidden_fraction")
    return calibration.model_copy(update={**{f: renamed(getattr(calibration, f)) for f in fields}, "layers": ()})


def _across(source: Path, target: Path) -> dict[str, Any]:
    """One GPU's measurements against another's: (1) the speed ratio of the two on the cases both ran,
    measured against predicted with the shipped defaults (what splitting a batch across unequal GPUs
    rests on); (2) the source's op and iteration fit (all its GPT iterations) applied to the target by
    name, scored on every target iteration, beside the target's defaults."""
    src_records, src_cases = _gpu_cases(source)
    dst_records, dst_cases = _gpu_cases(target)
    src_name, dst_name = src_cases[0].cluster.devices[0].spec.name, dst_cases[0].cluster.devices[0].spec.name
    def key(r: IterationRecord) -> tuple[Any, ...]:
        return *plan_key(r), r.workload.seq_len, r.workload.global_batch

    by_key = {key(r): c for r, c in zip(src_records, src_cases, strict=True)}
    shared = [(by_key[key(r)], c) for r, c in zip(dst_records, dst_cases, strict=True) if key(r) in by_key]
    ratios = []
    for a, b in shared:
        predicted = predict_s([b], DEFAULT_CALIBRATION)[0] / predict_s([a], DEFAULT_CALIBRATION)[0]
        ratios.append({"model": b.model.name, "seq_len": b.workload.seq_len, "global_batch": b.workload.global_batch,
                       "micro_batches": b.plan.micro_batches, "recompute": b.plan.stages[0].recompute,
                       "measured_ratio": b.measured_s / a.measured_s, "predicted_ratio": predicted,
                       "error": predicted / (b.measured_s / a.measured_s) - 1})
    errors = np.abs([r["error"] for r in ratios])
    gpt = [c for r, c in zip(src_records, src_cases, strict=True) if r.model.startswith("gpt")]
    ops = fit_calibration([read_bundle(source / "ops")], iterations=False).calibration
    transferred = as_device(fit_parameters(gpt, ops)[0], src_name, dst_name)
    truth = np.array([c.measured_s for c in dst_cases])
    scored = {}
    for name, calibration in {"target defaults": DEFAULT_CALIBRATION, "source ops": as_device(ops, src_name, dst_name),
                              "source ops+gpt iterations": transferred}.items():
        sc = score(predict_s(dst_cases, calibration), truth)
        scored[name] = {"mape": sc.mape, "kendall_tau": sc.kendall_tau}
    return {"source": src_name, "target": dst_name, "shared_cases": len(ratios), "ratio_rows": ratios,
            "ratio_median_abs_error": float(np.median(errors)) if ratios else None,
            "ratio_worst_abs_error": float(errors.max()) if ratios else None,
            "target_records": len(dst_cases), "transfer": scored}


def _other_family(folder: Path, fitted_on: list[IterationCase], ops: Calibration) -> dict[str, Any] | None:
    """The Llama iterations (`iterations-llama`), which no fit sees: scored with the defaults, the op fit,
    and the op fit plus every GPT iteration's parameters; then a third of GPT and Llama together
    calibrating, the rest of both scored."""
    if not (folder / "iterations-llama" / "manifest.json").is_file():
        return None
    records = read_bundle(folder / "iterations-llama").iterations()
    cases = rebuild_cases(records)
    truth = np.array([c.measured_s for c in cases])
    out: dict[str, Any] = {"records": len(cases), "memory": _memory(cases, records), "variants": {}}
    for name, calibration in {"defaults": DEFAULT_CALIBRATION, "ops": ops,
                              "ops+gpt iterations": fit_parameters(fitted_on, ops)[0]}.items():
        s = score(predict_s(cases, calibration), truth)
        out["variants"][name] = {"mape": s.mape, "kendall_tau": s.kendall_tau,
                                 "first_choice_regret": _regret(cases, calibration)}
    both = fitted_on + cases
    train = [c for i, c in enumerate(both) if i % 3 == 0]
    test = [c for i, c in enumerate(both) if i % 3]
    s = score(predict_s(test, fit_parameters(train, ops)[0]), np.array([c.measured_s for c in test]))
    out["both_families_third"] = {"calibrated_on": len(train), "scored": len(test), "mape": s.mape,
                                  "kendall_tau": s.kendall_tau}
    return out


def _repeat(folder: Path, records: list[Any]) -> dict[str, Any] | None:
    """Run-to-run spread: every third GPT case measured again on another machine of the same kind
    (`iterations-repeat`); |second / first - 1| per case."""
    if not (folder / "iterations-repeat" / "manifest.json").is_file():
        return None
    first = {(r.model, r.workload.seq_len, r.workload.global_batch, json.dumps(r.plan, sort_keys=True)): r.measured_s
             for r in records}
    rows = [{"model": r.model, "seq_len": r.workload.seq_len, "micro_batches": r.plan["micro_batches"],
             "first_s": first[key], "second_s": r.measured_s, "change": r.measured_s / first[key] - 1}
            for r in read_bundle(folder / "iterations-repeat").iterations()
            for key in [(r.model, r.workload.seq_len, r.workload.global_batch, json.dumps(r.plan, sort_keys=True))]
            if key in first]
    changes = np.abs([row["change"] for row in rows])
    return {"rows": rows, "median_abs_change": float(np.median(changes)), "worst_abs_change": float(changes.max())}


def _memory(cases: list[IterationCase], records: list[Any]) -> dict[str, Any]:
    """Each iteration's predicted peak memory (shipped defaults) against the measured peak allocation."""
    from tagplan.cost.simulator import Simulator

    rows = []
    for c, r in zip(cases, records, strict=True):
        if r.peak_memory_bytes is None:
            continue
        report = Simulator(c.model, c.cluster, c.workload, calibration=DEFAULT_CALIBRATION).simulate(c.plan)
        rows.append({"model": c.model.name, "seq_len": c.workload.seq_len, "global_batch": c.workload.global_batch,
                     "micro_batches": c.plan.micro_batches, "recompute": c.plan.stages[0].recompute,
                     "measured_gib": r.peak_memory_bytes / 2**30, "predicted_gib": report.peak_memory_bytes / 2**30,
                     "error": report.peak_memory_bytes / r.peak_memory_bytes - 1})
    errors = np.abs([row["error"] for row in rows])
    return {"rows": rows, "median_abs_error": float(np.median(errors)) if rows else None,
            "worst_abs_error": float(errors.max()) if rows else None}


def _gnn_correction(bundle: Any, calibration: Calibration, cases: list[IterationCase]) -> dict[str, Any]:
    """The shipped GNN fine-tuned on the same third of the testbed (`training.traces.finetune`, its
    targets and features from the ops+iterations calibration), scored on the rest; the first choice
    per group is the plan the corrected prediction ranks first."""
    from tagplan.gnn.model import load_checkpoint
    from tagplan.training.registry import PACKAGED_CHECKPOINT
    from tagplan.training.traces import TraceFinetune, finetune, measured_graphs, predicted_s

    items = measured_graphs([bundle], calibration)
    if [m.measured_s for m in items] != [c.measured_s for c in cases]:
        raise RuntimeError("the fine-tuning records are not the testbed's cases in order")
    train = [m for i, m in enumerate(items) if i % 3 == 0]
    test = [m for i, m in enumerate(items) if i % 3]
    tuned = finetune(load_checkpoint(PACKAGED_CHECKPOINT)[0], train, TraceFinetune())
    s = score(predicted_s(tuned, test), np.array([m.measured_s for m in test]))
    every = predicted_s(tuned, items)
    groups: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for i, c in enumerate(cases):
        groups[(c.model.name, c.workload.global_batch, c.workload.seq_len)].append(i)
    regret = {"/".join(map(str, key)): cases[min(ix, key=lambda i: every[i])].measured_s
              / min(cases[i].measured_s for i in ix) - 1 for key, ix in groups.items() if len(ix) > 1}
    return {"mape": s.mape, "kendall_tau": s.kendall_tau, "first_choice_regret": regret}


def _profile_layers(bundle: Any, cases: list[IterationCase], *,
                    tps: tuple[int, ...] = (1,)) -> tuple[list[Any] | None, str | None]:
    """Layer records of every model shape in the bundle, measured now on this CPU (fp32, at `tps`);
    (None, why) when this CPU is not the one the bundle was measured on (its profiles would describe
    another machine under the bundle's name)."""
    import torch

    from tagplan.profiling.device import fingerprint
    from tagplan.profiling.layers import layer_records

    device = bundle.manifest.fingerprint.device_type
    host = fingerprint("cpu").device_type
    if host != device:
        why = f"this machine is {host}; the bundle was measured on {device}"
        print(f"layer profiles not measured: {why}", flush=True)
        return None, why
    torch.set_num_threads(1)  # as the bundle's iterations were timed
    seen, out = set(), []
    for record in bundle.iterations():
        key = (record.model, record.workload.seq_len)
        if key in seen or not isinstance(record.model, str):
            continue
        seen.add(key)
        out += list(layer_records(record.model, device="cpu", device_type=device, seq_len=record.workload.seq_len,
                                  micro_batches=(1, 2, 4, 8), tps=tps, repeats=5))
    return out, None


def _regret(cases: list[IterationCase], calibration: Calibration) -> dict[str, float]:
    """Per (model, batch) group of 2+ plans: measured time of the predicted-fastest / fastest measured - 1."""
    groups = ["/".join(map(str, (c.model.name, c.workload.global_batch, c.workload.seq_len))) for c in cases]
    return group_regrets(predict_s(cases, calibration), np.array([c.measured_s for c in cases]), groups)


def group_regrets(ranking: np.ndarray, truth: np.ndarray, groups: list[str]) -> dict[str, float]:
    """Per group of 2+ entries: how much slower (in `truth`) the entry `ranking` puts first ran than the
    group's fastest, as a fraction."""
    out = {}
    for group in dict.fromkeys(groups):
        idx = [i for i, g in enumerate(groups) if g == group]
        if len(idx) > 1:
            chosen = min(idx, key=lambda i: ranking[i])
            out[group] = float(truth[chosen] / min(truth[i] for i in idx) - 1)
    return out


def _parameters(c: Calibration) -> dict[str, Any]:
    return {"compute_scale": c.compute_scale, "micro_batch_overhead_s": c.micro_batch_overhead_s,
            "link_scales": {k: v.model_dump() for k, v in c.link_scales.items()}, "p2p_overhead_s": c.p2p_overhead_s,
            "collective_overhead_s": c.collective_overhead_s, "recompute_overhead_s": c.recompute_overhead_s,
            "iteration_overhead_s": c.iteration_overhead_s, "optimizer_scale": c.optimizer_scale,
            "host_dispatch_s": c.host_dispatch_s,
            "layer_profiles": len(c.layers)}


def published() -> dict[str, Any]:
    """Part (b): the Megatron-Core H100 rows with the shipped defaults; the NeMo rows screened."""
    sys.path.insert(0, str(Path(__file__).parent))
    from validate_megatron import ROWS, simulate_row

    megatron: list[dict[str, Any]] = []
    for name, heads, hidden, layers, tp, pp, _dp, gpus, batch, published_tflops in ROWS:
        row = simulate_row(heads, hidden, layers, tp, pp, gpus, batch)
        megatron.append({"model": name, "gpu": "H100-SXM", "dtype": "bf16", "published": published_tflops,
                         "predicted": row["tflops_per_gpu"], "error": row["tflops_per_gpu"] / published_tflops - 1})
    errors = np.abs(np.array([float(r["error"]) for r in megatron]))
    return {"megatron_core_h100": {"rows": megatron, "median_abs_error": float(np.median(errors)),
                                   "worst_abs_error": float(errors.max())},
            "nemo": nemo()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("published", "gpu"),
                        help="recompute part (b) or the GPU bundles only and merge it into the existing results file")
    args = parser.parse_args()
    out = Path(__file__).parent / "results" / "fidelity.json"
    if args.only == "published":
        results = {**json.loads(out.read_text()), "published": published()}
    elif args.only == "gpu":
        results = {**json.loads(out.read_text()), "gpu": gpu()}
    else:
        results = {"testbed": testbed(), "local_testbed": local_testbed(), "local_testbed_intel":
                   local_testbed(TESTBED_INTEL), "gpu": gpu(), "published": published()}
    for name, v in results["testbed"]["variants"].items():
        tau = v["kendall_tau"]
        regret = max(v["first_choice_regret"].values(), default=0.0)
        print(f"{name:>18s}  MAPE {v['mape']:7.1%}  tau {'-' if tau is None else f'{tau:.3f}':>5s}  "
              f"worst first-choice regret {regret:.1%}")
    for key in ("local_testbed", "local_testbed_intel"):
        local = results.get(key) or {}
        for name, v in local.get("variants", {}).items():
            regret = max(v["first_choice_regret"].values(), default=0.0)
            print(f"testbed {local.get('device', ''):>14s} {name:>28s}  MAPE {v['mape']:7.1%}  "
                  f"tau {v['kendall_tau']:.3f}  worst first-choice regret {regret:.1%}")
    for key in ("local_testbed", "local_testbed_intel"):
        folds = (results.get(key) or {}).get("iterations_cross_validated")
        if folds:
            print(f"testbed {results[key]['device']:>14s} iterations on {folds['on']}, {folds['folds']}-fold over all "
                  f"{folds['records']} plans: MAPE {folds['mape']:.1%}  tau {folds['kendall_tau']:.3f}")
        agree = (results.get(key) or {}).get("sessions_agreement")
        if agree:
            print(f"testbed {results[key]['device']:>14s} sessions agree ({agree['sessions']} sessions, "
                  f"{agree['plans']} scored plans): tau per pair {agree['pair_tau_median']:.3f} (median), "
                  f"halves {agree['half_tau_median']:.3f}; MAPE per pair {agree['pair_mape_median']:.1%}; "
                  f"first choice across halves {agree['half_regret_worst']:.1%} at worst")
    for folder, g in results.get("gpu", {}).items():
        if folder == "across_devices":
            continue
        for name, v in g["variants"].items():
            regret = max(v["first_choice_regret"].values(), default=0.0)
            print(f"gpu {folder} {name:>22s}  MAPE {v['mape']:7.1%}  tau {v['kendall_tau']:.3f}  worst first-choice "
                  f"regret {regret:.1%}")
        mem = g["memory"]
        print(f"gpu {folder} peak memory ({len(mem['rows'])} iterations): median |error| "
              f"{mem['median_abs_error']:.1%}, worst {mem['worst_abs_error']:.1%}")
        other = g.get("other_family")
        for name, v in (other or {}).get("variants", {}).items():
            print(f"gpu {folder} llama (held out) {name:>18s}  MAPE {v['mape']:7.1%}  tau {v['kendall_tau']:.3f}")
        if other:
            both, mem = other["both_families_third"], other["memory"]
            print(f"gpu {folder} gpt+llama, a third calibrating: MAPE {both['mape']:.1%}  "
                  f"tau {both['kendall_tau']:.3f}; "
                  f"llama peak memory median |error| {mem['median_abs_error']:.1%}, worst {mem['worst_abs_error']:.1%}")
        exported = g.get("exported")
        for name, v in (exported or {}).get("variants", {}).items():
            print(f"gpu {folder} exported torch program ({exported['records']} runs, held out) {name:>24s}  "
                  f"MAPE {v['mape']:7.1%}  tau {v['kendall_tau']:.3f}")
        if exported:
            print(f"gpu {folder} exported torch program peak memory: median |error| "
                  f"{exported['memory']['median_abs_error']:.1%}, worst {exported['memory']['worst_abs_error']:.1%}")
        fit = g["fits"]
        print(f"gpu {folder} fits in {fit['capacity_gib']:.0f} GiB: {len(fit['ran_but_predicted_not_to_fit'])} of "
              f"{fit['ran']} cases that ran predicted not to fit; {fit['out_of_memory_predicted_to_fit']} of "
              f"{len(fit['out_of_memory'])} that ran out of memory predicted to fit")
        if g.get("repeat"):
            print(f"gpu {folder} run-to-run: median |change| {g['repeat']['median_abs_change']:.1%}, worst "
                  f"{g['repeat']['worst_abs_change']:.1%} over {len(g['repeat']['rows'])} cases")
    for pair, a in results.get("gpu", {}).get("across_devices", {}).items():
        print(f"gpu {pair}: {a['target']}/{a['source']} time ratio on {a['shared_cases']} shared cases, predicted vs "
              f"measured: median |error| {a['ratio_median_abs_error']:.1%}, worst {a['ratio_worst_abs_error']:.1%}")
        for name, v in a["transfer"].items():
            print(f"gpu {pair} {name:>26s} on all {a['target_records']} {a['target']} iterations: "
                  f"MAPE {v['mape']:7.1%}  tau {v['kendall_tau']:.3f}")
    m = results["published"]["megatron_core_h100"]
    for r in m["rows"]:
        print(f"{r['model']:>6s} H100 bf16 published {r['published']:6.1f} predicted {r['predicted']:6.1f} "
              f"{r['error']:+.1%}")
    print(f"Megatron-Core H100: median |error| {m['median_abs_error']:.1%}, worst {m['worst_abs_error']:.1%}")
    n = results["published"]["nemo"]
    for r in n["scored"]:
        print(f"{r['model']:>16s} {r['gpu']} x{r['gpus']} {r['precision']} tp{r['tp']} pp{r['pp']} vp{r['vp']}: "
              f"published {r['measured_tokens_s_gpu']:.0f} predicted {r['predicted_tokens_s_gpu']:.0f} tokens/s/GPU "
              f"{r['error']:+.1%}" + (f" (with recompute to fit {r['error_fitting']:+.1%})"
                                      if r["recompute_to_fit"] else ""))
    print(f"NeMo: {len(n['scored'])} rows scored, median |error| {n['median_abs_error']:.1%}, worst "
          f"{n['worst_abs_error']:.1%}; recomputing where a layout does not fit otherwise: median "
          f"{n['median_abs_error_fitting']:.1%}, worst {n['worst_abs_error_fitting']:.1%}; not scored: {n['skipped']}")
    out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
