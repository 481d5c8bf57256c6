"""The quantized recipes as the exporters write or refuse them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.export import ExportError
from tagplan.export.capability import exportable
from tagplan.export.deepspeed import deepspeed_config
from tagplan.export.megatron import megatron_arguments, quantized_refusal
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


def test_quantized_recipes_are_refused_where_transformer_engine_cannot_run_them() -> None:
    h100, a100 = load_cluster("dgx-h100"), load_cluster("dgx-a100-80gb")
    assert quantized_refusal(PLAN, h100, DType.FP8_CS) is None
    assert quantized_refusal(PLAN, load_cluster("dgx-b300"), DType.NVFP4) is None
    assert quantized_refusal(PLAN, a100, DType.BF16) is None
    why = quantized_refusal(PLAN, h100, DType.MXFP8) or ""
    assert "dtype mxfp8" in why and "H100-SXM" in why and "Blackwell" in why and "Plan in fp8 or fp8-cs" in why
    for dtype in (DType.FP8, DType.FP8_CS, DType.MXFP8):  # an A100 has no fp8 tensor cores: bf16 is the advice
        why = quantized_refusal(PLAN, a100, dtype) or ""
        assert f"dtype {dtype.value}" in why and "A100-SXM-80GB" in why and "Plan in bf16" in why
    model = load_model(SPEC, seq_len=16, dtype=DType.FP8)
    assert "A100-SXM-80GB" in (exportable(PLAN, "megatron", model, global_batch=8, cluster=a100) or "")
    from tagplan.export.megatron import cluster_quantized_refusal

    assert "A100-SXM-80GB" in (cluster_quantized_refusal(a100, DType.FP8) or "")  # no GPU of it runs fp8
    assert cluster_quantized_refusal(load_cluster("dgx-a100-80gb+dgx-h100"), DType.FP8) is None  # the H100s do
    assert cluster_quantized_refusal(a100, DType.BF16) is None
    from tagplan.export.capability import model_refusal

    assert "A100-SXM-80GB" in (model_refusal("megatron", model, cluster=a100) or "")  # what --exportable asks first
    assert model_refusal("megatron", model) is None and model_refusal("megatron", model, cluster=h100) is None
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
