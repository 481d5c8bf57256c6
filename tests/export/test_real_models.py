"""Hugging Face classes and a user's own module in the torch program: layers cut from the real model.

The fast tests chain the program's layers (`modules.build_layer`, built one by one as ranks build
them) and compare with the whole model's own `forward` (the transformers class, the user's
Sequential); the slow ones run `verify` on gloo processes.
"""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tagplan.export.capability import exportable
from tagplan.export.checks import ExportError
from tagplan.export.modules import build_layer, build_model, grads_by_layer, tied_param_names
from tagplan.export.runtime_launch import launch
from tagplan.export.runtime_parallel import layer_styles
from tagplan.export.shapes import model_config, scaled_down
from tagplan.export.torch_checks import check_expressible, torch_config
from tagplan.export.torch_program import write_torch_program
from tagplan.export.verify import verify
from tagplan.frontends.model_spec import load_model, parse_model_spec
from tagplan.ir.plan import Plan, Stage

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_lm.py"
LLAMA = ("hf:LlamaConfig?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2"
         "&head_dim=16&intermediate_size=128&vocab_size=128&max_position_embeddings=64")
QWEN_TIED = ("hf:Qwen2Config?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2"
             "&intermediate_size=128&vocab_size=128&tie_word_embeddings=true")
GPT2 = (
    "hf:GPT2Config?n_layer=2&n_embd=64&n_head=4&vocab_size=128&n_positions=16&resid_pdrop=0.0&embd_pdrop=0.0&attn_pdrop=0.0")


def _chained_logits(spec: str, tokens: torch.Tensor) -> torch.Tensor:
    config = model_config(spec, seq_len=tokens.size(1))
    x = tokens
    for j in range(config.num_layers):
        x = build_layer(config, j, seed=3)(x)
    return x


@pytest.mark.parametrize("spec", [LLAMA, QWEN_TIED, GPT2, f"{FIXTURE}:tiny"])
def test_layers_built_one_by_one_equal_the_whole_models_own_forward(spec: str) -> None:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    whole = build_model(spec, seq_len=16, seed=3)
    if spec.startswith("hf:"):  # the reference is the transformers class itself, not a look-alike
        assert type(whole.model).__module__.startswith("transformers.models.")
    with torch.no_grad():
        expected = whole(tokens)
        got = _chained_logits(spec, tokens)
    assert got.shape == expected.shape == (2, 16, model_config(spec, seq_len=16).vocab)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_tied_reference_sums_both_uses_into_the_embeddings_gradient() -> None:
    whole = build_model(QWEN_TIED, seq_len=16, seed=0)
    whole(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
    grads = grads_by_layer(whole)
    table, head = tied_param_names(model_config(QWEN_TIED, seq_len=16)) or ("", "")
    assert table == "layers.0.model.embed_tokens.weight" and head == "layers.3.lm_head.weight"
    assert table in grads and head not in grads  # one parameter, named as the embedding
    assert "layers.1.layer.self_attn.q_proj.weight" in grads


def test_a_user_modules_buffers_come_from_a_real_build() -> None:
    layer = build_layer(model_config(f"{FIXTURE}:tiny", seq_len=16), 1, seed=0)
    assert float(layer.get_buffer("layer.scale")) == 0.5


def test_traced_hf_ops_find_the_classes_linear_modules() -> None:
    config = model_config(LLAMA, seq_len=16)
    layer = build_layer(config, 1, seed=0)
    strategies = {"self_attn.q_proj.linear": "column", "self_attn.o_proj.linear": "row",
                  "mlp.gate_proj.linear": "replicate"}
    styles = layer_styles(layer, 1, config, strategies, sp=False)
    assert isinstance(styles["layer.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["layer.self_attn.o_proj"], RowwiseParallel)
    assert "layer.mlp.gate_proj" not in styles  # replicate: left whole
    head = build_layer(config, 3, seed=0)
    assert isinstance(layer_styles(head, 3, config, {"lm_head.linear": "column"}, sp=False)["lm_head"],
                      ColwiseParallel)


def test_program_config_carries_the_traced_strategies_of_an_hf_plan(tmp_path: Path) -> None:
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2),
                                         Stage(layers=(2, 4), devices=(2,))))
    write_torch_program(LLAMA, plan, tmp_path, seq_len=16, global_batch=4)
    cfg = json.loads((tmp_path / "plan.json").read_text())
    block = cfg["stages"][0]["strategies"]["1"]
    assert block["self_attn.q_proj.linear"] == "column" and block["self_attn.o_proj.linear"] == "row"
    assert cfg["stages"][0]["strategies"]["0"] == {"model.embed_tokens.embedding": "row"}
    assert cfg["model"] == LLAMA


def _checked(plan: Plan, spec: str) -> None:
    check_expressible(plan, load_model(spec, seq_len=16), config=torch_config(parse_model_spec(spec), seq_len=16))


