"""A fused cross-entropy (flash-attn's, llm-foundry's default) keeps the 16-bit logits, not the fp32 softmax."""

from __future__ import annotations

import pytest

from tagplan.cost.memory import transient_bytes_per_sample
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import Workload

SEQ, VOCAB, SAMPLES = 256, 32000, 4


def memory(*, fused: bool, pipelined: bool = False) -> tuple[float, float, float, float]:
    """(kept activations, transient, peak, iteration s) of the stage holding the head."""
    model = load_model(f"gpt?layers=2&hidden=128&heads=2&vocab={VOCAB}", seq_len=SEQ)
    n = len(model.layers)
    stages = ((Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, n), devices=(1,))) if pipelined
              else (Stage(layers=(0, n), devices=(0,)),))
    plan = Plan(micro_batches=1, stages=stages)
    report = Simulator(model, load_cluster("dgx-h100:nodes=1"),
                       Workload(global_batch=SAMPLES, seq_len=SEQ, fused_loss=fused)).simulate(plan)
    m = report.stages[-1].memory
    return m.activations_bytes, m.other_bytes, report.peak_memory_bytes, report.iteration_time_s


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_head_keeps_16_bit_logits_and_holds_their_gradient_once(pipelined: bool) -> None:
    (kept, transient, peak, seconds), (kept_f, transient_f, peak_f, seconds_f) = (
        memory(fused=False, pipelined=pipelined), memory(fused=True, pipelined=pipelined))
    logits = SAMPLES * SEQ * VOCAB  # elements per micro-batch
    assert kept - kept_f == pytest.approx(logits * (4 - 2), rel=1e-9)  # the fp32 softmax -> the bf16 logits
    # eager: the fp32 softmax output (and per-token loss) and its gradient; fused: the bf16 logits' gradient
    assert transient - transient_f == pytest.approx(2 * (logits * 4 + SAMPLES * SEQ * 4) - logits * 2, rel=1e-9)
    assert peak - peak_f == pytest.approx((kept - kept_f) + (transient - transient_f), rel=1e-9)
    assert seconds_f == seconds  # memory only


def test_a_stage_without_the_head_is_unchanged() -> None:
    model = load_model(f"gpt?layers=2&hidden=128&heads=2&vocab={VOCAB}", seq_len=SEQ)
    body = [model.block_of(i) for i in range(1, 3)]
    assert transient_bytes_per_sample(body, tp=1, fused_loss=True) == transient_bytes_per_sample(body, tp=1)
