"""MosaicML's published MPT runs under FSDP (bench/data/mpt_fsdp_measured.json) and the plans
bench/fidelity_mpt.py rebuilds from them."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
from bench_modules import BENCH, load_bench

from tagplan.cost.simulator import Simulator
from tagplan.ir.workload import LossKernel

PEAK_FLOPS = {("a100_80gb", "bf16"): 312e12, ("a100_40gb", "bf16"): 312e12, ("h100_80gb", "bf16"): 989e12,
              ("h100_80gb", "fp8"): 1979e12}
"""The dense peaks the README's MFU divides by (A100 bf16, H100 SXM bf16 and fp8)."""


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("fidelity_mpt")


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    return json.loads((BENCH / "data" / "mpt_fsdp_measured.json").read_text())


def test_every_row_agrees_with_the_readmes_own_formulas(data: dict[str, Any]) -> None:
    """A transcription slip shows: each row's MFU follows from its throughput, NumParams and shape by the README's
    formula ((6 N + 12 L d s) tokens/s / peak), and its global batch is micro-batch x accumulation x GPUs."""
    assert len(data["rows"]) == 201
    for row in data["rows"]:
        shape = data["shapes"][row["model"]]
        flops_per_token = 6 * row["num_params"] + 12 * shape["layers"] * shape["hidden"] * row["seq_len"]
        peak = PEAK_FLOPS[row["gpu"], "fp8" if row["precision"] == "amp_fp8" else "bf16"]
        mfu = 100 * flops_per_token * row["tokens_per_s_per_gpu"] / peak
        assert mfu == pytest.approx(row["mfu_percent"], rel=5e-3), row
        assert row["global_batch"] == row["micro_batch_size"] * row["grad_accum"] * row["gpus"], row


def test_the_gpt_family_counts_each_rows_parameters(bench: ModuleType, data: dict[str, Any]) -> None:
    """MPT as these runs built it (biases, learned positions, tied head) is tagplan's gpt family at its shape."""
    seen = set()
    for row in data["rows"]:
        key = (row["model"], row["seq_len"])
        if key in seen:
            continue
        seen.add(key)
        assert bench.model_of(row, data["shapes"]).params == row["num_params"], key


def test_each_row_is_the_fsdp_iteration_it_ran(bench: ModuleType, data: dict[str, Any]) -> None:
    cases = bench.cases_of(data)
    for row, case in zip(data["rows"][::17], cases[::17], strict=True):
        (stage,) = case.plan.stages
        assert (stage.dp, stage.zero, stage.recompute) == (row["gpus"], 3, row["activation_checkpointing"])
        assert case.plan.micro_batches == row["grad_accum"]
        assert case.workload.loss is LossKernel.FUSED and case.workload.fused_attention
        assert case.workload.eager and case.workload.eager_16bit_weights and not case.workload.autocast  # FSDP's
        report = Simulator(case.model, case.cluster, case.workload).simulate(case.plan)
        assert report.stages[0].samples_per_micro_batch == row["micro_batch_size"]
        tokens_per_s_per_gpu = row["global_batch"] * row["seq_len"] / (case.measured_s * row["gpus"])
        assert tokens_per_s_per_gpu == pytest.approx(row["tokens_per_s_per_gpu"], rel=1e-12)


def test_the_ranking_within_a_model_is_by_throughput_and_skips_small_groups(bench: ModuleType) -> None:
    """`within_model_tau` ranks each (table, model) group's tokens/s per GPU: a group whose predicted order is the
    measured one reversed scores -1, one in order +1 (median of the two: 0), and groups under four runs count not."""

    def run(model: str, tokens: float, measured_s: float, predicted_s: float) -> dict[str, Any]:
        return {"table": "t", "model": model, "tokens_per_gpu": tokens, "measured_s": measured_s,
                "predicted_s": predicted_s}

    in_order = [run("a", 100.0, s, 2 * s) for s in (1.0, 2.0, 3.0, 4.0)]
    reversed_ = [run("b", 100.0, s, 5.0 - s) for s in (1.0, 2.0, 3.0, 4.0)]
    small = [run("c", 100.0, s, 10.0 - s) for s in (1.0, 2.0, 3.0)]
    assert bench.within_model_tau(in_order) == pytest.approx(1.0)
    assert bench.within_model_tau(reversed_) == pytest.approx(-1.0)
    assert bench.within_model_tau(in_order + reversed_ + small) == pytest.approx(0.0)
    assert bench.within_model_tau(small) is None
    # throughput, not time: equal measured times rank by tokens per GPU (by time alone they would not rank at all)
    by_tokens = [run("d", t, 1.0, t * t) for t in (1.0, 2.0, 3.0, 4.0)]  # predicted throughput 1 / t: reversed
    assert bench.within_model_tau(by_tokens) == pytest.approx(-1.0)