def test_refusals_name_the_reason() -> None:
    two = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), tp=2),))
    with pytest.raises(ExportError, match="GPT-2's matmuls are transformers Conv1D"):
        _checked(two, GPT2)
    one = Plan(stages=(Stage(layers=(0, 4), devices=(0,)),))
    with pytest.raises(ExportError, match="share a parameter"):
        _checked(one, f"{FIXTURE}:tied")
    with pytest.raises(ExportError, match=r"an nn.Sequential of its layers .*; Towers is not"):
        _checked(Plan(stages=(Stage(layers=(0, 2), devices=(0,)),)), f"{FIXTURE}:towers")
    with pytest.raises(ExportError, match="model types llama, mistral"):
        _checked(one, "hf:BertConfig?num_hidden_layers=2")
    qwen3 = ("hf:Qwen3Config?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2"
             "&head_dim=16&intermediate_size=128&vocab_size=128")
    with pytest.raises(ExportError, match="qwen3 normalises q and k per head"):  # verify showed k_norm's gradient off
        _checked(two, qwen3)
    _checked(one, qwen3)  # tp 1 runs (verified on the pipeline runtime)


def test_a_graph_is_never_read_as_a_spec_and_the_planner_check_takes_one(tmp_path: Path) -> None:
    canary = tmp_path / "canary.py"
    canary.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\ndef f():\n    raise SystemExit\n")
    graph = load_model(f"{FIXTURE}:tiny", seq_len=16).model_copy(update={"name": f"{canary}:f"})
    plan = Plan(stages=(Stage(layers=(0, 5), devices=(0,)),))
    assert "family 'custom'" in (exportable(plan, "torch", graph) or "")
    assert not (tmp_path / "ran").exists()  # the name was not imported
    assert exportable(plan, "torch", load_model(f"{FIXTURE}:tiny", seq_len=16),
                      spec=parse_model_spec(f"{FIXTURE}:tiny")) is None
    two = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), tp=2),))
    reason = exportable(two, "torch", load_model(GPT2, seq_len=16), spec=parse_model_spec(GPT2))
    assert reason is not None and "Conv1D" in reason


def test_a_user_file_travels_with_the_program(tmp_path: Path) -> None:
    plan = Plan(stages=(Stage(layers=(0, 5), devices=(0,)),))
    write_torch_program(f"{FIXTURE}:tiny", plan, tmp_path, seq_len=16, global_batch=2)
    assert (tmp_path / "tiny_lm.py").read_text() == FIXTURE.read_text()
    assert json.loads((tmp_path / "plan.json").read_text())["model"] == "tiny_lm.py:tiny"


def test_scaled_down_hf_spec_keeps_the_class_and_depth() -> None:
    small = scaled_down("hf:LlamaConfig?num_hidden_layers=3&rms_norm_eps=1e-06", heads=4)
    config = model_config(small, seq_len=16)
    assert small.startswith("hf:LlamaConfig?") and "rms_norm_eps=1e-06" in small
    assert (config.family, config.layers, config.hidden, config.vocab) == ("hf", 3, 64, 128)


@pytest.mark.slow
def test_hf_llama_with_tensor_parallelism_and_recompute_verifies() -> None:
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2, recompute=True),
                                         Stage(layers=(2, 4), devices=(2,))))
    report = verify(LLAMA, plan, seq_len=16)
    assert report.passed, report.message


@pytest.mark.slow
def test_a_users_sequential_verifies_with_uneven_stages_and_data_parallelism() -> None:
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), dp=2, batch_samples=(1, 1),
                                               recompute=True), Stage(layers=(2, 5), devices=(2,))))
    report = verify(f"{FIXTURE}:tiny", plan, seq_len=16)
    assert report.passed, report.message
    assert report.model_spec == f"{FIXTURE}:tiny"  # run at the size its factory builds


def _config_json(folder: Path) -> Path:
    path = folder / "hub" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 128,
                                "max_position_embeddings": 64, "tie_word_embeddings": False,
                                "torch_dtype": "bfloat16"}))
    return path


def test_a_config_json_is_the_transformers_class_and_scales_down_to_it(tmp_path: Path) -> None:
    path = _config_json(tmp_path)
    config = model_config(str(path), seq_len=16)
    assert (config.family, config.model_type, config.layers, config.vocab) == ("hf", "llama", 2, 128)
    small = scaled_down(str(path), heads=4)
    assert small.startswith("hf:LlamaConfig?num_hidden_layers=2&tie_word_embeddings=false&")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = build_model(str(path), seq_len=16, seed=3)(tokens)
        torch.testing.assert_close(_chained_logits(str(path), tokens), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_an_exported_config_json_program_trains_from_its_own_folder(tmp_path: Path) -> None:
    path = _config_json(tmp_path)
    run = tmp_path / "run"
    train = write_torch_program(str(path), Plan(stages=(Stage(layers=(0, 4), devices=(0,)),)), run, seq_len=16,
                                global_batch=2, steps=2)
    assert json.loads((run / "plan.json").read_text())["model"] == "config.json"
    (rank,) = launch(train, 1, [], timeout_s=120)
    assert rank.returncode == 0, rank.stderr_tail
    assert [line["step"] for line in rank.lines] == [0, 1] and all(line["loss"] > 0 for line in rank.lines)


def test_rotary_positions_are_built_on_the_inputs_device() -> None:
    # meta stands in for CUDA: a table built on the CPU cannot multiply a tensor on another device
    from tagplan.export.modules import rotate

    x = torch.empty(2, 4, 16, 8, device="meta")
    assert rotate(x).device.type == "meta"
    cpu = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rotate(cpu)[..., 0, :], cpu[..., 0, :])  # position 0 is not rotated
