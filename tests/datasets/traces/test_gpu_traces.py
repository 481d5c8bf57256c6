"""The Kineto importer on a real GPU trace: one bf16 mixed-precision training step of GPT-1.3B on an H200
(bench/data/gpu/h200/kineto, recorded by bench/gpu_kineto.py)."""

from __future__ import annotations

from pathlib import Path

from tagplan.datasets.traces.bundle import OpRecord
from tagplan.datasets.traces.kineto import read_kineto
from tagplan.frontends.catalog import lookup_device
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType

TRACE = Path(__file__).resolve().parents[3] / "bench" / "data" / "gpu" / "h200" / "kineto" / "gpt-1.3b.trace.json.gz"


def test_autocast_gemms_are_costed_in_the_dtype_their_kernels_ran_and_stay_under_the_peak() -> None:
    imported = read_kineto(TRACE, device="H200-SXM")
    gemms = [r for r in imported.records if r.kind is OpKind.MATMUL]
    assert {r.phase for r in gemms} == {"forward", "backward"}
    assert {r.dtype for r in gemms} == {DType.BF16}  # autocast's outer call sees fp32; the kernels ran bf16
    peak = lookup_device("H200-SXM").peak_flops_bf16
    assert peak is not None
    rates = [r.flops / r.time_s for r in gemms if r.flops > 1e11]
    assert rates and all(0.3 * peak < rate < peak for rate in rates)
    blocks = [r for r in gemms if r.phase == "forward" and r.repeats == 24]  # once per layer of the 24
    assert {(r.shape["m"], r.shape["k"]) for r in blocks} >= {(16384, 2048)}  # 8 x 2048 tokens, hidden 2048


def test_a_backward_gemm_record_is_its_forward_ops_figures_and_both_gradients_time() -> None:
    """The bundle's convention, which `training.calibrate` fits: a linear's backward record has the forward's
    FLOPs and the time of its two GEMMs (input and weight gradients), so it takes about twice the forward's time.
    (Recorded one GEMM at a time, each backward looked twice as efficient as its forward to the fit.)"""
    records = read_kineto(TRACE, device="H200-SXM").records
    forward: dict[float, list[OpRecord]] = {}
    backward: dict[float, list[OpRecord]] = {}
    for r in records:
        if r.kind is OpKind.MATMUL and r.repeats == 24:
            (forward if r.phase == "forward" else backward).setdefault(r.flops, []).append(r)
    # the QKV and output projections, the MLP's two (as many FLOPs as each other: 2 records each way)
    assert set(forward) == set(backward) and len(forward) == 3
    for flops, calls in backward.items():
        assert all(r.name == "AddmmBackward0 (2 GEMMs)" for r in calls) and len(calls) == len(forward[flops])
        ratio = sum(r.time_s for r in calls) / sum(r.time_s for r in forward[flops])
        assert 1.6 < ratio < 2.4


def test_a_causal_attention_call_is_recorded_as_one_and_its_backward_with_it() -> None:
    """The step's SDPA calls ran with `is_causal=True`: the records say so (`shape["causal"]`), the backward by its
    forward's figures, and the calibration's op for them is causal, which a fitted causal saving discounts."""
    from tagplan.training.calibrate import record_op

    attention = [r for r in read_kineto(TRACE, device="H200-SXM").records if r.kind is OpKind.ATTENTION]
    assert {r.phase for r in attention} == {"forward", "backward"}
    assert all(r.shape.get("causal") == 1 for r in attention)
    assert all(record_op(r).causal and record_op(r).output_shape[-2] == r.shape["seq"] for r in attention)
