"""`profile --layers`: real blocks timed over micro-batch sizes and tp degrees, keyed by the model's block hashes."""

from __future__ import annotations

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.model_spec import load_model
from tagplan.ir.workload import DType
from tagplan.profiling.layers import _module, layer_records, profiled_shape

SPEC = "gpt?layers=2&hidden=64&heads=2&vocab=256"


def test_every_unique_block_is_timed_per_tp_and_micro_batch() -> None:
    records = list(layer_records(SPEC, device="cpu", device_type="cpu-test", seq_len=16, micro_batches=(1, 2),
                                 tps=(1, 2), repeats=1))
    model = load_model(SPEC, seq_len=16, dtype=DType.FP32)
    assert {r.block_hash for r in records} == {b.hash for b in model.blocks}
    assert len(records) == 3 * 2 * 2
    assert all(r.forward_s > 0 and r.backward_s > 0 and r.device == "cpu-test" for r in records)


LLAMA = "llama?layers=2&hidden=64&heads=4&kv_heads=2&vocab=256"


def test_llama_blocks_are_timed_where_tp_splits_their_key_value_heads() -> None:
    """kv_heads=2: tp 1 and 2 split every head group, tp 4 does not and is skipped."""
    records = list(layer_records(LLAMA, device="cpu", device_type="cpu-test", seq_len=16, micro_batches=(1, 2),
                                 tps=(1, 2, 4), repeats=1))
    model = load_model(LLAMA, seq_len=16, dtype=DType.FP32)
    assert {r.block_hash for r in records} == {b.hash for b in model.blocks}
    assert {r.tp for r in records} == {1, 2} and len(records) == 3 * 2 * 2
    assert all(r.forward_s > 0 and r.backward_s > 0 for r in records)


def test_the_timed_llama_modules_hold_the_analytic_blocks_parameters() -> None:
    """Embedding, block (RMSNorms, GQA projections, SwiGLU) and head: the same parameter counts as
    the analytic model's blocks at tp 1, and the per-device share of the projections at tp 2."""
    family, shape = profiled_shape(LLAMA)
    model = load_model(LLAMA, seq_len=16, dtype=DType.FP32)
    for block in model.blocks:
        assert sum(p.numel() for p in _module(family, block.kind, shape, 16, 1).parameters()) == block.params
    block = next(b for b in model.blocks if b.kind == "block")
    norms = 2 * shape.hidden  # replicated in a tp group; every projection is split
    half = sum(p.numel() for p in _module(family, "block", shape, 16, 2).parameters())
    assert half == (block.params - norms) // 2 + norms


def test_the_timed_gpt_block_holds_the_analytic_blocks_parameters() -> None:
    """The transformer block, at tp 1 and as one device's share at tp 2. (GPT's embedding and head
    differ by design: the timed embedding holds positions for the profiled sequence only, and the
    timed head its own copy of the tied table, the same work as the analytic blocks.)"""
    family, shape = profiled_shape(SPEC)
    block = next(b for b in load_model(SPEC, seq_len=16, dtype=DType.FP32).blocks if b.kind == "block")
    assert sum(p.numel() for p in _module(family, "block", shape, 16, 1).parameters()) == block.params
    norms, biases_replicated = 4 * shape.hidden, 2 * shape.hidden  # two LayerNorms; proj and out biases
    half = sum(p.numel() for p in _module(family, "block", shape, 16, 2).parameters())
    assert half == (block.params - norms - biases_replicated) // 2 + norms + biases_replicated


@pytest.mark.parametrize("option", ["ffn=128", "kv_heads=1", "head_dim=16"])
def test_a_gpt_spec_the_profiled_block_does_not_build_is_refused(option: str) -> None:
    """The GPT block timed here has 4 x hidden MLP and full multi-head attention: another width
    would be timed as a different block and filed under the SPEC's block hash."""
    with pytest.raises(SpecError, match=f"{option.split('=')[0]}=.* but the profiled GPT block has"):
        profiled_shape(f"{SPEC}&{option}")


def test_a_grid_no_degree_of_which_splits_the_mlp_says_so() -> None:
    with pytest.raises(SpecError, match=r"--tps.*MLP width 102"):
        list(layer_records("llama?layers=2&hidden=64&heads=4&vocab=256&ffn=102", device="cpu", device_type="cpu",
                           seq_len=16, tps=(4,)))


def test_other_families_are_refused_by_name() -> None:
    with pytest.raises(SpecError, match="only gpt and llama-family"):
        list(layer_records("t5?layers=2", device="cpu", device_type="cpu"))


@pytest.mark.parametrize(("field", "kwargs"), [("micro_batches", {"micro_batches": (0,)}), ("tps", {"tps": (0, 1)}),
                                               ("tps", {"tps": ()}), ("tps", {"tps": (3,)})])
def test_bad_grids_are_refused_naming_the_field(field: str, kwargs: dict[str, tuple[int, ...]]) -> None:
    """A zero or empty grid, or tp degrees none of which split the heads (4 and 2 key/value heads
    here), is refused before anything is timed, not divided by zero or answered with no records."""
    with pytest.raises(SpecError, match=field):
        list(layer_records(LLAMA, device="cpu", device_type="cpu", seq_len=16, **kwargs))  # type: ignore[arg-type]
