"""The closed-form families against real traces of the same shapes (Hugging Face, on meta).

Both front-ends must agree on what matters to the cost model: parameters exactly, dense
(matmul) FLOPs exactly, and the whole block's FLOPs within 5% (they differ only in how
pointwise ops are counted).
"""

import pytest

from tagplan.frontends.model_spec import load_model
from tagplan.ir import ModelGraph, OpKind

PAIRS = {
    "gpt": ("hf:GPT2Config?n_layer=2&n_embd=256&n_head=4&vocab_size=1000&n_positions=128&bos_token_id=0"
            "&eos_token_id=0", "gpt?layers=2&hidden=256&heads=4&vocab=1000&max_positions=128"),
    "llama": ("hf:LlamaConfig?num_hidden_layers=2&hidden_size=256&intermediate_size=688&num_attention_heads=4"
              "&num_key_value_heads=2&vocab_size=1000",
              "llama?layers=2&hidden=256&heads=4&kv_heads=2&ffn=688&vocab=1000"),
    "bert": ("hf:BertConfig?num_hidden_layers=2&hidden_size=256&intermediate_size=1024&num_attention_heads=4"
             "&vocab_size=1000&max_position_embeddings=128",
             "bert?layers=2&hidden=256&heads=4&vocab=1000&max_positions=128"),
    "t5": ("hf:T5Config?num_layers=2&d_model=256&d_ff=512&num_heads=4&d_kv=64&vocab_size=1000",
           "t5?layers=2&hidden=256&heads=4&head_dim=64&ffn=512&vocab=1000"),
    "moe": ("hf:MixtralConfig?num_hidden_layers=2&hidden_size=256&intermediate_size=512&num_attention_heads=4"
            "&num_key_value_heads=2&vocab_size=1000&num_local_experts=4&num_experts_per_tok=2",
            "moe?layers=2&hidden=256&heads=4&kv_heads=2&ffn=512&vocab=1000&experts=4&top_k=2"),
    "vit": ("hf:ViTConfig?num_hidden_layers=2&hidden_size=256&intermediate_size=1024&num_attention_heads=4"
            "&image_size=224&patch_size=16", "vit?layers=2&hidden=256&heads=4&patch=16&image=224&classes=2"),
}


def dense_flops(graph: ModelGraph, layer: int) -> float:
    return sum(op.flops for op in graph.block_of(layer).ops if op.kind in (OpKind.MATMUL, OpKind.CONV))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(PAIRS))
def test_closed_form_family_matches_its_trace(family: str) -> None:
    hf_spec, family_spec = PAIRS[family]
    traced, derived = load_model(hf_spec, seq_len=64), load_model(family_spec, seq_len=64)
    assert len(traced.layers) == len(derived.layers)
    # BERT: Hugging Face's masked-LM model has no pooler; the family builds the pre-training model.
    pooler = 256 * 256 + 256 if family == "bert" else 0
    assert traced.params == derived.params - pooler
    for layer in range(len(traced.layers)):
        assert traced.block_of(layer).params + (pooler if layer == len(traced.layers) - 1 else 0) == \
            derived.block_of(layer).params, traced.layers[layer].name
    # transformer blocks: everything with dense FLOPs except the embedding and the head
    blocks = [i for i in range(1, len(derived.layers) - 1) if dense_flops(derived, i) > 0]
    assert blocks
    for i in blocks:
        assert dense_flops(traced, i) == pytest.approx(dense_flops(derived, i), rel=1e-9)
        assert traced.block_of(i).flops == pytest.approx(derived.block_of(i).flops, rel=0.05)
    if family == "t5":  # both see the decoder's second block read the encoder's output
        for graph in (traced, derived):
            second = [layer.name for layer in graph.layers].index("decoder.block.1")
            assert len(graph.layer_inputs(second)) == 2


def score_elements(graph: ModelGraph, layer: int) -> float:
    return sum(op.score_elements for op in graph.block_of(layer).ops if op.kind is OpKind.ATTENTION)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "t5"])
def test_trace_and_closed_form_count_the_same_attention_scores(family: str) -> None:
    """What an unfused kernel writes: heads x queries x keys per sample, from both front-ends."""
    hf_spec, family_spec = PAIRS[family]
    traced, derived = load_model(hf_spec, seq_len=64), load_model(family_spec, seq_len=64)
    with_attention = [i for i in range(len(derived.layers)) if score_elements(derived, i)]
    assert with_attention
    for i in with_attention:
        assert score_elements(traced, i) == pytest.approx(score_elements(derived, i)), derived.layers[i].name
    assert score_elements(derived, with_attention[0]) >= 4 * 64 * 64  # at least one self-attention per block


def causal_flags(graph: ModelGraph) -> list[bool]:
    return [op.causal for i in range(len(graph.layers)) for op in graph.block_of(i).ops if op.kind is OpKind.ATTENTION]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama", "moe", "bert", "vit"])
def test_trace_and_closed_form_agree_which_attention_is_causal(family: str) -> None:
    """A Hugging Face causal LM passes its mask as a tensor; the trace marks its self-attention causal by class."""
    hf_spec, family_spec = PAIRS[family]
    traced, derived = load_model(hf_spec, seq_len=64), load_model(family_spec, seq_len=64)
    assert causal_flags(traced) and causal_flags(derived)
    assert set(causal_flags(traced)) == set(causal_flags(derived)) == {family in ("gpt", "llama", "moe")}
