"""Fit the host's time to issue one kernel under an eager runtime (`Calibration.eager_host_dispatch_s`), the
figure an eager run (`Workload.eager`: the torch program, tagplan's measured iterations) is costed with on a
GPU that no calibration names.

Eager PyTorch issues every kernel from Python through the dispatcher; on a fast GPU a block whose kernels are
shorter in all than their issue waits for the host (`compute.block_time`). No datasheet gives that time, so it
is fitted here, as the one free parameter, to the 30 GPT iterations of the H200 bundle
(`bench/data/gpu/h200/iterations`: GPT-2 small to 2.7B, 1-16 micro-batches, with and without recompute), every
other figure at the shipped defaults: the value minimising the squared log error of predicted against measured
iteration seconds (golden-section search on log h). Scored on the 14 Llama iterations of the same bundle,
which the fit never sees (another block, twice the kernels per layer), and on the repeated GPT runs taken on
another machine of the same kind. The fitted value is what `cost.calibration.EAGER_HOST_DISPATCH_S` ships;
rerun this after a change to the cost model and update it.

Run: `.venv/bin/python bench/fit_eager_host.py` (about 20 seconds); writes bench/results/eager_host.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from fidelity import rebuild_cases
from fit_sustained_clock import fit as golden_section

from tagplan.cost.calibration import DEFAULT_CALIBRATION, EAGER_HOST_DISPATCH_S
from tagplan.datasets.traces.bundle import read_bundle
from tagplan.training.iteration_fit import IterationCase, kendall_tau, predict_s

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "bench" / "data" / "gpu" / "h200"
OUT = ROOT / "bench" / "results" / "eager_host.json"
BOUNDS_S = (1e-6, 3e-4)


def _errors(cases: list[IterationCase], host_s: float) -> np.ndarray:
    calibration = DEFAULT_CALIBRATION.model_copy(update={"eager_host_dispatch_s": host_s})
    predicted = np.array(predict_s(cases, calibration))
    return predicted / np.array([c.measured_s for c in cases]) - 1.0


def fit(cases: list[IterationCase]) -> float:
    """The host seconds per kernel minimising the summed squared log error over `cases` (`fit_sustained_clock.fit`'s
    golden-section search, on log h over `BOUNDS_S`; the loss is unimodal there: below the optimum small blocks
    come out too fast, above it large ones join the floor)."""
    def error(case: IterationCase, log_h: float) -> float:
        return float(np.log1p(_errors([case], math.exp(log_h))[0]))

    return math.exp(golden_section(cases, error=error, bounds=(math.log(BOUNDS_S[0]), math.log(BOUNDS_S[1]))))


def _score(cases: list[IterationCase], host_s: float) -> dict[str, Any]:
    errors = _errors(cases, host_s)
    predicted = [c.measured_s * (1 + e) for c, e in zip(cases, errors, strict=True)]
    return {"mape": float(np.mean(np.abs(errors))), "worst_abs_error": float(np.max(np.abs(errors))),
            "kendall_tau": kendall_tau([c.measured_s for c in cases], predicted)}


def main() -> None:
    parts = {name: rebuild_cases(read_bundle(BUNDLE / name).iterations())
             for name in ("iterations", "iterations-llama", "iterations-repeat")}
    fitted_s = fit(parts["iterations"])
    out: dict[str, Any] = {"fitted_on": "iterations (30 GPT runs)", "host_s_per_kernel": fitted_s,
                           "shipped": EAGER_HOST_DISPATCH_S, "scores": {}}
    for name, cases in parts.items():
        out["scores"][name] = {"none": _score(cases, 0.0), "fitted": _score(cases, fitted_s),
                               "shipped": _score(cases, EAGER_HOST_DISPATCH_S)}
    print(f"host seconds per kernel, fitted on the GPT iterations: {fitted_s * 1e6:.1f} us "
          f"(shipped: {EAGER_HOST_DISPATCH_S * 1e6:.1f} us)")
    print("| runs | no floor: MAPE / worst / tau | fitted floor | shipped floor |")
    print("|---|---|---|---|")
    for name, row in out["scores"].items():
        cells = [f"{v['mape']:.1%} / {v['worst_abs_error']:.1%} / {v['kendall_tau']:.3f}"
                 for v in (row["none"], row["fitted"], row["shipped"])]
        print(f"| {name} | " + " | ".join(cells) + " |")
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
