"""The GPU part of bench/fidelity.py: one GPU's calibration filed under another, and the memory
model's verdict on the cases the committed H100 session ran and ran out of memory on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_modules import BENCH, load_bench

from tagplan.cost.calibration import (
    MEASURED_CAUSAL_DIAGONAL_TOKENS,
    MEASURED_CAUSAL_TIME_FRACTION,
    Calibration,
    LayerTime,
    LinkScale,
)
from tagplan.ir.workload import DType

H100 = BENCH / "data" / "gpu" / "h100"


def test_a_calibration_filed_under_a_sibling_device_keeps_its_figures_and_drops_its_layer_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # fidelity imports its sibling scripts
    as_device = load_bench("fidelity").as_device
    layer = LayerTime(block_hash="abc", device="H200-SXM", dtype=DType.BF16, seq_len=1024, micro_batch=1,
                      forward_s=1e-3, backward_s=2e-3)
    fitted = Calibration(compute_scale={"H200-SXM": 0.9, "A100-SXM-80GB": 1.2}, host_dispatch_s={"H200-SXM": 4e-5},
                         link_scales={"H200-SXM/intra": LinkScale(bandwidth_scale=0.8, latency_s=1e-5)},
                         optimizer_scale={"*": 2.0}, layers=(layer,))
    moved = as_device(fitted, "H200-SXM", "H100-SXM")
    assert moved.compute_scale == {"H100-SXM": 0.9, "A100-SXM-80GB": 1.2}  # another device's figure stays its own
    assert moved.host_dispatch_s == {"H100-SXM": 4e-5} and moved.optimizer_scale == {"*": 2.0}
    assert list(moved.link_scales) == ["H100-SXM/intra"] and moved.link_scales["H100-SXM/intra"].bandwidth_scale == 0.8
    assert moved.layers == ()  # the H200's measured seconds do not describe an H100
    assert as_device(fitted, "H200-SXM-141GB", "H100-SXM").compute_scale == fitted.compute_scale  # no prefix match


def test_the_memory_model_is_put_to_the_cases_the_h100_ran_and_ran_out_of_memory_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    fits = load_bench("fidelity")._fits(H100)
    refused = json.loads((H100 / "iterations-llama" / "out-of-memory.json").read_text())
    assert fits["device"] == "H100-SXM" and len(fits["out_of_memory"]) == len(refused) == 3
    assert fits["ran"] == 41 and fits["ran_but_predicted_not_to_fit"] == []  # every case that ran is judged to fit
    for row in fits["out_of_memory"]:  # a verdict is the prediction against the device's memory
        assert row["predicted_fits"] == (row["predicted_gib"] <= fits["capacity_gib"])
    assert sum(not row["predicted_fits"] for row in fits["out_of_memory"]) >= 2  # Llama-8B at 4k x1, 3B-sized x2


def test_out_of_memory_cases_round_trip_into_profiling_shapes() -> None:
    from tagplan.profiling.iterations import CUDA_LLAMA_CASES, IterationCase

    rows = json.loads((H100 / "iterations-llama" / "out-of-memory.json").read_text())
    assert all(IterationCase(**row) in CUDA_LLAMA_CASES for row in rows)
    assert Path(H100 / "iterations-llama" / "records.jsonl").read_text().count("\n") + len(rows) == \
        len(CUDA_LLAMA_CASES)  # every Llama case either ran or is named as out of memory


def test_the_exported_programs_runs_are_scored_beside_the_eager_runs_of_the_same_shapes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    fidelity = load_bench("fidelity")
    h200 = BENCH / "data" / "gpu" / "h200"
    monkeypatch.setattr(fidelity, "fit_parameters", lambda cases, start: (start, None))  # the pairing, not the fit
    out = fidelity._exported(h200, [], Calibration())
    assert out["records"] == 7 and len(out["memory"]["rows"]) == 7  # every exported run carries its peak
    assert all(row["eager_s"] is not None for row in out["rows"])  # each shape also ran eager on the H200
    assert set(out["variants"]) == {"defaults", "ops+eager gpt iterations"}
    assert all(len(v["errors"]) == 7 for v in out["variants"].values())
    assert fidelity._exported(H100, [], Calibration()) is None  # no exported runs there


def test_the_kineto_step_by_kind_covers_the_trace_and_the_causal_figures_move_attention_only() -> None:
    bench = load_bench("fit_causal_attention")
    trace = json.loads((BENCH / "data" / "gpu" / "h200" / "kineto" / "kernels.json").read_text())["llama-8b-8l"]
    fitted = Calibration(causal_time_fraction=MEASURED_CAUSAL_TIME_FRACTION,
                         causal_diagonal_tokens=MEASURED_CAUSAL_DIAGONAL_TOKENS)
    step = bench.kineto_step(fitted)
    assert sum(kind.get("trace_ms", 0.0) for kind in step.values()) == pytest.approx(1e3 * trace["device_busy_s"])
    assert "other" not in step or step["other"]["trace_ms"] < 0.01 * 1e3 * trace["device_busy_s"]
    attention = step["flash attention"]
    assert attention["fitted_causal_ms"] < 0.7 * attention["defaults_ms"]
    assert all(kind.get("fitted_causal_ms") == kind.get("defaults_ms") for name, kind in step.items()
               if name != "flash attention")


def test_the_shipped_measured_causal_figures_are_the_committed_fit_rounded() -> None:
    fit = json.loads((BENCH / "results" / "causal_attention.json").read_text())
    assert round(fit["causal_time_fraction"], 3) == MEASURED_CAUSAL_TIME_FRACTION
    assert round(fit["causal_diagonal_tokens"]) == MEASURED_CAUSAL_DIAGONAL_TOKENS


@pytest.mark.slow
def test_the_traced_ops_fit_files_the_steps_kernels_under_the_gpu_and_finds_them_faster_than_the_op_grid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/fidelity.py's "traced ops": the H200's Kineto steps imported as `tagplan traces import` does and fitted;
    its GEMMs, timed inside real steps, run nearer the sustained peak than the standalone op grid's (FIDELITY (d));
    no Kineto steps (the H100) or no device: no variant."""
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.frontends.catalog import lookup_device
    from tagplan.ir.model import OpKind
    from tagplan.training.calibrate import fit_calibration

    monkeypatch.syspath_prepend(str(BENCH))
    fidelity = load_bench("fidelity")
    h200, spec = BENCH / "data" / "gpu" / "h200", lookup_device("H200-SXM")
    traced = fidelity._traced_ops(h200, spec)
    assert traced is not None and spec.name in traced.launch_by_device
    assert {f"{spec.name}/elementwise", f"{spec.name}/layernorm"} <= set(traced.memory_efficiency)
    grid = fit_calibration([read_bundle(h200 / "ops")], iterations=False).calibration
    steps, alone = traced.curve(spec.name, OpKind.MATMUL), grid.curve(spec.name, OpKind.MATMUL)
    assert steps is not None and alone is not None
    assert steps.at(1e11) > 1.2 * alone.at(1e11)
    assert fidelity._traced_ops(H100, lookup_device("H100-SXM")) is None
    assert fidelity._traced_ops(h200, None) is None
