"""Causal attention: which ops are causal, what a fused kernel is charged for them, and the fit from op records."""

from pathlib import Path

import pytest

from tagplan.cost.calibration import (
    DEFAULT_CALIBRATION,
    MEASURED_CAUSAL_DIAGONAL_TOKENS,
    MEASURED_CAUSAL_TIME_FRACTION,
)
from tagplan.cost.compute import attention_fraction, op_time
from tagplan.datasets.traces.bundle import OpRecord
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.model_spec import load_model
from tagplan.ir import OpKind
from tagplan.ir.model import HASH_EXCLUDED, ModelGraph, Op
from tagplan.ir.plan import ShardStrategy
from tagplan.ir.workload import DType
from tagplan.training.calibrate import causal_pairs, fit_calibration, fit_causal, predict_op_s

MEASURED = DEFAULT_CALIBRATION.model_copy(update={"causal_time_fraction": MEASURED_CAUSAL_TIME_FRACTION,
                                                  "causal_diagonal_tokens": MEASURED_CAUSAL_DIAGONAL_TOKENS})
FIXTURE = Path(__file__).parents[1] / "export" / "fixtures" / "tiny_lm.py"


def attention_ops(graph: ModelGraph) -> dict[str, Op]:
    return {f"{graph.layers[i].name}/{op.name}": op for i in range(len(graph.layers))
            for op in graph.block_of(i).ops if op.kind is OpKind.ATTENTION}


def test_decoders_self_attention_is_causal_and_encoders_and_cross_attention_are_not() -> None:
    for spec in ("gpt?layers=2&hidden=64&heads=4&vocab=100", "llama?layers=2&hidden=64&heads=4&kv_heads=2&vocab=100"):
        ops = attention_ops(load_model(spec, seq_len=32))
        assert ops and all(op.causal for op in ops.values()), spec
    for encoder in ("bert?layers=2&hidden=64&heads=4&vocab=100", "vit?layers=2&hidden=64&heads=4&patch=16&image=64"):
        ops = attention_ops(load_model(encoder, seq_len=32))
        assert ops and not any(op.causal for op in ops.values()), encoder
    t5 = attention_ops(load_model("t5?layers=2&hidden=64&heads=4&head_dim=16&ffn=128&vocab=100", seq_len=32))
    assert {name for name, op in t5.items() if op.causal} == {n for n in t5 if n.startswith("decoder") and "self" in n}
    assert any(n.startswith("encoder") for n in t5) and any("cross" in n for n in t5)


def test_a_traced_sdpa_call_keeps_its_is_causal_argument() -> None:
    traced = attention_ops(load_model(f"{FIXTURE}:tiny", seq_len=16))  # the fixture calls SDPA with is_causal=True
    assert traced and all(op.causal for op in traced.values())


def test_the_causal_flag_leaves_block_hashes_alone() -> None:
    graph = load_model("gpt?layers=2&hidden=64&heads=4&vocab=100", seq_len=32)
    block = graph.block_of(1)
    unmasked = block.model_copy(update={"ops": tuple(op.model_copy(update={"causal": False}) for op in block.ops)})
    assert any(op.causal for op in block.ops)
    assert "causal" in HASH_EXCLUDED
    assert [op.model_dump_json(exclude=set(HASH_EXCLUDED)) for op in unmasked.ops] == \
        [op.model_dump_json(exclude=set(HASH_EXCLUDED)) for op in block.ops]


def _attention(seq: int, causal: bool) -> Op:
    return Op(name="sdpa", kind=OpKind.ATTENTION, flops=4.0 * seq * seq * 32 * 128, bytes_read=3.0 * seq * 4096 * 2,
              bytes_written=seq * 4096 * 2.0, output_shape=(1, seq, 4096), causal=causal)


def test_the_defaults_charge_a_causal_call_its_unmasked_time() -> None:
    h100 = lookup_device("H100-SXM")
    for seq in (512, 4096):
        masked, unmasked = _attention(seq, True), _attention(seq, False)
        assert attention_fraction(masked, fused=True, calibration=DEFAULT_CALIBRATION) == 1.0
        args = dict(samples=1.0, tp=1, strategy=ShardStrategy.REPLICATE, spec=h100, dtype=DType.BF16,
                    calibration=DEFAULT_CALIBRATION)
        assert op_time(masked, **args) == op_time(unmasked, **args)


