"""Any Hugging Face config: config.json files with published values, hf:<Architecture>, hf:<ConfigClass>."""

import json
from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.huggingface import graph_from_hf, graph_from_hf_file
from tagplan.frontends.model_spec import ModelSpecKind, load_model, parse_model_spec
from tagplan.ir.model import OpKind

HF = Path(__file__).parent / "fixtures" / "hf"
SEQ = 256
# Published parameter counts (model cards / safetensors totals). Falcon-7B is 6.92B on its card
# (the "7B" of its name); DeepSeek-V3's 671B excludes the 14B multi-token-prediction module.
PUBLISHED = {
    "mistral-7b": 7.24e9, "qwen2-7b": 7.62e9, "llama-3-8b": 8.03e9, "gemma-2-9b": 9.24e9, "gemma-3-1b": 1.00e9,
    "phi-3-mini": 3.82e9, "gpt-neox-20b": 20.6e9, "falcon-7b": 6.92e9, "mixtral-8x7b": 46.7e9,
    "qwen3-8b": 8.19e9, "qwen1.5-moe-a2.7b": 14.3e9,
    "deepseek-v3": pytest.param(671e9, marks=pytest.mark.slow),  # 256 experts x 6 traced layers: ~15 s
}  # fmt: skip
DEPTH = {"mistral-7b": 32, "qwen2-7b": 28, "llama-3-8b": 32, "gemma-2-9b": 42, "gemma-3-1b": 26, "phi-3-mini": 32,
         "gpt-neox-20b": 44, "falcon-7b": 32, "mixtral-8x7b": 32, "qwen3-8b": 36, "qwen1.5-moe-a2.7b": 24,
         "deepseek-v3": 61}
MOE = {"mixtral-8x7b", "qwen1.5-moe-a2.7b", "deepseek-v3"}
TINY = {"num_hidden_layers": "5", "hidden_size": "64", "intermediate_size": "128", "num_attention_heads": "4",
        "num_key_value_heads": "2", "vocab_size": "100"}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_json_builds_folded_with_the_published_size(name: str) -> None:
    expected = PUBLISHED[name]
    expected = expected.values[0] if hasattr(expected, "values") else expected
    g = load_model(str(HF / name / "config.json"), seq_len=SEQ)
    assert g.params == pytest.approx(expected, rel=0.01)
    blocks = [layer for layer in g.layers if layer.name.startswith(("layers.", "h."))]
    assert len(blocks) == DEPTH[name]
    assert len(g.blocks) <= 4  # folded: embed, (dense prefix,) repeated block, head
    data = json.loads((HF / name / "config.json").read_text())
    assert g.family == data["model_type"]
    a2a = [op for b in g.blocks for op in b.ops if op.kind is OpKind.ALL_TO_ALL]
    assert bool(a2a) == (name in MOE)


def test_moe_flops_follow_the_active_parameters() -> None:
    g = load_model(str(HF / "mixtral-8x7b"), seq_len=SEQ)  # a directory holding config.json
    per_token = g.flops_per_sample / SEQ
    assert per_token == pytest.approx(2 * 12.9e9, rel=0.05)  # 2 FLOPs x 12.9B active parameters, plus attention


def test_architecture_and_config_class_names_build_the_same_model() -> None:
    by_arch = graph_from_hf("MistralForCausalLM", TINY, seq_len=16)
    by_config = graph_from_hf("MistralConfig", TINY, seq_len=16)
    assert by_arch.params == by_config.params and by_arch.family == "mistral"
    assert [layer.block for layer in by_arch.layers] == [layer.block for layer in by_config.layers]
    assert len(by_arch.layers) == 7 and by_arch.name.startswith("hf:MistralForCausalLM?num_hidden_layers=5")


def test_generic_folding_equals_the_full_trace() -> None:
    folded = graph_from_hf("Qwen2ForCausalLM", TINY, seq_len=16)
    full = graph_from_hf("Qwen2ForCausalLM", TINY, seq_len=16, fold=False)
    assert folded.model_dump() == full.model_dump()


