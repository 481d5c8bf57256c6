"""User modules: factories and classes, block folding, two towers as layer inputs, input shapes, errors."""

import logging
import re
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
    at_32 = load_model(f"{DEEP}:TinyLM", seq_len=32, input_shape="4x32:long")
    assert at_32.seq_len == 32
    # a --seq other than the example's is traced at that length: a label alone had costed the 64-token trace
    long, own = load_model(f"{DEEP}:TinyLM", seq_len=256), build(DEEP, "TinyLM")
    assert long.seq_len == 256 and own.seq_len == 64
    flops = lambda g: sum(op.flops for op in g.block_of(1).ops)  # noqa: E731
    assert flops(long) > 3.9 * flops(own)  # at least linear in the tokens
    with pytest.raises(SpecError, match=r"seq_len=128, but --input-shape 4x32:long gives 32 tokens"):
        load_model(f"{DEEP}:TinyLM", seq_len=128, input_shape="4x32:long")
    with pytest.raises(SpecError, match=r"seq_len=8 cannot be set on 2 input tensor\(s\)"):
        load_model(f"{TOWERS}:TwoTower", seq_len=8)
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


FACTORIES = """
import torch
from torch import nn


def needs_arg(x):
    return nn.Linear(4, 4)


def needs_two(x, *, y, z=1, **rest):
    return nn.Linear(4, 4)


def raises():
    raise RuntimeError("no config found")


class NeedsWidth(nn.Linear):
    def __init__(self, width):
        super().__init__(width, width)


class Mismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))

    def example_inputs(self):
        return torch.zeros(2, 4)
"""


def test_factories_that_need_arguments_or_raise_are_one_line_spec_errors(tmp_path: Path) -> None:
    mod = tmp_path / "mymod.py"
    mod.write_text(FACTORIES)
    spec, where = str(mod), re.escape(str(mod))
    with pytest.raises(SpecError, match=rf"^model '{where}:needs_arg': the factory needs_arg\(\) takes a required "
                       r"argument 'x'; a factory is called with no arguments \(docs/MODELS\.md\)$"):
        build(spec, "needs_arg")
    with pytest.raises(SpecError, match=r"needs_two\(\) takes required arguments 'x', 'y'; a factory"):
        build(spec, "needs_two")
    with pytest.raises(SpecError, match=r"the class NeedsWidth takes a required argument 'width'; a class is called"):
        build(spec, "NeedsWidth")
    with pytest.raises(SpecError, match=rf"^model '{where}:raises': the factory raised RuntimeError: no config found$"):
        build(spec, "raises")


def test_a_module_that_raises_on_import_is_a_spec_error(tmp_path: Path) -> None:
    mod = tmp_path / "broken.py"
    mod.write_text("raise ImportError('needs a GPU build')\n")
    with pytest.raises(SpecError, match=r"broken\.py': importing it raised ImportError: needs a GPU build$"):
        build(str(mod), "Model")


def test_a_shape_mismatch_is_a_clean_error_without_torch_log_lines(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    mod = tmp_path / "mymod.py"
    mod.write_text(FACTORIES)
    with pytest.raises(SpecError, match=r"torch\.export failed: RuntimeError: .*same reduction dim"):
        build(str(mod), "Mismatch")
    assert "fake_tensor" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    assert logging.getLogger("torch._subclasses.fake_tensor").level != logging.CRITICAL  # restored
