"""The model SPEC grammar: a pure parse step (no file read, nothing built), then `build_model`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.model_spec import ModelSpecKind, build_model, load_model, parse_model_spec


@pytest.mark.parametrize(
    ("text", "kind", "name", "blocks"),
    [
        ("gpt3-175b", ModelSpecKind.ZOO, "gpt3-175b", 96),
        ("GPT-3-175B", ModelSpecKind.ZOO, "gpt3-175b", 96),  # aliases, any case
        ("t5-3b", ModelSpecKind.ZOO, "t5-3b", 48),  # encoder and decoder blocks
        ("gpt?layers=7&hidden=256&heads=4", ModelSpecKind.FAMILY, "gpt", 7),
        ("t5?layers=3&dec_layers=5", ModelSpecKind.FAMILY, "t5", 8),
        ("hf:LlamaConfig?num_hidden_layers=500", ModelSpecKind.HF, "LlamaConfig", 500),
        ("hf:BertConfig", ModelSpecKind.HF, "BertConfig", None),  # the default depth is the class's
        ("nets/mine.yaml", ModelSpecKind.FILE, "nets/mine.yaml", None),
        ("graph.json", ModelSpecKind.FILE, "graph.json", None),
        ("models/lm.py:TinyLM", ModelSpecKind.MODULE, "models/lm.py", None),
        ("mypkg.models:make_lm", ModelSpecKind.MODULE, "mypkg.models", None),
    ],
)
def test_parse_names_the_kind_without_reading_or_building(text: str, kind: ModelSpecKind, name: str,
                                                          blocks: int | None) -> None:
    spec = parse_model_spec(text)
    assert (spec.kind, spec.name, spec.blocks) == (kind, name, blocks)
    assert spec.names_file == (kind in (ModelSpecKind.FILE, ModelSpecKind.MODULE))


def test_family_spec_carries_its_shape_and_overrides() -> None:
    spec = parse_model_spec("llama?layers=4&hidden=512&heads=8&kv_heads=2")
    assert spec.shape is not None and (spec.shape.layers, spec.shape.kv_heads) == (4, 2)
    assert dict(spec.overrides) == {"layers": "4", "hidden": "512", "heads": "8", "kv_heads": "2"}
    assert spec.default_seq_len == 2048


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("", r"model SPEC is empty"),
        ("gpt3-13", r"unknown model 'gpt3-13'\. Did you mean"),
        ("gpt?layers=5_000", r"layers='5_000': expected a whole number"),
        ("hf:LlamaConfig?num_hidden_layers=500_000", r"num_hidden_layers='500_000' is not accepted"),
        ("hf:Llama Config", r"is not a Hugging Face config class name"),
        ("gpt?" + "layers=2&" * 400, r"over the limit of 2000"),
    ],
)
def test_bad_specs_name_the_value(text: str, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        parse_model_spec(text)


def test_build_matches_load_and_missing_files_are_named() -> None:
    spec = parse_model_spec("gpt?layers=2&hidden=64&heads=4&vocab=100")
    assert build_model(spec, seq_len=32) == load_model(spec.text, seq_len=32)
    with pytest.raises(SpecError, match=r"model file 'nowhere/g\.json' does not exist"):
        build_model(parse_model_spec("nowhere/g.json"))


def test_user_module_factory_with_example_inputs(tmp_path: Path) -> None:
    source = tmp_path / "lm.py"
    source.write_text(
        "import torch\n"
        "from torch import nn\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(32, 32)\n"
        "    def forward(self, x):\n"
        "        return torch.relu(self.fc(x)) + x\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = nn.ModuleList(Block() for _ in range(3))\n"
        "    def forward(self, x):\n"
        "        for layer in self.layers:\n"
        "            x = layer(x)\n"
        "        return x.sum()\n\n"
        "def make():\n"
        "    return Net(), (torch.empty(2, 16, 32),)\n"
    )
    graph = load_model(f"{source}:make")
    assert graph.seq_len == 16
    assert graph.params == 3 * (32 * 32 + 32)
    with pytest.raises(SpecError, match=r"has no class or factory named 'missing'"):
        load_model(f"{source}:missing")
    with pytest.raises(SpecError, match=r"no example inputs"):
        load_model(f"{source}:Net")


def test_a_zoo_model_of_learned_positions_keeps_its_table() -> None:
    """gpt3-1.3b at 8,192 tokens was costed on its 2,048-row table while Megatron would grow it; a gpt?... SPEC
    grows its own table, a zoo model refuses what it cannot hold, as the family refuses max_positions."""
    from tagplan.frontends.model_spec import load_model

    assert load_model("gpt3-1.3b", seq_len=2048).seq_len == 2048
    with pytest.raises(SpecError, match=r"gpt3-1\.3b: seq_len=8192 exceeds its 2048 learned positions; accepted: "
                                        r"at most 2048 \(or gpt\?\.\.\. with max_positions=8192\)"):
        load_model("gpt3-1.3b", seq_len=8192)
    with pytest.raises(SpecError, match="bert-large: seq_len=1024 exceeds its 512 learned positions"):
        load_model("bert-large", seq_len=1024)
    assert load_model("llama2-7b", seq_len=16384).seq_len == 16384  # rotary positions: any length
    assert load_model("gpt?layers=2&hidden=64&heads=4&vocab=100", seq_len=8192).seq_len == 8192  # grows its own
