"""The loss kernel sets the head's memory: a fused cross-entropy (flash-attn's, llm-foundry's default, Transformer
Engine's) keeps the 16-bit logits, not the fp32 softmax; Megatron-Core's in-place one keeps the fp32 softmax but
holds no fp32 output or gradient beside it."""

from __future__ import annotations

import pytest

from tagplan.cost.memory import fused_loss_saved_bytes, is_loss, transient_bytes_per_sample
from tagplan.cost.report import Report
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import Block, Op, OpKind
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import LossKernel, Workload

SEQ, VOCAB, SAMPLES = 256, 32000, 4


def report(loss: LossKernel, *, pipelined: bool = False, tp: int = 1) -> Report:
    model = load_model(f"gpt?layers=2&hidden=128&heads=2&vocab={VOCAB}", seq_len=SEQ)
    n = len(model.layers)
    stages = ((Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, n), devices=tuple(range(1, 1 + tp)), tp=tp))
              if pipelined else (Stage(layers=(0, n), devices=tuple(range(tp)), tp=tp),))
    sim = Simulator(model, load_cluster("dgx-h100:nodes=1"), Workload(global_batch=SAMPLES, seq_len=SEQ, loss=loss))
    return sim.simulate(Plan(micro_batches=1, stages=stages))


def memory(loss: LossKernel, *, pipelined: bool = False, tp: int = 1) -> tuple[float, float, float, float]:
    """(kept activations, transient, peak, iteration s) of one device of the stage holding the head."""
    r = report(loss, pipelined=pipelined, tp=tp)
    m = r.stages[-1].memory
    return m.activations_bytes, m.other_bytes, r.peak_memory_bytes, r.iteration_time_s


@pytest.mark.parametrize("loss", [LossKernel.FUSED, LossKernel.IN_PLACE])
@pytest.mark.parametrize(("pipelined", "tp"), [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_the_head_holds_the_logits_gradient_once(loss: LossKernel, pipelined: bool, tp: int) -> None:
    (kept, transient, peak, seconds), (kept_f, transient_f, peak_f, seconds_f) = (
        memory(LossKernel.EAGER, pipelined=pipelined, tp=tp), memory(loss, pipelined=pipelined, tp=tp))
    logits = SAMPLES * SEQ * VOCAB / tp  # elements per micro-batch on one device: the vocabulary split over tp
    # fused: the fp32 softmax -> the bf16 logits; in-place: the fp32 softmax kept (it becomes the gradient)
    assert kept - kept_f == pytest.approx(logits * (4 - 2) if loss is LossKernel.FUSED else 0.0, rel=1e-9)
    # eager: the fp32 softmax output (and per-token loss) and its gradient; fused and in-place: the bf16 logits'
    # gradient (in-place: cast back from the softmax it overwrote)
    assert transient - transient_f == pytest.approx(2 * (logits * 4 + SAMPLES * SEQ * 4 / tp) - logits * 2, rel=1e-9)
    assert peak - peak_f == pytest.approx((kept - kept_f) + (transient - transient_f), rel=1e-9)
    assert seconds_f == seconds  # memory only
    if pipelined:  # the stage without the head keeps what it kept
        assert report(loss, pipelined=True, tp=tp).stages[0].memory == report(
            LossKernel.EAGER, pipelined=True, tp=tp).stages[0].memory


def test_a_stage_without_the_head_is_unchanged() -> None:
    model = load_model(f"gpt?layers=2&hidden=128&heads=2&vocab={VOCAB}", seq_len=SEQ)
    body = [model.block_of(i) for i in range(1, 3)]
    for loss in (LossKernel.FUSED, LossKernel.IN_PLACE):
        assert transient_bytes_per_sample(body, tp=1, loss=loss) == transient_bytes_per_sample(body, tp=1)


def test_the_kept_logits_are_what_the_ops_that_make_them_write() -> None:
    """A head as a tracer records it (every tensor at the model's dtype, the loss a log_softmax over a cast), not
    only as the analytic builder does (an fp32 softmax kept): the fused loss keeps the logits its inputs wrote."""
    logits = Op(name="cast", kind=OpKind.ELEMENTWISE, flops=0, bytes_read=2000, bytes_written=2000, inputs=("mm",))
    matmul = Op(name="mm", kind=OpKind.MATMUL, flops=1, bytes_read=10, bytes_written=2000, saved_bytes=10)
    loss = Op(name="log_softmax", kind=OpKind.SOFTMAX, flops=5, bytes_read=2000, bytes_written=2000,
              saved_bytes=2000, inputs=("cast",))
    head = Block(hash="h", kind="head", ops=(matmul, logits, loss), params=0, output_bytes=0)
    assert is_loss(loss, head) and not is_loss(matmul, head)
    assert fused_loss_saved_bytes(loss, head) == 2000
    # the loss writes nothing beyond what it keeps; the logits count once (their gradient); the matmul's output twice
    assert transient_bytes_per_sample([head], tp=1, loss=LossKernel.FUSED) == 2 * 2000
    assert not is_loss(loss, head.model_copy(update={"kind": "block"}))


def test_the_losses_rank_by_what_they_keep() -> None:
    """Per logit at 16 bits: eager about 12 bytes, in-place about 6, fused about 4 (the head's stage peak)."""
    peaks = {loss: memory(loss)[2] for loss in LossKernel}
    logits = SAMPLES * SEQ * VOCAB
    assert peaks[LossKernel.EAGER] - peaks[LossKernel.IN_PLACE] == pytest.approx(6 * logits, rel=0.01)
    assert peaks[LossKernel.IN_PLACE] - peaks[LossKernel.FUSED] == pytest.approx(2 * logits, rel=0.01)
