"""MosaicML's published MPT runs under FSDP (bench/data/mpt_fsdp_measured.json) and the plans
bench/fidelity_mpt.py rebuilds from them."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
from bench_modules import BENCH, load_bench

from tagplan.cost.simulator import Simulator

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
        assert case.workload.fused_loss and case.workload.fused_attention
        report = Simulator(case.model, case.cluster, case.workload).simulate(case.plan)
        assert report.stages[0].samples_per_micro_batch == row["micro_batch_size"]
        tokens_per_s_per_gpu = row["global_batch"] * row["seq_len"] / (case.measured_s * row["gpus"])
        assert tokens_per_s_per_gpu == pytest.approx(row["tokens_per_s_per_gpu"], rel=1e-12)
