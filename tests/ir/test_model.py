import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tagplan.frontends.model_spec import load_model
from tagplan.ir import Block, Layer, ModelGraph, Op, OpKind


def test_model_graph_round_trip_across_families() -> None:
    for spec in ("gpt?layers=3&hidden=64&heads=4&vocab=100", "t5?layers=2&hidden=64&heads=4&ffn=128&vocab=50",
                 "moe?layers=2&hidden=64&heads=4&kv_heads=2&ffn=96&vocab=50&experts=4&top_k=2"):
        g = load_model(spec, seq_len=32)
        text = g.to_json()
        assert ModelGraph.from_json(text) == g
        assert ModelGraph.from_json(text).to_json() == text


@settings(max_examples=30)
@given(st.integers(1, 6), st.integers(1, 8).map(lambda h: 16 * h), st.sampled_from(["gpt", "llama", "bert"]))
def test_random_family_graphs_round_trip_and_fold(layers: int, hidden: int, family: str) -> None:
    g = load_model(f"{family}?layers={layers}&hidden={hidden}&heads=4&vocab=97", seq_len=16)
    assert ModelGraph.from_json(g.to_json()) == g
    assert g.unique_blocks == 3  # embedding, one folded transformer block, head
    assert len(g.layers) == layers + 2


def test_layer_must_reference_a_known_block() -> None:
    op = Op(name="x", kind=OpKind.ELEMENTWISE, flops=1, bytes_read=1, bytes_written=1)
    block = Block(hash="abc", ops=(op,), params=0, output_bytes=1)
    with pytest.raises(ValidationError, match=r"layers\[1\] \('b'\): block 'zzz' is not one of"):
        layers = (Layer(name="a", block="abc"), Layer(name="b", block="zzz"))
        ModelGraph(name="m", seq_len=1, blocks=(block,), layers=layers)
    with pytest.raises(ValidationError, match=r"layers\[0\].inputs: 0 must index an earlier layer"):
        ModelGraph(name="m", seq_len=1, blocks=(block,), layers=(Layer(name="a", block="abc", inputs=(0,)),))
    with pytest.raises(ValidationError, match="flops"):
        Op(name="x", kind=OpKind.MATMUL, flops=-1, bytes_read=0, bytes_written=0)


def test_layer_inputs_default_to_the_previous_layer() -> None:
    g = load_model("t5?layers=3&hidden=64&heads=4&ffn=128&vocab=50", seq_len=16)
    names = [layer.name for layer in g.layers]
    enc_out = names.index("encoder.final")
    second_decoder = names.index("decoder.block.1")
    assert g.layer_inputs(second_decoder) == (second_decoder - 1, enc_out)
    assert g.layer_inputs(1) == (0,) and g.layer_inputs(0) == ()
