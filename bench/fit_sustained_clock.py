"""Fit the H100 SXM's, the GB200's and the GB300's sustained tensor-core clocks
(`DeviceSpec.sustained_peak_fraction`), the H100's to the Megatron-Core H100 table
(../shared/reference/validation.md, `validate_megatron.ROWS`), and the block-scaled formats' GEMM fractions
(`Calibration.block_scaled_gemm_fraction`, `fit_format`).

A GPU's datasheet peak assumes its boost clock; under a training loop's continuous tensor-core load
the board's power cap (700 W on the H100 SXM) holds the clock lower, by an amount that depends on the
data the GEMMs switch (Horace He, "Strangely, matrix multiplications on GPUs run faster when given
predictable data", 2024). No datasheet gives that sustained clock, so it is fitted here, as the one
free parameter, to the nine published end-to-end runs: every row simulated as `validate_megatron`
does (its TP/PP/DP, 1F1B, distributed optimizer, sequence parallelism, and the README's overlaps:
`--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap`), the fraction minimising the
squared log error of predicted against published TFLOP/s per GPU. Leave-one-out: each row is also
predicted by the fraction fitted on the other eight. The NeMo rows (bench/fidelity_nemo.py) are never
used here: they are the out-of-sample check (FP8, Llama shapes, other layouts). The fitted value is
what `frontends.catalog.SUSTAINED_PEAK_FRACTION` ships for the H100 SXM (and the H200 SXM, the same
GH100 die under the same 700 W cap); rerun this after a change to the cost model and update it.

The GB200 (and B200) and GB300 (and B300) figures are fitted the same way, each to its NeMo / Megatron-Bridge
per-tensor fp8 rows (`fidelity_nemo.CLOCK_DTYPES`) whose presets run without full recompute
(`fidelity_nemo.recipe`; the rows `fidelity_nemo.fit_role` names), each preset's rows predicted by the
fraction fitted on the other presets' (leave-one-preset-out: the repeated runs of one preset are not
independent). No other table measures a Blackwell GPU, so these rows are in-sample for those figures. The
block-scaled rows (mxfp8, nvfp4) on the same GPUs are not fitted on for a clock: with the clocks fixed, each
format's GEMM fraction is fitted to them the same way (`fit_format`).

Run: `.venv/bin/python bench/fit_sustained_clock.py` (about five minutes); writes
bench/results/sustained_clock.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fidelity_nemo import CLOCK_FITTED, DATA, FRACTION_DTYPES, fit_role, score_row
from validate_megatron import ROWS, simulate_row

from tagplan.cost.calibration import DEFAULT_CALIBRATION
from tagplan.ir.workload import DType

DEVICE = "H100-SXM"
BOUNDS = (0.5, 1.0)


def _row_error(row: tuple[Any, ...], fraction: float) -> float:
    """log(predicted / published TFLOP/s per GPU) of one table row at `fraction`."""
    _name, heads, hidden, layers, tp, pp, _dp, gpus, batch, published = row
    figures = simulate_row(heads, hidden, layers, tp, pp, gpus, batch, sustained_peak_fraction=fraction)
    return math.log(figures["tflops_per_gpu"] / published)


def _nemo_error(row: dict[str, Any], fraction: float) -> float:
    """log(predicted / published tokens/s per GPU) of one NeMo row at `fraction`, without recompute."""
    scored = score_row(row, sustained_peak_fraction=fraction)
    return math.log(scored["predicted_tokens_s_gpu"] / scored["measured_tokens_s_gpu"])


def fit(rows: list[Any], tolerance: float = 1e-3,
        error: Callable[[Any, float], float] = _row_error, bounds: tuple[float, float] = BOUNDS) -> float:
    """The fraction minimising the rows' summed squared log error (golden-section search; the loss is
    unimodal in the fraction: a lower clock slows every row's compute monotonically)."""
    def loss(f: float) -> float:
        return sum(error(r, f) ** 2 for r in rows)

    g = (math.sqrt(5) - 1) / 2
    a, b = bounds
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > tolerance:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return round((a + b) / 2, 3)


def nemo_rows(gpu: str) -> list[dict[str, Any]]:
    """The scoreable NeMo rows on `gpu` in per-tensor fp8 whose preset is known to run without full recompute
    (`fidelity_nemo.fit_role`: the block-scaled rows are never fitted on for a clock)."""
    rows = json.loads(DATA.read_text())["rows"]
    return [r for r in rows if fit_role(r) == f"{gpu} clock"]


