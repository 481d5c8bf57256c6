"""graph_from_hf: supported config classes, overrides, folding and the analytic MoE experts."""

import functools

import pytest
import torch
import transformers

from tagplan.errors import SpecError
from tagplan.frontends.huggingface import graph_from_hf, list_hf_configs
from tagplan.ir.model import ModelGraph, OpKind, PartitionDim

SEQ = 16
GPT2 = {"n_layer": "2", "n_embd": "64", "n_head": "4", "vocab_size": "100", "n_positions": "64"}
LLAMA = {"num_hidden_layers": "2", "hidden_size": "64", "intermediate_size": "128", "num_attention_heads": "4",
         "num_key_value_heads": "2", "vocab_size": "100"}
T5 = {"num_layers": "2", "d_model": "64", "d_ff": "128", "num_heads": "4", "d_kv": "16", "vocab_size": "100"}
MIXTRAL = {**LLAMA, "num_local_experts": "4", "num_experts_per_tok": "2"}
BERT = {"num_hidden_layers": "2", "hidden_size": "64", "intermediate_size": "128", "num_attention_heads": "4",
        "vocab_size": "100"}
VIT = {"num_hidden_layers": "2", "hidden_size": "64", "intermediate_size": "128", "num_attention_heads": "4",
       "image_size": "32", "patch_size": "8"}


def module_params(config_class: str, model_class: str, overrides: dict[str, str]) -> int:
    """Parameters of the real model built from the same config (on meta)."""
    cfg_cls = getattr(transformers, config_class)
    default = cfg_cls()
    values = {k: type(getattr(default, k))(v) for k, v in overrides.items()}
    with torch.device("meta"):
        model = getattr(transformers, model_class)(cfg_cls(**values))
    return sum(p.numel() for p in model.parameters())


def names(g: ModelGraph) -> list[str]:
    return [layer.name for layer in g.layers]


def test_list_hf_configs() -> None:
    assert list_hf_configs() == sorted(
        ["GPT2Config", "LlamaConfig", "BertConfig", "T5Config", "MixtralConfig", "ViTConfig"]
    )


def test_unknown_config_class_suggests_the_nearest() -> None:
    with pytest.raises(SpecError, match="Did you mean 'LlamaConfig'"):
        graph_from_hf("LlamaConfg", {})


def test_unknown_key_names_it_and_suggests_valid_keys() -> None:
    with pytest.raises(SpecError, match=r"'hidden_sise'.*'hidden_size'"):
        graph_from_hf("LlamaConfig", {"hidden_sise": "64"})


def test_values_are_coerced_to_the_default_type() -> None:
    with pytest.raises(SpecError, match=r"hidden_size='wide' is not a valid int"):
        graph_from_hf("LlamaConfig", {"hidden_size": "wide"})
    with pytest.raises(SpecError, match="is not a valid bool"):
        graph_from_hf("LlamaConfig", {**LLAMA, "tie_word_embeddings": "maybe"})
    untied = graph_from_hf("LlamaConfig", LLAMA, seq_len=SEQ)
    tied = graph_from_hf("LlamaConfig", {**LLAMA, "tie_word_embeddings": "true", "rms_norm_eps": "1e-5"}, seq_len=SEQ)
    assert untied.params - tied.params == 100 * 64  # the lm_head matrix


def test_gpt2_layers_params_and_aliases() -> None:
    g = graph_from_hf("GPT2Config", GPT2, seq_len=SEQ)
    assert names(g) == ["embed", "h.0", "h.1", "head"]
    assert g.layers[1].block == g.layers[2].block
    assert g.family == "gpt2" and g.name.startswith("hf:GPT2Config?n_layer=2")
    assert g.params == module_params("GPT2Config", "GPT2LMHeadModel", GPT2)
    alias = graph_from_hf("GPT2Config", {**GPT2, "num_hidden_layers": "2", "hidden_size": "64"}, seq_len=SEQ)
    assert alias.params == g.params


def test_default_seq_len_and_learned_position_limit() -> None:
    assert graph_from_hf("GPT2Config", GPT2).seq_len == 64  # n_positions
    with pytest.raises(SpecError, match="exceeds the 64 learned positions"):
        graph_from_hf("GPT2Config", GPT2, seq_len=65)


