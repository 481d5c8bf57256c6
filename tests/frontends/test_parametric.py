import time

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.families import TransformerShape, gpt_block
from tagplan.frontends.model_spec import load_model
from tagplan.ir import OpKind


@pytest.mark.parametrize(("s", "h"), [(2048, 12288), (1024, 1024), (4096, 4096), (512, 256)])
def test_gpt_block_flops_match_the_closed_form(s: int, h: int) -> None:
    """Forward FLOPs of a transformer layer: 24 s h^2 + 4 s^2 h per sample (b = 1), within 5%."""
    block = gpt_block(TransformerShape(layers=1, hidden=h, heads=max(h // 128, 1)), s, 2)
    closed = 24 * s * h * h + 4 * s * s * h
    assert block.flops == pytest.approx(closed, rel=0.05)
    matmul = sum(op.flops for op in block.ops if op.kind in (OpKind.MATMUL,))
    assert matmul == pytest.approx(24 * s * h * h, rel=1e-9)  # the dense part is exact


def test_trillion_parameter_model_builds_fast_by_folding() -> None:
    start = time.perf_counter()
    g = load_model("gpt?layers=128&hidden=25600&heads=160&vocab=50257", seq_len=2048)
    elapsed = time.perf_counter() - start
    assert g.params > 1.0e12
    assert g.unique_blocks == 3
    assert elapsed < 5.0  # generous bound for a loaded CI box; bench/ measures the real figure


def test_width_changes_the_hash_and_depth_does_not() -> None:
    a = load_model("gpt?layers=4&hidden=256&heads=4&vocab=100", seq_len=64)
    b = load_model("gpt?layers=8&hidden=256&heads=4&vocab=100", seq_len=64)
    c = load_model("gpt?layers=4&hidden=512&heads=4&vocab=100", seq_len=64)
    assert a.layers[1].block == b.layers[1].block == b.layers[8].block
    assert a.layers[1].block != c.layers[1].block


def test_gqa_reduces_kv_projections() -> None:
    mha = load_model("llama?layers=1&hidden=512&heads=8&vocab=100", seq_len=64)
    gqa = load_model("llama?layers=1&hidden=512&heads=8&kv_heads=2&vocab=100", seq_len=64)
    assert gqa.params < mha.params
    k_op = next(op for op in gqa.block_of(1).ops if op.name == "attn.k")
    assert k_op.param_bytes == 512 * (2 * 64) * 2


def test_activation_memory_is_saved_once_per_tensor() -> None:
    """ln_1's output feeds q, k and v but is saved for backward once."""
    block = gpt_block(TransformerShape(layers=1, hidden=64, heads=4), 16, 2)
    by_name = {op.name: op for op in block.ops}
    assert by_name["attn.q"].saved_bytes == 16 * 64 * 2
    assert by_name["attn.k"].saved_bytes == 0 and by_name["attn.v"].saved_bytes == 0


@pytest.mark.parametrize(("spec", "message"), [
    ("gpt?layers=-1", "layers=-1: must be positive"),
    ("gpt?heads=7&hidden=64", "not divisible by heads=7"),
    ("moe?experts=2&top_k=4", "top_k=4 exceeds experts=2"),
    ("gpt?hiden=64", "Did you mean 'hidden'"),
    ("gpt?tied=maybe", "expected true or false"),
    ("bert", None),
])
def test_family_spec_errors(spec: str, message: str | None) -> None:
    if message is None:
        assert load_model(spec).seq_len == 512
        return
    with pytest.raises(SpecError, match=message):
        load_model(spec)
