"""Grouping ops into layers: keys, runs, merging of empty layers, names and edges."""

from torch import fx

from tagplan.frontends.tracing.layers import (
    Group,
    group_ops,
    layer_inputs,
    layer_key,
    merge_empty,
    name_groups,
    short_names,
)
from tagplan.frontends.tracing.nodes import OpNode
from tagplan.ir.model import OpKind


def op(*stack: str, flops: float = 1.0, owned: tuple[str, ...] = (), kind: OpKind = OpKind.ELEMENTWISE) -> OpNode:
    """A fake op at module path `stack[-1]` (stack outermost first)."""
    return OpNode(node=fx.Graph().placeholder("x"), kind=kind, opname="add", target="add",
                  path=stack[-1] if stack else "", stack=("", *stack), flops=flops, inputs=[], outputs=[],
                  owned=list(owned))  # fmt: skip


def test_layer_key_is_the_outermost_indexed_path_or_the_top_child() -> None:
    stack = ("", "model", "model.layers.3", "model.layers.3.mlp", "model.layers.3.mlp.experts.0")
    assert layer_key(stack, indexed=True) == "model.layers.3"
    assert layer_key(("", "model", "model.norm"), indexed=True) is None
    assert layer_key(("", "emb"), indexed=False) == "emb"
    assert layer_key(("",), indexed=False) is None


def test_short_names_drop_the_common_stem() -> None:
    assert short_names(["transformer.h.0", "transformer.h.1"]) == {"transformer.h.0": "h.0", "transformer.h.1": "h.1"}
    assert short_names(["model.layers.3"]) == {"model.layers.3": "layers.3"}
    assert short_names(["0", "1"]) == {"0": "0", "1": "1"}


def test_unkeyed_ops_inside_a_layer_join_it() -> None:
    ops = [op("h.0"), op(), op("h.0"), op("h.1"), op()]
    groups = group_ops(ops)
    assert [(g.key, len(g.ops)) for g in groups] == [("h.0", 3), ("h.1", 1), (None, 1)]
    assert [o.key for o in ops] == ["h.0", None, "h.0", "h.1", None]


def test_empty_layers_merge_into_the_next_or_at_the_end_the_previous() -> None:
    a, empty, b, tail = op("x.0"), op("x.1", flops=0), op("x.2"), op(flops=0)
    merged = merge_empty([Group("x.0", [a]), Group("x.1", [empty]), Group("x.2", [b]), Group(None, [tail])])
    assert [(g.key, g.ops) for g in merged] == [("x.0", [a]), ("x.2", [empty, b, tail])]
    assert [(g.key, g.ops) for g in merge_empty([Group("y", [empty])])] == [(None, [empty])]


def test_layers_are_named_by_position_and_content() -> None:
    emb = op("wte", owned=("wte.weight",), kind=OpKind.EMBEDDING)
    groups = [
        Group(None, [emb]), Group("h.0", [op("h.0")]), Group(None, [op("proj", owned=("proj.weight",))]),
        Group("h.1", [op("h.1")]), Group(None, [op("ln", owned=("ln.weight",))]),
    ]  # fmt: skip
    named = name_groups(groups)
    assert [(g.name, g.kind) for g in named] == [
        ("embed", "embedding"), ("h.0", "block"), ("proj", "other"), ("h.1", "block"), ("head", "head"),
    ]  # fmt: skip


def test_unparameterised_ends_are_pre_and_post_and_repeats_are_numbered() -> None:
    groups = [Group(None, [op()]), Group("b.0", [op("b.0")]), Group(None, [op()]), Group("b.1", [op("b.1")]),
              Group(None, [op()]), Group("b.2", [op("b.2")]), Group(None, [op()])]  # fmt: skip
    assert [g.name for g in name_groups(groups)] == ["pre", "b.0", "mid", "b.1", "mid#2", "b.2", "post"]
    assert [g.name for g in name_groups([Group(None, [op()])])] == ["model"]


def test_layer_inputs_is_none_for_the_previous_layer() -> None:
    assert layer_inputs(0, []) is None
    assert layer_inputs(3, [2]) is None
    assert layer_inputs(3, [0, 2]) == (0, 2)
    assert layer_inputs(1, []) == ()
