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


def test_each_stage_keeps_its_output_per_micro_batch_in_flight_and_the_last_its_logits() -> None:
    pipeline = (Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 4), devices=(1,)))
    (first, last), (first_kept, last_kept) = activations(False, pipeline), activations(True, pipeline)
    per_micro_batch = SAMPLES // MICRO
    # 1F1B: the first of two stages holds two micro-batches in flight, the last one; fp16 outputs
    assert first_kept - first == pytest.approx(2 * per_micro_batch * SEQ * HIDDEN * 2, rel=1e-9)
    assert last_kept - last == pytest.approx(1 * per_micro_batch * SEQ * VOCAB * 2, rel=1e-9)


def test_under_the_in_place_loss_the_kept_logits_are_the_softmax() -> None:
    """Megatron-DeepSpeed's last stage hands the loss fp32 logits, which its `.float()` returns as they are and its
    in-place softmax overwrites: the engine's buffer adds nothing there; the first stage still keeps its output."""
    pipeline = (Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 4), devices=(1,)))
    (first, last), (first_kept, last_kept) = (activations(False, pipeline, LossKernel.IN_PLACE),
                                              activations(True, pipeline, LossKernel.IN_PLACE))
    assert first_kept > first and last_kept == last


def test_one_stage_hands_nothing_on() -> None:
    whole = (Stage(layers=(0, 4), devices=(0,)),)
    assert activations(True, whole) == activations(False, whole)