def test_measured_figures_discount_causal_calls_on_fused_kernels_only() -> None:
    h100, v100 = lookup_device("H100-SXM"), lookup_device("V100-SXM2-32GB")
    assert h100.fused_attention and not v100.fused_attention
    masked, unmasked = _attention(4096, True), _attention(4096, False)
    fraction = MEASURED_CAUSAL_TIME_FRACTION + MEASURED_CAUSAL_DIAGONAL_TOKENS / 4096
    assert attention_fraction(masked, fused=True, calibration=MEASURED) == pytest.approx(fraction)
    assert attention_fraction(unmasked, fused=True, calibration=MEASURED) == 1.0
    assert attention_fraction(masked, fused=False, calibration=MEASURED) == 1.0  # a materialised kernel masks
    assert attention_fraction(_attention(128, True), fused=True, calibration=MEASURED) == 1.0  # the diagonal is all
    args = dict(samples=1.0, tp=1, strategy=ShardStrategy.REPLICATE, dtype=DType.BF16, calibration=MEASURED)
    fast, slow = op_time(masked, spec=h100, **args), op_time(unmasked, spec=h100, **args)
    assert fast.forward_s < 0.7 * slow.forward_s and fast.backward_s < 0.7 * slow.backward_s
    assert op_time(masked, spec=v100, **args) == op_time(unmasked, spec=v100, **args)


def _records(fraction: float, tokens: float) -> list[OpRecord]:
    """Unmasked and causal flash-attention calls on an H100 whose causal time follows fraction + tokens / s."""
    h100 = lookup_device("H100-SXM")
    out = []
    for seq in (1024, 2048, 4096, 8192):
        op = _attention(seq, False)
        for phase in ("forward", "backward"):
            t = op_time(op, samples=1.0, tp=1, strategy=ShardStrategy.REPLICATE, spec=h100, dtype=DType.BF16,
                        calibration=DEFAULT_CALIBRATION)
            unmasked = t.forward_s if phase == "forward" else t.backward_s
            for causal, time_s in ((0, unmasked), (1, unmasked * (fraction + tokens / seq))):
                out.append(OpRecord(device="H100-SXM", kind=OpKind.ATTENTION, phase=phase, dtype=DType.BF16,
                                    flops=op.flops, bytes_read=op.bytes_read, bytes_written=op.bytes_written,
                                    time_s=time_s, shape={"b": 1, "h": 32, "s": seq, "d": 128, "causal": causal}))
    return out


def test_fit_causal_recovers_known_figures_and_needs_two_lengths() -> None:
    records = _records(0.6, 100.0)
    assert len(causal_pairs(records)) == 8
    fraction, tokens = fit_causal(records) or (0.0, 0.0)
    assert fraction == pytest.approx(0.6, abs=1e-9) and tokens == pytest.approx(100.0, abs=1e-6)
    assert fit_causal([r for r in records if r.shape["s"] == 4096]) is None
    assert fit_causal([r for r in records if r.shape["causal"] == 0]) is None


def test_calibrating_on_causal_records_fits_the_figures_and_predicts_causal_calls() -> None:
    from tagplan.datasets.traces.bundle import Bundle, Manifest, host_fingerprint, now_iso

    records = _records(0.6, 100.0)
    manifest = Manifest(created=now_iso(), source="test", fingerprint=host_fingerprint("H100-SXM", backend="cuda"))
    calibration = fit_calibration([Bundle(manifest=manifest, records=tuple(records))], iterations=False).calibration
    assert calibration.causal_time_fraction == pytest.approx(0.6, abs=1e-6)
    assert calibration.causal_diagonal_tokens == pytest.approx(100.0, abs=1e-3)
    h100 = lookup_device("H100-SXM")
    for seq in (2048, 8192):
        masked, unmasked = (next(r for r in records if r.shape["s"] == seq and r.phase == "forward"
                                 and r.shape["causal"] == c) for c in (1, 0))
        ratio = predict_op_s(masked, h100, calibration) / predict_op_s(unmasked, h100, calibration)
        assert ratio == pytest.approx(masked.time_s / unmasked.time_s, rel=0.05)  # the curve is read at the run FLOPs


def test_marking_a_causal_lm_marks_self_attention_only() -> None:
    from tagplan.frontends.hf_config import is_causal_lm
    from tagplan.frontends.hf_fold import mark_causal
    from tagplan.ir.model import Block, Layer

    def sdpa(name: str, keys: int) -> Op:  # traced layout: (batch, heads, queries, width); 4 heads, 16 queries
        return Op(name=name, kind=OpKind.ATTENTION, flops=1.0, bytes_read=1.0, bytes_written=1.0,
                  output_shape=(2, 4, 16, 8), score_elements=4.0 * 16 * keys)
    block = Block(hash="b", ops=(sdpa("self", 16), sdpa("cross", 32)), params=0, output_bytes=1.0)
    graph = ModelGraph(name="m", seq_len=16, blocks=(block,), layers=(Layer(name="l", block="b"),))
    marked = {op.name: op.causal for op in mark_causal(graph).blocks[0].ops}
    assert marked == {"self": True, "cross": False}
    assert mark_causal(graph).blocks[0].hash == "b"
    assert is_causal_lm("LlamaForCausalLM") and is_causal_lm("GPT2LMHeadModel")
    assert not is_causal_lm("BertForMaskedLM") and not is_causal_lm("T5ForConditionalGeneration")
