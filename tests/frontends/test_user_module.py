"""User modules: factories and classes, block folding, two towers as layer inputs, input shapes, errors."""

import time
from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.model_spec import load_model, parse_model_spec
from tagplan.frontends.user_module import graph_from_user_module, parse_input_shape
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType

MODELS = Path(__file__).parent / "fixtures" / "user_models"
DEEP, TOWERS = str(MODELS / "deep_lm.py"), str(MODELS / "two_tower.py")


def build(module: str, attr: str, **kwargs: object) -> ModelGraph:
    return graph_from_user_module(module, attr, seq_len=None, dtype=DType.BF16, **kwargs)  # type: ignore[arg-type]


def test_folding_equals_the_full_trace() -> None:
    folded, full = build(DEEP, "TinyLM"), build(DEEP, "TinyLM", fold=False)
    assert folded.model_dump() == full.model_dump()
    assert [layer.name for layer in folded.layers] == ["embed", *(f"blocks.{i}" for i in range(6)), "head"]
    assert len({layer.block for layer in folded.layers[1:-1]}) == 1  # the caller's residual add joins each block
    assert folded.seq_len == 64


def test_a_24_block_factory_model_builds_folded_in_seconds() -> None:
    build(DEEP, "TinyLM")  # warm-up: torch.export's first call
    start = time.perf_counter()
    g = load_model(f"{DEEP}:make_lm")
    elapsed = time.perf_counter() - start
    assert len(g.layers) == 26 and g.unique_blocks == 3 and g.seq_len == 128
    assert elapsed < 20  # ~1 s folded vs ~5 s traced in full on a shared 2-core machine; a 10x loose bound


def test_two_towers_stay_two_towers_without_empty_layers() -> None:
    g = build(TOWERS, "TwoTower")
    names = [layer.name for layer in g.layers]
    doc_proj, query_norm = names.index("doc.proj"), names.index("query.norm")
    assert g.layers[doc_proj].inputs == ()  # the document tower reads only the model inputs
    assert g.layers[-1].inputs == (query_norm, len(names) - 2)  # the score reads both towers
    assert all(f"query.blocks.{i}" in names and f"doc.blocks.{i}" in names for i in range(10))
    assert all(g.block_of(i).params > 0 for i in range(len(names)))  # no empty layers
    assert len(names) == 24
    assert g.model_dump() == build(TOWERS, "TwoTower", fold=False).model_dump()


def test_input_shape_replaces_the_example_inputs() -> None:
    g = build(DEEP, "TinyLM", input_shape="4x32:long")
    assert g.seq_len == 32
    assert parse_input_shape("8,3,224,224")[0] == (8, 3, 224, 224)
    with pytest.raises(SpecError, match="input shape '8x0'"):
        parse_input_shape("8x0")


def test_a_python_file_without_a_name_says_to_add_one() -> None:
    with pytest.raises(SpecError, match=r"add ':Name'.*mymodel\.py:MyModel"):
        parse_model_spec("models/mymodel.py")


def test_missing_names_and_inputs_are_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no class or factory named 'Nope'"):
        build(DEEP, "Nope")
    bare = tmp_path / "bare.py"
    bare.write_text("from torch import nn\n\nclass Bare(nn.Linear):\n    def __init__(self):\n"
                    "        super().__init__(4, 4)\n")
    with pytest.raises(SpecError, match="--input-shape"):
        build(str(bare), "Bare")
    assert build(str(bare), "Bare", input_shape="2x4").params == 20