def test_deepseek_dense_prefix_is_kept_when_folding() -> None:
    tiny = {"num_hidden_layers": "6", "first_k_dense_replace": "2", "hidden_size": "64", "intermediate_size": "128",
            "moe_intermediate_size": "32", "n_routed_experts": "8", "num_experts_per_tok": "2", "n_group": "2",
            "topk_group": "1", "num_attention_heads": "4", "num_key_value_heads": "4", "q_lora_rank": "32",
            "kv_lora_rank": "16", "qk_nope_head_dim": "16", "qk_rope_head_dim": "8", "v_head_dim": "16",
            "vocab_size": "100"}
    g = graph_from_hf("DeepseekV3ForCausalLM", tiny, seq_len=16)
    blocks = [layer.block for layer in g.layers[1:-1]]
    assert blocks[0] == blocks[1] != blocks[2] and len(set(blocks[2:])) == 1
    assert g.model_dump() == graph_from_hf("DeepseekV3ForCausalLM", tiny, seq_len=16, fold=False).model_dump()


def test_config_json_paths_parse_without_reading() -> None:
    assert parse_model_spec("nowhere/config.json").kind is ModelSpecKind.HF_FILE
    assert parse_model_spec("nowhere/mistral/").kind is ModelSpecKind.HF_FILE
    assert parse_model_spec("nowhere/config.json").names_file
    assert parse_model_spec("hf:MistralForCausalLM?num_hidden_layers=4").blocks == 4


def test_a_config_json_under_another_name_is_read_as_one(tmp_path: Path) -> None:
    data = json.loads((HF / "llama-3-8b" / "config.json").read_text())
    path = tmp_path / "llama.json"  # kind FILE: the content tells it is a Hugging Face config
    path.write_text(json.dumps({**data, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}))
    g = load_model(str(path), seq_len=16)
    assert g.family == "llama" and len(g.layers) == 4