def test_t5_has_both_stacks_and_decoder_reads_the_encoder() -> None:
    g = graph_from_hf("T5Config", T5, seq_len=SEQ)
    assert names(g) == ["embed", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm+decoder.embed_tokens",
                        "decoder.block.0", "decoder.block.1", "head"]
    encoder_out = 3  # the layer holding the encoder's final norm
    assert g.layers[4].inputs is None  # its predecessor is the encoder output
    assert g.layers[5].inputs == (encoder_out, 4)
    assert g.block_of(encoder_out).output_bytes == 2 * SEQ * 64 * 2  # encoder output + decoder embeddings
    assert g.layers[1].block != g.layers[2].block  # block 0 holds the relative attention bias
    assert g.params == module_params("T5Config", "T5ForConditionalGeneration", T5)
    assert graph_from_hf("T5Config", T5).seq_len == 512


@pytest.mark.slow
def test_t5_folding_equals_the_full_trace() -> None:
    deep = {**T5, "num_layers": "5", "num_decoder_layers": "4"}
    folded = graph_from_hf("T5Config", deep, seq_len=SEQ)
    full = graph_from_hf("T5Config", deep, seq_len=SEQ, fold=False)
    assert folded == full
    assert names(folded)[5] == "encoder.block.4" and folded.layers[-2].inputs == (6, 9)


@functools.cache
def mixtral(top_k: str) -> ModelGraph:
    return graph_from_hf("MixtralConfig", {**MIXTRAL, "num_experts_per_tok": top_k}, seq_len=SEQ)


def test_mixtral_params_count_all_experts() -> None:
    g = mixtral("2")
    h, f, e, v, kv = 64, 128, 4, 100, 2 * 16
    layer = 2 * h * h + 2 * h * kv + e * 3 * h * f + h * e + 2 * h  # attention, experts, router, norms
    assert g.params == 2 * v * h + 2 * layer + h
    assert g.params == module_params("MixtralConfig", "MixtralForCausalLM", MIXTRAL)


def test_mixtral_expert_flops_follow_top_k_with_all_to_all() -> None:
    h, f = 64, 128
    for k in (1, 2):
        block = mixtral(str(k)).block_of(1)
        experts = [op for op in block.ops if PartitionDim.EXPERTS in op.partition_dims and op.kind is OpKind.MATMUL]
        assert len(experts) == 2
        assert sum(op.flops for op in experts) == pytest.approx(2 * 3 * h * f * k * SEQ)
        assert all({PartitionDim.HIDDEN_IN, PartitionDim.HIDDEN_OUT} <= set(op.partition_dims) for op in experts)
        a2a = [op for op in block.ops if op.kind is OpKind.ALL_TO_ALL]
        assert [op.name for op in a2a] == ["mlp.experts.dispatch", "mlp.experts.combine"]
        assert all(op.flops == 0 and op.bytes_written == SEQ * h * k * 2 for op in a2a)
        ordered = [op.name for op in block.ops]
        assert ordered.index("mlp.experts.dispatch") < ordered.index(experts[0].name)
        assert ordered.index(experts[-1].name) < ordered.index("mlp.experts.combine")
    assert mixtral("1").layers[1].block == mixtral("1").layers[2].block


def test_vit_derives_seq_len_from_patches() -> None:
    g = graph_from_hf("ViTConfig", VIT, seq_len=999)
    assert g.seq_len == (32 // 8) ** 2 + 1
    assert names(g) == ["embed", "layers.0", "layers.1", "head"]
    assert any(op.kind is OpKind.CONV for op in g.block_of(0).ops)
    assert g.params == module_params("ViTConfig", "ViTForImageClassification", VIT)


def test_bert_masked_lm() -> None:
    g = graph_from_hf("BertConfig", BERT, seq_len=SEQ)
    assert names(g) == ["embed", "layer.0", "layer.1", "head"]
    assert g.params == module_params("BertConfig", "BertForMaskedLM", BERT)


def test_rejected_config_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="LlamaConfig"):
        graph_from_hf("LlamaConfig", {**LLAMA, "num_attention_heads": "5"}, seq_len=SEQ)


@pytest.mark.slow
def test_default_llama_folds_to_32_layers_and_matches_a_full_trace() -> None:
    g = graph_from_hf("LlamaConfig", {})
    assert g.seq_len == 2048 and len(g.layers) == 34 and g.unique_blocks == 3
    assert names(g)[1:4] == ["layers.0", "layers.1", "layers.2"] and names(g)[-2] == "layers.31"
    assert g.params == pytest.approx(6_738_415_616, rel=1e-3)  # Llama-2-7B
    folded = graph_from_hf("LlamaConfig", {"num_hidden_layers": "8"})
    full = graph_from_hf("LlamaConfig", {"num_hidden_layers": "8"}, fold=False)
    assert [layer.block for layer in folded.layers] == [layer.block for layer in full.layers]
    assert folded.params == pytest.approx(full.params, rel=1e-3)
    assert folded == full
    assert {b.hash for b in folded.blocks} == {b.hash for b in g.blocks}
