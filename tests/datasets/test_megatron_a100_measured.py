"""Megatron-LM's published A100 runs (bench/data/megatron_a100_measured.json) and the plans
bench/fidelity_megatron_a100.py rebuilds from them."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
from bench_modules import BENCH, load_bench

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.ir.model import OpKind
from tagplan.ir.plan import ShardStrategy

V, S = 51200, 2048


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("fidelity_megatron_a100")


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    return json.loads((BENCH / "data" / "megatron_a100_measured.json").read_text())


def test_every_row_agrees_with_the_papers_own_formulas(data: dict[str, Any]) -> None:
    """A transcription slip shows: the parameter count is the paper's Eq. 2 of the row's shape, and Table 1's
    aggregate petaFLOP/s is its per-GPU figure times its GPUs."""
    aggregate = [4.4, 8.8, 18.2, 34.6, 70.8, 143.8, 227.1, 297.4, 410.2, 502.0]
    table1 = [r for r in data["ptdp"] if r["table"] == 1]
    for row, petaflops in zip(table1, aggregate, strict=True):  # per-GPU figures are rounded to whole teraFLOP/s
        assert abs(row["tflops_per_gpu"] * row["gpus"] / 1e3 - petaflops) <= 0.5 * row["gpus"] / 1e3 + 0.05, row
    for row in data["ptdp"] + data["zero3"]:
        layers, h = row["layers"], row["hidden"]
        params = 12 * layers * h * h * (1 + 13 / (12 * h) + (V + S) / (12 * layers * h)) / 1e9
        assert params == pytest.approx(row["params_b"], rel=0.03), row
        assert row["hidden"] % row["heads"] == 0
    table2 = [r for r in data["ptdp"] + data["zero3"] if r["table"] == 2]
    assert len(table2) == 12 and all("days_for_300b_tokens" in r for r in table2)
    for row in table2:  # Eq. 4: 8 T P / (n X) for T = 300B tokens; the paper's days run 1-3% above it
        days = 8 * 300e9 * row["params_b"] * 1e9 / (row["gpus"] * row["tflops_per_gpu"] * 1e12) / 86400
        assert row["days_for_300b_tokens"] == pytest.approx(days, rel=0.04), row
    for row in data["ptdp"]:
        dp = row["gpus"] // (row["tp"] * row["pp"])
        assert dp * row["tp"] * row["pp"] == row["gpus"] and row["batch"] % dp == 0, row
    for row in data["zero3"]:
        assert row["batch"] == row["gpus"] * row["micro_batch_size"], row


def test_a_megatron_row_becomes_the_plan_it_ran(bench: ModuleType, data: dict[str, Any]) -> None:
    row = next(r for r in data["ptdp"] if r["params_b"] == 39.1)  # 48 blocks, tp 8, pp 2 on 512 GPUs
    model = bench.model_of(row)
    plan = bench.ptdp_plan(row, model)
    assert [s.layers for s in plan.stages] == [(0, 25), (25, 50)]  # the embedding first, the head last
    assert [s.devices for s in plan.stages] == [tuple(range(256)), tuple(range(256, 512))]
    assert all((s.tp, s.dp, s.zero, s.recompute) == (8, 32, 0, True) for s in plan.stages)
    assert plan.micro_batches == 1536 // 32  # micro-batch size 1
    interleaved = bench.ptdp_plan(row, model, 3)
    assert len(interleaved.stages) == 6 and interleaved.stages[2].devices == plan.stages[0].devices


def test_without_sequence_parallelism_every_rank_runs_the_norms_whole(bench: ModuleType,
                                                                     data: dict[str, Any]) -> None:
    row = next(r for r in data["ptdp"] if r["params_b"] == 18.4)  # tp 8, one stage
    model = bench.model_of(row)
    replicated = bench.no_sequence_parallel(model)
    kinds = {op.name: op.kind for block in model.blocks for op in block.ops}
    assert any(kinds[name] is OpKind.LAYERNORM for name in replicated)
    assert set(replicated.values()) == {ShardStrategy.REPLICATE}
    assert not any(kinds[name] in (OpKind.MATMUL, OpKind.EMBEDDING, OpKind.ATTENTION) for name in replicated)
    with_sp = bench.ptdp_plan(row, model).model_copy(
        update={"stages": tuple(s.model_copy(update={"sharding": None}) for s in bench.ptdp_plan(row, model).stages)})
    sim = Simulator(model, load_cluster("dgx-a100-80gb:nodes=32"), bench.workload_of(row, zero3=False))
    whole, split = sim.simulate(bench.ptdp_plan(row, model)), sim.simulate(with_sp)
    # eight ranks each normalising every token cost more compute and hold more activations than each an eighth
    assert whole.breakdown.compute > split.breakdown.compute
    assert whole.peak_memory_bytes > split.peak_memory_bytes


def test_a_zero3_row_is_one_micro_batch_on_every_gpu(bench: ModuleType, data: dict[str, Any]) -> None:
    row = data["zero3"][1]  # 175B on 768 GPUs at micro-batch 2
    model = bench.model_of(row)
    plan = bench.zero3_plan(row, model)
    (stage,) = plan.stages
    assert (stage.dp, stage.tp, stage.zero, stage.recompute, plan.micro_batches) == (768, 1, 3, True, 1)
    assert stage.layers == (0, len(model.layers))


def test_measured_seconds_come_from_the_published_teraflops(bench: ModuleType, data: dict[str, Any]) -> None:
    cases, rows = bench.cases_of(data)
    assert len(cases) == len(data["ptdp"]) + len(data["zero3"]) == 23
    for case, row in zip(cases, rows, strict=True):
        assert bench.tflops(row, case.measured_s) == pytest.approx(row["tflops_per_gpu"])
        assert case.workload.fused_attention is False and case.workload.global_batch == row["batch"]
    readme = next(c for c, r in zip(cases, rows, strict=True) if r["table"] == "readme")
    assert readme.measured_s == pytest.approx(32, rel=0.02)  # "each iteration takes around 32 seconds"
