"""Random models: families, shape ranges, exact rebuilds, and the CNN against torchvision's ResNet-50."""

from __future__ import annotations

import random

import pytest

from tagplan.datasets.models import (
    FAMILY_NAMES,
    TRANSFORMER_FAMILIES,
    CNNShape,
    ModelRecipe,
    build_cnn,
    build_model,
    random_model,
    random_recipe,
)
from tagplan.ir import DType, OpKind


def _recipes(n: int, seed: int = 0) -> list[ModelRecipe]:
    rng = random.Random(seed)
    return [random_recipe(rng) for _ in range(n)]


def test_random_model_covers_every_family_including_the_cnn() -> None:
    rng = random.Random(1)
    families = {random_model(rng)[0] for _ in range(200)}
    assert families == set(FAMILY_NAMES)
    assert "cnn" in families and "cnn" not in TRANSFORMER_FAMILIES


def test_random_model_returns_the_graph_of_its_family() -> None:
    rng = random.Random(2)
    for _ in range(30):
        family, model = random_model(rng)
        assert model.family == family


def test_transformer_shapes_stay_in_range() -> None:
    for recipe in _recipes(300):
        if recipe.family == "cnn":
            continue
        shape = recipe.shape
        hidden, heads = int(shape["hidden"]), int(shape["heads"])
        assert 256 <= hidden <= 8192 and hidden % 128 == 0
        assert hidden % heads == 0 and hidden // heads in (64, 128)
        model = build_model(recipe)
        blocks = len(model.layers) - 2 - (1 if recipe.family == "t5" else 0)  # embedding, head, T5's encoder.final
        assert 2 <= blocks <= 48, (recipe.name, blocks)
        if recipe.family != "vit":
            assert 128 <= recipe.seq_len <= 4096


def test_recipes_rebuild_the_same_graph_after_a_json_round_trip() -> None:
    for recipe in _recipes(40, seed=3):
        again = ModelRecipe.model_validate_json(recipe.to_json())
        assert again == recipe
        model = build_model(again)
        assert model == build_model(recipe)
        assert model.seq_len == recipe.seq_len and model.dtype is recipe.dtype


def test_random_recipe_is_deterministic_for_a_seed() -> None:
    assert _recipes(20, seed=9) == _recipes(20, seed=9)


def test_unknown_family_is_rejected_with_the_known_ones() -> None:
    recipe = ModelRecipe(family="rnn", name="x", seq_len=8, shape={})
    with pytest.raises(ValueError, match="known: gpt"):
        build_model(recipe)


def test_cnn_matches_resnet50_parameter_count() -> None:
    # torchvision.models.resnet50() has 25,557,032 parameters (BatchNorm weight and bias included).
    model = build_cnn("resnet50", CNNShape(blocks=16, width=64, bottleneck=True), DType.FP32)
    assert model.params == 25_557_032
    assert 7.5e9 < model.flops_per_sample < 8.3e9  # about 3.9 GMACs at 224 x 224
    assert len(model.layers) == 18 and model.unique_blocks == 10  # stem, 16 blocks folded to 4 + 4, head
    assert model.seq_len == 56 * 56


def test_cnn_is_built_of_convolutions_not_attention() -> None:
    model = build_cnn("c", CNNShape(blocks=5, width=32, image=32), DType.BF16)
    kinds = {op.kind for block in model.blocks for op in block.ops}
    assert OpKind.CONV in kinds and OpKind.ATTENTION not in kinds
    assert model.block_of(len(model.layers) - 1).kind == "head"
    assert all(block.output_bytes > 0 for block in model.blocks)
