"""The gradient reduction as costed, written by every format (tagplan.export.deepspeed.grad_reduce,
megatron.grad_reduce, torch_program.grad_reduce, dispatch.grad_reduce_settings, checks.GradReduce)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.export import ExportError, export
from tagplan.export import deepspeed as ds
from tagplan.export import megatron as mg
from tagplan.export.dispatch import grad_reduce_settings
from tagplan.export.torch_program import grad_reduce, reduce_overlaps, runtime_on, write_torch_program
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.ir.workload import DType

FP32, BF16, FP16 = DType.FP32, DType.BF16, DType.FP16


@pytest.fixture(scope="module")
def gpt_small() -> ModelGraph:
    return load_model("gpt3-125m")  # 14 layers: embedding, 12 blocks, head


def stages(bounds: list[int], *, dp: int, zero: int = 0, micro_batches: int = 8) -> Plan:
    """One stage per pair of `bounds` on consecutive groups of `dp` devices, 1F1B."""
    return Plan(micro_batches=micro_batches, schedule=Schedule.ONE_F_ONE_B, stages=tuple(
        Stage(layers=(a, b), devices=tuple(range(i * dp, (i + 1) * dp)), dp=dp, zero=zero)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))))


# --- DeepSpeed ----------------------------------------------------------------------------------


def test_deepspeed_writes_the_reduction_dtype_only_when_costed(gpt_small: ModelGraph) -> None:
    plan = stages([0, 14], dp=8, zero=1)
    default = ds.deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048)
    assert "communication_data_type" not in default and "fp32_allreduce" not in default  # bf16, DeepSpeed's default
    fp32 = ds.deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048, grad_reduce_dtype=FP32)
    assert fp32["communication_data_type"] == "fp32" and fp32["fp32_allreduce"] is True
    bf16 = ds.deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048, grad_reduce_dtype=BF16)
    assert bf16["communication_data_type"] == "bf16" and "fp32_allreduce" not in bf16
    full = load_model("gpt3-125m", dtype=FP32)
    plain = ds.deepspeed_config(full, plan, global_batch=64, seq_len=2048, grad_reduce_dtype=FP32)
    assert plain["communication_data_type"] == "fp32" and "fp32_allreduce" not in plain  # 32-bit training already


def test_deepspeed_overlap_comm_follows_the_costing(gpt_small: ModelGraph) -> None:
    plan = stages([0, 14], dp=8, zero=2)
    on = ds.deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048)
    off = ds.deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048, grad_reduce_overlap=False)
    assert on["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert off["zero_optimization"] == {"stage": 2, "overlap_comm": False}
    one = ds.deepspeed_config(gpt_small, stages([0, 14], dp=1, micro_batches=4), global_batch=64, seq_len=2048)
    assert one["zero_optimization"]["overlap_comm"] is False  # dp 1: nothing to reduce


@pytest.mark.parametrize(("plan", "why"), [
    (stages([0, 4, 7, 11, 14], dp=2, zero=1), r"its pipeline engine \(4 stages\) reduces them after the flush"),
    (stages([0, 14], dp=8, zero=0), r"with ZeRO 0 it reduces them after the backward"),
])
def test_deepspeed_notes_where_it_cannot_overlap_as_costed(gpt_small: ModelGraph, tmp_path: Path, plan: Plan,
                                                          why: str) -> None:
    reduce = ds.grad_reduce(plan, BF16)
    assert reduce.overlap is False and len(reduce.notes) == 1
    assert reduce.written[-1] == "zero_optimization.overlap_comm: true"  # written as costed, noted as run
    assert "slower than predicted" in reduce.notes[0] and "--exportable deepspeed" in reduce.notes[0]
    assert re.search(why, reduce.notes[0])
    ds.write_deepspeed(gpt_small, plan, tmp_path, global_batch=64, seq_len=2048)
    assert json.loads((tmp_path / "partition.json").read_text())["tagplan_notes"] == list(reduce.notes)
    costed_exposed = ds.grad_reduce(plan, BF16, grad_reduce_overlap=False)
    assert costed_exposed.notes == () and costed_exposed.overlap is False


def test_deepspeed_overlaps_zero_1_to_3_on_one_stage_without_a_note(gpt_small: ModelGraph, tmp_path: Path) -> None:
    for zero in (1, 2, 3):
        reduce = ds.grad_reduce(stages([0, 14], dp=8, zero=zero), BF16, grad_reduce_dtype=FP32)
        assert (reduce.dtype, reduce.overlap, reduce.notes) == (FP32, True, ())
        assert reduce.written == ('communication_data_type: "fp32"', "fp32_allreduce: true",
                                  "zero_optimization.overlap_comm: true")
    export("gpt3-125m", stages([0, 14], dp=8, zero=1), tmp_path, fmt="deepspeed", seq_len=None, global_batch=64)
    assert json.loads((tmp_path / "partition.json").read_text())["tagplan_notes"] == []
    single = ds.grad_reduce(stages([0, 14], dp=1), FP16)
    assert (single.dtype, single.overlap, single.notes) == (FP16, None, ())  # nothing reduced, nothing noted


# --- Megatron-LM --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_1b() -> ModelGraph:
    return load_model("gpt3-1.3b", seq_len=1024)  # embedding, 24 blocks, head


def test_megatron_writes_the_costed_reduction_dtype(gpt_1b: ModelGraph) -> None:
    plan = stages([0, 26], dp=4, zero=1)
    default = mg.megatron_arguments(gpt_1b, plan, global_batch=64, seq_len=1024)
    assert "--accumulate-allreduce-grads-in-fp32" not in default and "--grad-reduce-in-bf16" not in default
    fp32 = mg.megatron_arguments(gpt_1b, plan, global_batch=64, seq_len=1024, grad_reduce_dtype=FP32)
    assert fp32[-2:] == ["--accumulate-allreduce-grads-in-fp32", "--bf16"]
    bf16 = mg.megatron_arguments(gpt_1b, plan, global_batch=64, seq_len=1024, grad_reduce_dtype=BF16)
    assert bf16[-2:] == ["--grad-reduce-in-bf16", "--bf16"]
    assert mg.grad_reduce(plan, BF16).dtype is FP32  # left open, Megatron reduces --bf16 runs in fp32
    assert mg.grad_reduce(plan, FP16).dtype is FP16
    half = load_model("gpt3-1.3b", seq_len=1024, dtype=FP16)
    assert mg.megatron_arguments(half, plan, global_batch=64, seq_len=1024, grad_reduce_dtype=FP16)[-1] == "--fp16"


@pytest.mark.parametrize(("dtype", "reduce", "accepted"), [
    (BF16, FP16, "fp32, bf16"), (FP16, BF16, "fp32, fp16"), (FP32, BF16, "fp32,"),
])
def test_megatron_refuses_a_reduction_dtype_it_has_no_flag_for(dtype: DType, reduce: DType, accepted: str) -> None:
    model = load_model("gpt3-1.3b", seq_len=1024, dtype=dtype)
    with pytest.raises(ExportError, match=rf"^megatron: grad_reduce_dtype={reduce.value} with dtype {dtype.value}: "
                                          rf".*Accepted with dtype {dtype.value}: {accepted}"):
        mg.megatron_arguments(model, stages([0, 26], dp=4), global_batch=64, seq_len=1024, grad_reduce_dtype=reduce)


def test_megatron_overlap_flags_follow_the_costing(gpt_1b: ModelGraph) -> None:
    plan = stages([0, 13, 26], dp=2, zero=1)
    on = mg.megatron_arguments(gpt_1b, plan, global_batch=64, seq_len=1024)
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"} <= set(on)
    off = mg.megatron_arguments(gpt_1b, plan, global_batch=64, seq_len=1024, grad_reduce_overlap=False)
    assert "--use-distributed-optimizer" in off
    assert "--overlap-grad-reduce" not in off and "--overlap-param-gather" not in off
    assert mg.grad_reduce(plan, BF16).written == ("--overlap-grad-reduce", "--overlap-param-gather")
    exposed = mg.grad_reduce(plan, BF16, grad_reduce_dtype=FP32, grad_reduce_overlap=False)
    assert (exposed.overlap, exposed.written, exposed.notes) == (False, ("--accumulate-allreduce-grads-in-fp32",), ())


# --- the torch program --------------------------------------------------------------------------


TINY = "gpt?layers=2&hidden=64&heads=4&vocab=128"  # 4 layers: embed, two blocks, head


def test_torch_program_reduces_in_fp32_only() -> None:
    plan = stages([0, 4], dp=2, micro_batches=1)
    assert grad_reduce(plan, "mesh", dtype=BF16, grad_reduce_dtype=FP32).dtype is FP32
    for reduce in (BF16, FP16):
        with pytest.raises(ExportError, match=rf"^torch: grad_reduce_dtype={reduce.value}: .* in fp32; it accepts "
                                              r"grad_reduce_dtype fp32 or unset"):
            grad_reduce(plan, "mesh", dtype=BF16, grad_reduce_dtype=reduce)


def test_torch_program_overlaps_on_one_rank_and_reduces_pipelined_stages_after_their_backward() -> None:
    one = stages([0, 4], dp=2, micro_batches=1)
    assert runtime_on(one, None) == "mesh" and reduce_overlaps(one, "mesh") == {0: True}
    assert grad_reduce(one, "mesh", dtype=BF16).overlap is True
    faster = grad_reduce(one, "mesh", dtype=BF16, grad_reduce_overlap=False)  # runs as it runs, noted
    assert faster.overlap is True and "stages [0] while the backward runs" in faster.notes[0]
    assert "faster than predicted" in faster.notes[0]
    piped = stages([0, 2, 4], dp=2, micro_batches=4)
    assert runtime_on(piped, None) == "mesh" and reduce_overlaps(piped, "mesh") == {0: False, 1: False}
    noted = grad_reduce(piped, "mesh", dtype=BF16)
    assert noted.overlap is False and "stages [0, 1] after their last backward" in noted.notes[0]
    assert grad_reduce(piped, "mesh", dtype=BF16, grad_reduce_dtype=FP32, grad_reduce_overlap=False).notes == ()
    wider = grad_reduce(piped, "mesh", dtype=BF16, grad_reduce_overlap=False).notes  # costed in bf16 by default
    assert wider == ("the plan was costed with gradients reduced in bf16 (the default: the training dtype); torch "
                     "reduces them in fp32, 2x the bytes: slower than predicted where the reduction is exposed. "
                     "`plan --exportable torch` costs it as the program runs it",)
    assert grad_reduce(piped, "mesh", dtype=FP32, grad_reduce_overlap=False).notes == ()  # an fp32 run: as costed


def test_pipeline_runtime_overlaps_zero3_stages_only() -> None:
    mixed = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), dp=2, zero=3),
                                          Stage(layers=(2, 4), devices=(2, 3, 4), dp=3, zero=1)))
    assert runtime_on(mixed, None) == "pipeline"
    assert reduce_overlaps(mixed, "pipeline") == {0: True, 1: False}
    assert "stages [0] while the backward runs (pipeline runtime" in grad_reduce(
        mixed, "pipeline", dtype=BF16, grad_reduce_overlap=False).notes[0]
    assert "stages [1] after their last backward" in grad_reduce(mixed, "pipeline", dtype=BF16).notes[0]
    alone = Plan(stages=(Stage(layers=(0, 4), devices=(0,)),))
    assert grad_reduce(alone, "mesh", dtype=BF16, grad_reduce_overlap=False).overlap is None  # nothing to reduce


def test_written_program_records_the_reduction_and_refusals_write_nothing(tmp_path: Path) -> None:
    piped = stages([0, 2, 4], dp=2, micro_batches=4)
    write_torch_program(TINY, piped, tmp_path / "run", seq_len=16, global_batch=8, dtype=BF16)
    cfg = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert cfg["grad_reduce"]["dtype"] == "fp32" and cfg["grad_reduce"]["overlap"] is False
    assert "after their last backward" in cfg["grad_reduce"]["notes"][0]
    one = stages([0, 4], dp=2, micro_batches=1)
    with pytest.raises(ExportError, match=r"^torch: grad_reduce_dtype=bf16"):
        write_torch_program(TINY, one, tmp_path / "refused", seq_len=16, global_batch=8, dtype=BF16,
                            grad_reduce_dtype=BF16)
    assert not (tmp_path / "refused").exists()


# --- the dispatcher -----------------------------------------------------------------------------


def test_export_passes_the_reduction_to_every_writer_and_reports_it(tmp_path: Path) -> None:
    plan = stages([0, 4], dp=2, micro_batches=1)
    export(TINY, plan, tmp_path / "ds", fmt="deepspeed", seq_len=16, global_batch=8, grad_reduce_dtype=FP32,
           grad_reduce_overlap=False)
    config = json.loads((tmp_path / "ds" / "ds_config.json").read_text())
    assert config["fp32_allreduce"] is True and config["zero_optimization"]["overlap_comm"] is False
    export(TINY, plan, tmp_path / "mg", fmt="megatron", seq_len=16, global_batch=8, grad_reduce_dtype=BF16)
    assert "--grad-reduce-in-bf16" in (tmp_path / "mg" / "megatron_args.txt").read_text().split()
    with pytest.raises(ExportError, match=r"^torch: grad_reduce_dtype=fp16"):
        export(TINY, plan, tmp_path / "t", fmt="torch", seq_len=16, global_batch=8, grad_reduce_dtype=FP16)
    with pytest.raises(SpecError, match=r"unknown grad_reduce_dtype 'fp8'.*Known: bf16, fp16, fp32"):
        export(TINY, plan, tmp_path / "x", fmt="megatron", seq_len=16, global_batch=8, grad_reduce_dtype=DType.FP8)
    assert not (tmp_path / "t").exists() and not (tmp_path / "x").exists()
    settings = grad_reduce_settings(plan, fmt="deepspeed", grad_reduce_dtype=FP32, grad_reduce_overlap=False)
    assert settings.as_json() == {"dtype": "fp32", "overlap": False, "notes": [], "written": [
        'communication_data_type: "fp32"', "fp32_allreduce: true", "zero_optimization.overlap_comm: false"]}
    assert grad_reduce_settings(plan, fmt="torch").overlap is True
