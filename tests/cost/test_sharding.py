from tagplan.cost.sharding import default_strategies, shard_block
from tagplan.frontends.model_spec import load_model
from tagplan.ir import ShardStrategy as S


def test_megatron_column_row_pattern_is_recovered_from_the_dataflow() -> None:
    block = load_model("gpt?layers=1&hidden=256&heads=4&vocab=100", seq_len=32).block_of(1)
    st = default_strategies(block)
    assert [st[n] for n in ("attn.q", "attn.k", "attn.v")] == [S.COLUMN] * 3
    assert st["attn.sdpa"] is S.HEADS
    assert st["attn.o"] is S.ROW
    assert st["mlp.fc1"] is S.COLUMN and st["mlp.gelu"] is S.COLUMN and st["mlp.fc2"] is S.ROW
    assert st["ln_1"] is S.SEQUENCE and st["residual_2"] is S.SEQUENCE


def test_two_all_reduces_forward_and_two_backward_per_transformer_block() -> None:
    block = load_model("llama?layers=1&hidden=256&heads=4&vocab=100", seq_len=32).block_of(1)
    sharded = shard_block(block)
    forward = [c for c in sharded.comms if not c.backward]
    backward = [c for c in sharded.comms if c.backward]
    assert [c.op for c in forward] == ["attn.o", "mlp.down"]
    assert len(backward) == 2  # q/k/v share one input gradient, gate/up share another
    assert all(c.bytes_per_sample == 32 * 256 * 2 for c in sharded.comms)


def test_traced_block_gets_the_same_pattern() -> None:
    spec = ("hf:LlamaConfig?num_hidden_layers=1&hidden_size=128&intermediate_size=256&num_attention_heads=4"
            "&num_key_value_heads=4&vocab_size=100")
    block = load_model(spec, seq_len=16).block_of(1)
    st = default_strategies(block)
    by_module = {name.rsplit(".", 1)[0]: strategy for name, strategy in st.items() if name.endswith("linear")}
    assert by_module["self_attn.q_proj"] is S.COLUMN and by_module["self_attn.o_proj"] is S.ROW
    assert by_module["mlp.gate_proj"] is S.COLUMN and by_module["mlp.down_proj"] is S.ROW


def test_overrides_change_the_communication() -> None:
    block = load_model("gpt?layers=1&hidden=256&heads=4&vocab=100", seq_len=32).block_of(1)
    swapped = shard_block(block, {"mlp.fc1": S.ROW})
    assert "mlp.fc1" in [c.op for c in swapped.comms if not c.backward]
