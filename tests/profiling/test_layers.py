"""`profile --layers`: real blocks timed over micro-batch sizes and tp degrees, keyed by the model's block hashes."""

from __future__ import annotations

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.model_spec import load_model
from tagplan.ir.workload import DType
from tagplan.profiling.layers import layer_records

SPEC = "gpt?layers=2&hidden=64&heads=2&vocab=256"


def test_every_unique_block_is_timed_per_tp_and_micro_batch() -> None:
    records = list(layer_records(SPEC, device="cpu", device_type="cpu-test", seq_len=16, micro_batches=(1, 2),
                                 tps=(1, 2), repeats=1))
    model = load_model(SPEC, seq_len=16, dtype=DType.FP32)
    assert {r.block_hash for r in records} == {b.hash for b in model.blocks}
    assert len(records) == 3 * 2 * 2
    assert all(r.forward_s > 0 and r.backward_s > 0 and r.device == "cpu-test" for r in records)


def test_only_gpt_specs_are_built() -> None:
    with pytest.raises(SpecError, match="only gpt-family"):
        list(layer_records("llama?layers=2", device="cpu", device_type="cpu"))
