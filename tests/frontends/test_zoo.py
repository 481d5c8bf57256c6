import pytest

from tagplan.errors import SpecError
from tagplan.frontends.zoo import ZOO, build_zoo, resolve_zoo_name


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_parameter_counts_match_published_sizes(name: str) -> None:
    entry = ZOO[name]
    graph = build_zoo(name)
    tolerance = 0.01 if entry.exact else 0.02
    assert graph.params == pytest.approx(entry.published_params, rel=tolerance)


def test_headline_counts() -> None:
    assert build_zoo("gpt3-175b").params == pytest.approx(174.6e9, rel=0.001)
    assert build_zoo("llama2-7b").params == pytest.approx(6.74e9, rel=0.001)
    mixtral = build_zoo("mixtral-8x7b")
    assert mixtral.params == pytest.approx(46.7e9, rel=0.005)


def test_mixtral_flops_follow_active_not_total_parameters() -> None:
    """Forward FLOPs per token are about 2 x active params (12.9B), not 2 x 46.7B."""
    g = build_zoo("mixtral-8x7b", seq_len=128)  # short sequence: attention's s^2 term negligible
    per_token = g.flops_per_sample / g.seq_len
    assert per_token == pytest.approx(2 * 12.9e9, rel=0.05)


def test_zoo_respects_sequence_length_and_folds() -> None:
    short, long = build_zoo("llama2-7b", seq_len=1024), build_zoo("llama2-7b", seq_len=4096)
    assert short.params == long.params
    assert long.flops_per_sample > 4 * short.flops_per_sample  # linear in s, plus the s^2 attention term
    assert short.unique_blocks == 3 and len(short.layers) == 34
    assert build_zoo("vit-h-14", seq_len=999).seq_len == 257  # ViT's length comes from the image


def test_unknown_name_suggests_the_nearest() -> None:
    with pytest.raises(SpecError, match=r"Did you mean 'llama2-7b'"):
        build_zoo("llama2-7bb")
    assert resolve_zoo_name("Llama-2-7B") == "llama2-7b"
    assert resolve_zoo_name("ViT-H/14") == "vit-h-14"
