import json
from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.model_spec import load_model

EXAMPLE = Path(__file__).parents[2] / "docs" / "examples" / "resnet_like.json"


def test_documented_example_loads_and_folds() -> None:
    g = load_model(str(EXAMPLE))
    assert g.name == "resnet-like"
    assert [layer.name for layer in g.layers][:3] == ["stem", "res.0", "res.1"]
    assert len(g.layers) == 1 + 16 + 1
    assert g.unique_blocks == 3
    assert g.params == sum(g.block_of(i).params for i in range(len(g.layers)))


def test_written_model_graph_reloads(tmp_path: Path) -> None:
    g = load_model("llama?layers=2&hidden=64&heads=4&vocab=50", seq_len=8)
    path = tmp_path / "g.json"
    path.write_text(g.to_json())
    assert load_model(str(path)) == g


def test_errors_name_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "name": "x",\n  "blocks": {,\n}')
    with pytest.raises(SpecError, match="malformed JSON at line 3"):
        load_model(str(bad))
    data = json.loads(EXAMPLE.read_text())
    data["blocks"]["stem"]["ops"][0]["flops"] = -5
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(data))
    message = r"blocks.stem.ops\[0\]: invalid\n  flops: .*greater than or equal to 0 \(got -5\)"
    with pytest.raises(SpecError, match=message):
        load_model(str(wrong))
    data = json.loads(EXAMPLE.read_text())
    data["layers"][1]["block"] = "nope"
    wrong.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"layers\[1\].block 'nope' is not one of the blocks"):
        load_model(str(wrong))
    yaml_bad = tmp_path / "bad.yaml"
    yaml_bad.write_text("name: x\nblocks:\n  a: [1, 2\n")
    with pytest.raises(SpecError, match="malformed YAML at line"):
        load_model(str(yaml_bad))
    with pytest.raises(SpecError, match="does not exist"):
        load_model(str(tmp_path / "missing.json"))


def test_block_hashes_leave_out_the_derived_score_elements(tmp_path: Path) -> None:
    """Stored layer profiles name blocks by hash: a field derived from shapes must not move them."""
    data = json.loads(EXAMPLE.read_text())
    data["blocks"]["stem"]["ops"][0]["score_elements"] = 1e6
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(data))
    with_scores, plain = load_model(str(path)), load_model(str(EXAMPLE))
    assert with_scores.block_of(0).ops[0].score_elements == 1e6
    assert [b.hash for b in with_scores.blocks] == [b.hash for b in plain.blocks]