def test_bad_configs_are_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="Did you mean 'MistralForCausalLM'"):
        graph_from_hf("MistralForCausalLMM", {})
    with pytest.raises(SpecError, match="does not exist"):
        graph_from_hf_file(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model", "hidden_size": 8}))
    with pytest.raises(SpecError, match="model_type 'not_a_model'"):
        graph_from_hf_file(str(tmp_path))


@pytest.mark.parametrize("arch, overrides", [
    ("T5ForConditionalGeneration", {"num_layers": "2", "num_decoder_layers": "2", "d_model": "64", "d_ff": "128",
                                    "num_heads": "4", "d_kv": "16", "vocab_size": "100"}),
    ("BartForConditionalGeneration", {"encoder_layers": "2", "decoder_layers": "2", "d_model": "64",
                                      "encoder_ffn_dim": "128", "decoder_ffn_dim": "128",
                                      "encoder_attention_heads": "4", "decoder_attention_heads": "4",
                                      "vocab_size": "100"}),
])
def test_an_encoder_decoder_architecture_is_traced_with_its_decoders_tokens(arch: str,
                                                                           overrides: dict[str, str]) -> None:
    """An encoder-decoder class (T5, BART) needs the decoder's token ids beside the encoder's: its graph holds both
    stacks, the decoder's blocks reading the encoder's output (cross-attention)."""
    graph = graph_from_hf(arch, overrides, seq_len=16)
    names = [layer.name for layer in graph.layers]
    assert sum(n.startswith("encoder") for n in names) >= 2 and sum(n.startswith("decoder") for n in names) >= 2
    attention = [sum(op.kind is OpKind.ATTENTION for op in graph.block_of(i).ops) for i in range(len(names))]
    assert max(attention) == 2  # a decoder block: self- and cross-attention
    causal = {(names[i], op.name) for i in range(len(names)) for op in graph.block_of(i).ops if op.causal}
    # the decoder's self-attention is masked causally; the encoder's and the cross-attention see every token
    decoders = {n for n in names if n.startswith(("decoder.block.", "decoder.layers."))}
    assert len(decoders) == 2 and {name for name, _ in causal} == decoders
    assert all("self" in op.lower() for _, op in causal)


@pytest.mark.parametrize("arch, config_class", [("LlamaForCausalLM", "LlamaConfig"), ("GPT2LMHeadModel", "GPT2Config"),
                                                ("DeepseekV3ForCausalLM", "DeepseekV3Config")])
def test_an_architecture_listed_under_several_model_types_takes_its_own_config(arch: str, config_class: str) -> None:
    """Transformers lists LlamaForCausalLM under llama, exaone, internlm3...: `hf:LlamaForCausalLM` is built from
    LlamaConfig (ExaoneConfig's defaults, 8 key-value heads, broke a 4-head override at tracing)."""
    from tagplan.frontends.hf_config import resolve_hf_name

    assert resolve_hf_name(arch).config_class == config_class
    if arch == "LlamaForCausalLM":
        graph = graph_from_hf(arch, {"num_hidden_layers": "2", "hidden_size": "64", "intermediate_size": "128",
                                     "num_attention_heads": "4", "vocab_size": "100"}, seq_len=16)
        assert graph.family == "llama"


def test_a_causal_lm_whose_queries_and_keys_come_from_different_projections_stays_causal() -> None:
    """Multi-head latent attention (DeepSeek-V2/V3) projects queries through q_b_proj and keys through kv_b_proj:
    read as a cross-attention, its self-attention lost its causal marking (and half its costed time)."""
    graph = graph_from_hf("DeepseekV3Config", {
        "num_hidden_layers": "2", "hidden_size": "64", "num_attention_heads": "4", "num_key_value_heads": "4",
        "q_lora_rank": "32", "kv_lora_rank": "16", "qk_rope_head_dim": "8", "qk_nope_head_dim": "8",
        "v_head_dim": "16", "intermediate_size": "128", "moe_intermediate_size": "32", "n_routed_experts": "4",
        "num_experts_per_tok": "2", "first_k_dense_replace": "1", "vocab_size": "100", "n_group": "1",
        "topk_group": "1"}, seq_len=16)
    attention = [op for block in graph.blocks for op in block.ops if op.kind is OpKind.ATTENTION]
    assert attention and all(op.causal for op in attention)


def test_a_model_whose_blocks_differ_is_traced_whole_only_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Folding fails where the traced blocks differ (Qwen2-MoE with a dense layer among its experts): each block is
    then traced one by one, which took 90 s at 256 blocks and held a service worker past any budget beyond."""
    from tagplan.frontends import hf_fold

    monkeypatch.setattr(hf_fold, "MAX_UNFOLDED_BLOCKS", 4)
    overrides = {"num_hidden_layers": "5", "hidden_size": "64", "num_attention_heads": "2", "num_key_value_heads": "2",
                 "intermediate_size": "64", "moe_intermediate_size": "32", "shared_expert_intermediate_size": "32",
                 "num_experts": "4", "num_experts_per_tok": "2", "vocab_size": "100", "mlp_only_layers": "[1]"}
    with pytest.raises(SpecError, match=r"its traced blocks differ from one another, so its 5 blocks would be traced "
                                        r"one by one; at most 4 are"):
        graph_from_hf("Qwen2MoeConfig", overrides, seq_len=16)
    assert len(graph_from_hf("Qwen2MoeConfig", {**overrides, "num_hidden_layers": "4"}, seq_len=16).layers) == 6


def test_a_config_class_transformers_cannot_default_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from tagplan.frontends.hf_config import make_config

    class NeedsArguments(transformers.PretrainedConfig):  # e.g. a composite config whose parts are required
        def __init__(self, encoder: dict, **kwargs: object) -> None:
            super().__init__(**kwargs)

    monkeypatch.setattr(transformers, "NeedsArgumentsConfig", NeedsArguments, raising=False)
    with pytest.raises(SpecError, match=r"^NeedsArgumentsConfig: transformers cannot build its default config: "):
        make_config("NeedsArgumentsConfig", {})
    with pytest.raises(SpecError, match=r"unknown LlamaConfig key 'hidden_sise'\. Did you mean 'hidden_size'"):
        make_config("LlamaConfig", {"hidden_sise": "64"})
