"""A runtime that keeps each micro-batch's stage output until its backward (DeepSpeed's pipeline engine)."""

from __future__ import annotations

import pytest

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, LossKernel, Workload

SEQ, HIDDEN, VOCAB, SAMPLES, MICRO = 256, 128, 32000, 8, 4


def activations(keeps: bool, stages: tuple[Stage, ...], loss: LossKernel = LossKernel.EAGER) -> list[float]:
    model = load_model(f"gpt?layers=2&hidden={HIDDEN}&heads=2&vocab={VOCAB}", seq_len=SEQ, dtype=DType.FP16)
    workload = Workload(global_batch=SAMPLES, seq_len=SEQ, dtype=DType.FP16, keeps_stage_outputs=keeps, loss=loss)
    report = Simulator(model, load_cluster("p3.8xlarge"), workload).simulate(Plan(micro_batches=MICRO, stages=stages))
    return [s.memory.activations_bytes for s in report.stages]


PIPELINE = (Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 4), devices=(1,)))
PER_MICRO_BATCH = SAMPLES // MICRO
HIDDEN_OUT, LOGITS = SEQ * HIDDEN * 2, SEQ * VOCAB * 2  # fp16 bytes per sample


def test_the_first_stage_keeps_its_output_per_micro_batch_in_flight() -> None:
    (first, _), (first_kept, _) = activations(False, PIPELINE), activations(True, PIPELINE)
    assert first_kept - first == pytest.approx(2 * PER_MICRO_BATCH * HIDDEN_OUT, rel=1e-9)  # 1F1B: two in flight


@pytest.mark.parametrize(("loss", "kept_per_sample"), [
    (LossKernel.EAGER, HIDDEN_OUT + 2 * LOGITS),  # the input it received, the current and the previous logits
    (LossKernel.FUSED, HIDDEN_OUT + LOGITS),  # the current logits are the loss's own: the previous ones
    (LossKernel.IN_PLACE, HIDDEN_OUT + 2 * LOGITS),  # the previous micro-batch's fp32 logits, turned into a gradient
])
def test_the_last_stage_keeps_its_input_and_the_previous_micro_batchs_logits(loss: LossKernel,
                                                                            kept_per_sample: float) -> None:
    """DeepSpeed's last stage returns from its backward without freeing its output buffer: of its two, the previous
    micro-batch's stays beside the current one (1F1B: one micro-batch in flight there)."""
    (_, last), (_, last_kept) = activations(False, PIPELINE, loss), activations(True, PIPELINE, loss)
    assert last_kept - last == pytest.approx(PER_MICRO_BATCH * kept_per_sample, rel=1e-6)


def test_one_stage_hands_nothing_on() -> None:
    whole = (Stage(layers=(0, 4), devices=(0,)),)
    assert activations(True, whole) == activations(False, whole)