def fit_nemo(gpu: str) -> dict[str, Any]:
    """`gpu`'s fraction fitted to its NeMo rows, each (model, task) group predicted by the fraction
    fitted on the other groups (leave-one-group-out: repeated runs of one recipe are not independent)."""
    rows = nemo_rows(gpu)
    groups = sorted({(r["model"]["name"], r["config"]["task"]) for r in rows})
    fraction = fit(rows, error=_nemo_error)
    results = []
    for group in groups:
        held = fit([r for r in rows if (r["model"]["name"], r["config"]["task"]) != group], error=_nemo_error)
        for r in (r for r in rows if (r["model"]["name"], r["config"]["task"]) == group):
            results.append({"id": r["id"], "error": math.expm1(_nemo_error(r, fraction)), "held_out_fraction": held,
                            "held_out_error": math.expm1(_nemo_error(r, held))})
            print(f"{gpu} {r['id'][-60:]:>60s} {results[-1]['error']:+7.1%} {held:6.3f} "
                  f"{results[-1]['held_out_error']:+7.1%}")
    held_abs = sorted(abs(r["held_out_error"]) for r in results)
    return {"device": gpu, "sustained_peak_fraction": fraction, "rows": results, "groups": len(groups),
            "held_out_median_abs_error": held_abs[len(held_abs) // 2], "held_out_worst_abs_error": held_abs[-1]}


def format_rows(dtype: DType) -> list[dict[str, Any]]:
    """The scoreable NeMo rows in `dtype` on the clock-fitted GPUs whose preset runs without full recompute."""
    rows = json.loads(DATA.read_text())["rows"]
    return [r for r in rows if fit_role(r) == f"{dtype.value} fraction"]


def _format_error(dtype: DType) -> Callable[[dict[str, Any], float], float]:
    def error(row: dict[str, Any], fraction: float) -> float:
        calibration = DEFAULT_CALIBRATION.model_copy(
            update={"block_scaled_gemm_fraction": {**DEFAULT_CALIBRATION.block_scaled_gemm_fraction, dtype: fraction}})
        scored = score_row(row, calibration=calibration)
        return math.log(scored["predicted_tokens_s_gpu"] / scored["measured_tokens_s_gpu"])
    return error


def fit_format(dtype: DType) -> dict[str, Any]:
    """`dtype`'s GEMM fraction fitted to its rows on the clock-fitted GPUs (their clocks fixed, fitted on per-tensor
    fp8), each (model, task, GPU) preset's rows predicted by the fraction fitted on the other presets'."""
    rows = format_rows(dtype)
    error = _format_error(dtype)
    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return r["model"]["name"], r["config"]["task"], r["cluster"]["nodes"][0]["gpu"]
    groups = sorted({key(r) for r in rows})
    fraction = fit(rows, error=error, bounds=(0.2, 1.0))
    results = []
    for group in groups:
        held = fit([r for r in rows if key(r) != group], error=error, bounds=(0.2, 1.0))
        for r in (r for r in rows if key(r) == group):
            results.append({"id": r["id"], "error": math.expm1(error(r, fraction)), "held_out_fraction": held,
                            "held_out_error": math.expm1(error(r, held))})
            print(f"{dtype.value} {r['id'][-60:]:>60s} {results[-1]['error']:+7.1%} {held:6.3f} "
                  f"{results[-1]['held_out_error']:+7.1%}")
    held_abs = sorted(abs(r["held_out_error"]) for r in results)
    return {"dtype": dtype.value, "block_scaled_gemm_fraction": fraction, "rows": results, "groups": len(groups),
            "held_out_median_abs_error": held_abs[len(held_abs) // 2], "held_out_worst_abs_error": held_abs[-1]}


def main() -> None:
    fraction = fit(ROWS)
    results: list[dict[str, Any]] = []
    print(f"{'model':>6s} {'fitted error':>13s} {'held-out fraction':>18s} {'held-out error':>15s}")
    for i, row in enumerate(ROWS):
        held = fit([r for j, r in enumerate(ROWS) if j != i])
        err, held_err = math.expm1(_row_error(row, fraction)), math.expm1(_row_error(row, held))
        results.append({"model": row[0], "error": err, "held_out_fraction": held, "held_out_error": held_err})
        print(f"{row[0]:>6s} {err:+13.1%} {held:18.3f} {held_err:+15.1%}")
    held_abs = sorted(abs(r["held_out_error"]) for r in results)
    summary = {"device": DEVICE, "sustained_peak_fraction": fraction, "rows": results,
               "held_out_median_abs_error": held_abs[len(held_abs) // 2], "held_out_worst_abs_error": held_abs[-1]}
    print(f"{DEVICE}: sustained_peak_fraction {fraction:.3f}; leave-one-out |error| median "
          f"{summary['held_out_median_abs_error']:.1%}, worst {summary['held_out_worst_abs_error']:.1%}")
    blackwell = [fit_nemo(gpu) for gpu in CLOCK_FITTED]
    for fitted in blackwell:
        print(f"{fitted['device']}: sustained_peak_fraction {fitted['sustained_peak_fraction']:.3f} over "
              f"{fitted['groups']} recipes; leave-one-recipe-out |error| median "
              f"{fitted['held_out_median_abs_error']:.1%}, worst {fitted['held_out_worst_abs_error']:.1%}")
    formats = [fit_format(dtype) for dtype in FRACTION_DTYPES]
    for fitted in formats:
        print(f"{fitted['dtype']}: block_scaled_gemm_fraction {fitted['block_scaled_gemm_fraction']:.3f} over "
              f"{fitted['groups']} presets; leave-one-preset-out |error| median "
              f"{fitted['held_out_median_abs_error']:.1%}, worst {fitted['held_out_worst_abs_error']:.1%}")
    out = Path(__file__).parent / "results" / "sustained_clock.json"
    out.write_text(json.dumps({**summary, "nemo": blackwell, "formats": formats}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
