"""A runtime that fuses pointwise chains keeps less: SwiGLU keeps gate and up, not silu(gate) as well."""

from __future__ import annotations

import pytest

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import Workload

SEQ = 1024


def activations(spec: str, *, fused: bool, tp: int = 2, recompute: bool = False) -> tuple[float, float, float]:
    """(kept activations, peak memory, iteration seconds) of one tp-way stage holding the whole model."""
    model = load_model(spec, seq_len=SEQ)
    plan = Plan(micro_batches=1, stages=(Stage(layers=(0, len(model.layers)), devices=tuple(range(tp)), tp=tp,
                                               recompute=recompute),))
    report = Simulator(model, load_cluster("dgx-h100:nodes=1"),
                       Workload(global_batch=2, seq_len=SEQ, fused_activation=fused)).simulate(plan)
    return report.stages[0].memory.activations_bytes, report.peak_memory_bytes, report.iteration_time_s


def test_a_fused_swiglu_keeps_its_two_projections_not_the_activated_one() -> None:
    spec = "llama?layers=3&hidden=512&heads=8&kv_heads=4&ffn=1536&vocab=1024"
    (eager, _, eager_s), (fused, _, fused_s) = activations(spec, fused=False), activations(spec, fused=True)
    silu_out = 3 * 2 * SEQ * 1536 * 2 / 2  # layers x samples x tokens x ffn x bf16 bytes / tp
    assert eager - fused == pytest.approx(silu_out, rel=1e-9)
    assert fused_s == eager_s  # memory only: the fused kernel's time is the ops' (not modelled apart)


def test_a_gelu_mlp_and_a_recomputed_stage_are_unchanged() -> None:
    gpt = "gpt?layers=3&hidden=512&heads=8&vocab=1024"
    assert activations(gpt, fused=True) == activations(gpt, fused=False)  # GELU keeps only its input anyway
    llama = "llama?layers=3&hidden=512&heads=8&kv_heads=4&ffn=1536&vocab=1024"
    (kept_eager, peak_eager, _), (kept_fused, peak_fused, _) = (activations(llama, fused=f, recompute=True)
                                                                for f in (False, True))
    assert kept_fused == kept_eager  # a checkpointed layer keeps its input either way
    silu_out_one_layer = 2 * SEQ * 1536 * 2 / 2
    assert peak_eager - peak_fused == pytest.approx(silu_out_one_layer, rel=1e-9)  # the layer being recomputed
