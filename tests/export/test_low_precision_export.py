"""The quantized recipes as the exporters write or refuse them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.export import ExportError
from tagplan.export.capability import exportable
from tagplan.export.deepspeed import deepspeed_config
from tagplan.export.megatron import block_scaling_refusal, megatron_arguments
from tagplan.export.torch_program import write_torch_program
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType

SPEC = "gpt?layers=2&hidden=64&heads=4&vocab=128"
PLAN = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1, 2, 3), tp=4),))


@pytest.mark.parametrize(("dtype", "flags"), [
    (DType.FP8, ["--bf16", "--fp8-format", "hybrid"]),
    (DType.FP8_CS, ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]),
    (DType.MXFP8, ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]),
    (DType.NVFP4, ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]),
])
def test_megatron_writes_each_recipe_as_its_flags(dtype: DType, flags: list[str]) -> None:
    model = load_model(SPEC, seq_len=16, dtype=dtype)
    args = megatron_arguments(model, PLAN, global_batch=8, seq_len=16, cluster=load_cluster("gb200-nvl72"))
    assert args[-len(flags):] == flags
    assert "--bf16" in args and args.count("--bf16") == 1


def test_block_scaled_recipes_are_refused_where_transformer_engine_cannot_run_them() -> None:
    h100 = load_cluster("dgx-h100")
    assert block_scaling_refusal(PLAN, h100, DType.FP8_CS) is None
    assert block_scaling_refusal(PLAN, load_cluster("dgx-b300"), DType.NVFP4) is None
    why = block_scaling_refusal(PLAN, h100, DType.MXFP8) or ""
    assert "dtype mxfp8" in why and "H100-SXM" in why and "Blackwell" in why
    model = load_model(SPEC, seq_len=16, dtype=DType.NVFP4)
    assert "H100-SXM" in (exportable(PLAN, "megatron", model, global_batch=8, cluster=h100) or "")
    assert exportable(PLAN, "megatron", model, global_batch=8, cluster=load_cluster("gb300-nvl72")) is None


def test_torch_and_deepspeed_name_the_recipe_they_cannot_run(tmp_path: Path) -> None:
    model = load_model(SPEC, seq_len=16, dtype=DType.MXFP8)
    dp = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1), dp=2),))
    with pytest.raises(ExportError, match="dtype mxfp8: DeepSpeed"):
        deepspeed_config(model, dp, global_batch=8, seq_len=16)
    with pytest.raises(ExportError, match="dtype mxfp8: the torch program"):
        write_torch_program(SPEC, dp, tmp_path / "run", global_batch=8, seq_len=16, dtype=DType.MXFP8)
    assert not (tmp_path / "run" / "train.py").exists()
