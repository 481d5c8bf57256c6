from tagplan.cost.sharding import Layout, comm_events, default_strategies, loss_layout, shard_block
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


def test_megatron_sequence_parallel_collectives_per_transformer_block() -> None:
    """Megatron-LM with SP: all-gather before attention and MLP, reduce-scatter after, mirrored backward."""
    block = load_model("llama?layers=1&hidden=256&heads=4&vocab=100", seq_len=32).block_of(1)
    sharded = shard_block(block)
    forward = [(c.op, c.collective.value) for c in sharded.comms if not c.backward]
    backward = sorted(c.collective.value for c in sharded.comms if c.backward)
    assert forward == [("attn.q", "all_gather"), ("residual_1", "reduce_scatter"),
                       ("mlp.gate", "all_gather"), ("residual_2", "reduce_scatter")]
    assert backward == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]  # q/k/v reduce once
    assert all(c.bytes_per_sample == 32 * 256 * 2 for c in sharded.comms)


def test_replicated_boundary_gives_megatron_all_reduces() -> None:
    block = load_model("gpt?layers=1&hidden=256&heads=4&vocab=100", seq_len=32).block_of(1)
    strategies = default_strategies(block)
    strategies.update({name: S.REPLICATE for name in ("ln_1", "ln_2", "residual_1", "residual_2")})
    events = comm_events(block, strategies, boundary=Layout.R)
    assert [(c.op, c.collective.value, c.backward) for c in events if not c.backward] == [
        ("residual_1", "all_reduce", False), ("residual_2", "all_reduce", False)]
    backward = [(c.op, c.collective.value) for c in events if c.backward]
    assert len(backward) == 2 and all(kind == "all_reduce" for _, kind in backward)
    assert backward[0][0] in {"attn.q", "attn.k", "attn.v"} and backward[1][0] == "mlp.fc1"


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
    assert len(swapped.comms) > len(shard_block(block).comms)  # fc1's input must now be split first


def test_traced_gpt2_collectives_follow_views_and_find_the_block_output() -> None:
    spec = "hf:GPT2Config?n_layer=1&n_embd=128&n_head=4&vocab_size=100&bos_token_id=0&eos_token_id=0"
    model = load_model(spec, seq_len=16)
    names = [layer.name for layer in model.layers]
    block = model.block_of(names.index("h.0"))
    events = shard_block(block).comms
    assert sorted(c.collective.value for c in events if not c.backward) == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert sorted(c.collective.value for c in events if c.backward) == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert all(c.bytes_per_sample > 0 for c in events)


def test_embedding_reduces_once_and_the_head_keeps_vocab_parallel_logits() -> None:
    model = load_model("gpt?layers=1&hidden=128&heads=4&vocab=100", seq_len=16)
    embed = shard_block(model.block_of(0)).comms
    assert [(c.collective.value, c.backward) for c in embed] == [("reduce_scatter", False), ("all_gather", True)]
    head = shard_block(model.block_of(len(model.layers) - 1)).comms
    assert "all_to_all" not in {c.collective.value for c in head}


def test_the_loss_reads_the_tied_heads_logits_and_a_row_heads_partial_sums_are_reduced() -> None:
    model = load_model("gpt?layers=1&hidden=128&heads=4&vocab=100", seq_len=16)
    head = model.block_of(len(model.layers) - 1)
    loss = next(op for op in head.ops if op.name == "cross_entropy")
    assert loss.inputs == ("lm_head.tied",)  # the loss reads the tied head's logits (it read a missing name)
    logits = next(op.bytes_written for op in head.ops if op.name == "lm_head.tied")
    for strategy in ("column", "sequence", "replicate"):  # the loss where the logits lie: they stay put
        events = shard_block(head, {"lm_head.tied": S(strategy), "cross_entropy": S(strategy)}).comms
        assert [c for c in events if c.bytes_per_sample == logits] == [], strategy
    moved = shard_block(head, {"lm_head.tied": S.SEQUENCE}).comms  # a vocabulary-parallel loss on token-split logits
    assert {(c.collective.value, c.backward) for c in moved if c.bytes_per_sample == logits} == {
        ("all_to_all", False), ("all_to_all", True)}
    row = {(c.collective.value, c.backward) for c in shard_block(head, {"lm_head.tied": S.ROW}).comms
           if c.bytes_per_sample == logits}
    assert row == {("reduce_scatter", False), ("all_gather", True)}  # partial sums are never free
    assert loss_layout(Layout.P) is Layout.S and loss_layout(Layout.H) is Layout.H
