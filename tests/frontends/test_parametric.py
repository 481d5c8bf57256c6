import time

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.families import TransformerShape, gpt_block
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.parametric import FAMILY_KEYS
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
    ("gpt?layers=2&hidden=128&heads=4&experts=8&image=3",
     r"^gpt: key 'experts' is not read by the gpt family \(only by moe\); gpt accepts layers, hidden, heads, "
     r"kv_heads, head_dim, ffn, vocab, tied, max_positions$"),
    ("vit?layers=2&image=28&patch=14&vocab=100", r"key 'vocab' is not read by the vit family"),
    ("llama?max_positions=4096", r"key 'max_positions' is not read by the llama family \(only by gpt, bert\)"),
    ("t5?layers=2&hidden=128&heads=4&dec_layers=0",
     r"^dec_layers=0: must be positive \(leave dec_layers out for as many decoder layers as encoder layers\)$"),
    ("moe?layers=2&hidden=128&heads=4",
     r"^moe: heads=4 is not divisible by kv_heads=8 \(the moe default\); set kv_heads to a divisor of heads "
     r"\(e\.g\. kv_heads=4\)$"),
    ("moe?layers=2&hidden=128&heads=4&kv_heads=3", r"heads=4 is not divisible by kv_heads=3; set kv_heads"),
    ("gpt?hidden=100", r"hidden=100 is not divisible by heads=12 \(the gpt default\)"),
    ("gpt?layers=2&layers=3", r"^gpt: key 'layers' is given twice; give each key once$"),
    ("gpt?kv_heads=-1", r"kv_heads=-1: must be >= 0; 0 means as many as heads"),
])
def test_family_spec_errors(spec: str, message: str | None) -> None:
    if message is None:
        assert load_model(spec).seq_len == 512
        return
    with pytest.raises(SpecError, match=message):
        load_model(spec)


def test_llama_rotates_queries_and_keys_in_one_pass_that_keeps_nothing() -> None:
    """The rotary op reads and writes every query and key head once (plus the cos/sin tables), attention reads
    the rotated copies, and it saves nothing itself: attention keeps what it kept before."""
    g = load_model("llama?layers=1&hidden=512&heads=8&kv_heads=2&vocab=100", seq_len=64)
    block = g.block_of(1)
    ops = {op.name: op for op in block.ops}
    rotary, sdpa = ops["attn.rotary"], ops["attn.sdpa"]
    elements = 64 * (8 + 2) * 64  # seq x (query + key heads) x head width
    assert rotary.kind is OpKind.ELEMENTWISE and rotary.inputs == ("attn.q", "attn.k")
    assert rotary.bytes_written == elements * 2 and rotary.bytes_read == (elements + 2 * 64 * 64) * 2
    assert rotary.flops == 3 * elements and rotary.saved_bytes == 0
    assert sdpa.inputs == ("attn.rotary", "attn.v")
    q_bytes, kv_bytes = 64 * 512 * 2, 2 * 64 * 128 * 2
    assert sdpa.saved_bytes == 2 * q_bytes + kv_bytes  # q, k, v and its output, as without the rotary op
    gpt = load_model("gpt?layers=1&hidden=512&heads=8&vocab=100", seq_len=64)
    assert not any("rotary" in op.name for op in gpt.block_of(1).ops)  # learned positions: nothing to rotate


def test_the_rotary_op_splits_by_heads_without_a_collective() -> None:
    """Under Megatron's sharding the rotary op follows the column-parallel q and k projections (split by heads):
    the block's TP collectives are those of the block without it."""
    from tagplan.cost.sharding import shard_block
    from tagplan.ir.plan import ShardStrategy

    block = load_model("llama?layers=1&hidden=512&heads=8&kv_heads=2&vocab=100", seq_len=64).block_of(1)
    sharded = shard_block(block)
    assert sharded.strategies["attn.rotary"] is ShardStrategy.COLUMN
    assert not [c for c in sharded.comms if c.op == "attn.rotary"]
    assert len(sharded.comms) == 8  # all-gather and reduce-scatter at each norm-to-projection and back, fwd + bwd


@pytest.mark.parametrize("spec", [  # each value differs from the family default
    "gpt?layers=2&hidden=64&heads=4&kv_heads=2&head_dim=8&ffn=128&vocab=100&tied=false&max_positions=64",
    "llama?layers=2&hidden=64&heads=4&kv_heads=2&head_dim=8&ffn=128&vocab=100&tied=true",
    "bert?layers=2&hidden=64&heads=4&kv_heads=2&head_dim=8&ffn=128&vocab=100&tied=false&max_positions=64",
    "t5?layers=2&hidden=64&heads=4&dec_layers=3&kv_heads=2&head_dim=8&ffn=128&vocab=100&tied=false",
    "moe?layers=2&hidden=64&heads=8&kv_heads=2&head_dim=16&ffn=128&vocab=100&tied=true&experts=4&top_k=1",
    "vit?layers=2&hidden=64&heads=4&kv_heads=2&head_dim=8&ffn=128&patch=7&image=28&classes=10",
])
def test_every_key_a_family_reads_is_accepted_and_changes_its_model(spec: str) -> None:
    """Each key each family accepts changes the model it builds: none is accepted and then ignored."""
    family, _, query = spec.partition("?")
    assert {pair.split("=")[0] for pair in query.split("&")} == set(FAMILY_KEYS[family])
    sizes, others = query.split("&")[:3], query.split("&")[3:]  # layers, hidden, heads; then the keys under test
    base = load_model(spec, seq_len=32).model_dump(exclude={"name"})
    for pair in others:
        without = load_model(f"{family}?{'&'.join(sizes + [p for p in others if p != pair])}", seq_len=32)
        assert without.model_dump(exclude={"name"}) != base, pair
