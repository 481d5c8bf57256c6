"""AMP's published runs (bench/data/amp_measured.json) and the plans bench/fidelity_amp.py rebuilds from them."""

from __future__ import annotations

import json
from types import ModuleType

import pytest
from bench_modules import BENCH, load_bench


@pytest.fixture(scope="module")
def amp() -> ModuleType:
    return load_bench("fidelity_amp")


def test_every_transcribed_run_is_a_whole_layout_of_16_gpus_and_batch_32() -> None:
    data = json.loads((BENCH / "data" / "amp_measured.json").read_text())
    measured = {e["name"]: sum(r["measured_s"] is not None for r in e["runs"]) for e in data["experiments"]}
    assert measured == {"homogeneous": 47, "heterogeneous": 43}
    for experiment in data["experiments"]:
        for run in experiment["runs"]:
            assert run["tp"] * run["pp"] * run["dp"] == 16
            assert run["dp"] * run["micro_batch_size"] * run["micro_batches"] == data["global_batch"]
            assert sum(run["transformer_layers_per_stage"]) == 24 and len(run["partition"]) == run["pp"] + 1


def test_a_run_becomes_the_plan_it_ran(amp: ModuleType) -> None:
    run = {"tp": 2, "pp": 4, "dp": 2, "micro_batches": 16, "transformer_layers_per_stage": [7, 6, 6, 5]}
    plan = amp.plan_of(run, 26)  # embedding, 24 blocks, head
    assert [s.layers for s in plan.stages] == [(0, 8), (8, 14), (14, 20), (20, 26)]
    assert [s.devices for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert all((s.tp, s.dp, s.zero) == (2, 2, 0) for s in plan.stages) and plan.micro_batches == 16
    empty = {**run, "transformer_layers_per_stage": [0, 0, 12, 12]}
    assert amp.plan_of(empty, 26) == "a middle stage holds no transformer layer"


def test_every_layout_that_ran_fits_in_the_memory_model_and_most_that_failed_do_not(amp: ModuleType) -> None:
    """The memory model against real T4/V100 runs: a layout that finished cannot have overflowed memory.

    AMP records no cause of failure (some failed at 2-3 GB, of other causes), so not every failure need be refused;
    costed as the runs ran (Megatron-LM's in-place loss, DeepSpeed's pipeline engine keeping its buffers), the
    five predicted above 16 GB are the two at tp 1 x pp 16 with the whole batch in one micro-batch and three whose
    last stage holds two micro-batches' logits. Without the engine's buffers only those two were refused."""
    data = json.loads((BENCH / "data" / "amp_measured.json").read_text())
    model = amp.load_model_of(data)
    verdicts = {e["name"]: amp.fit_verdicts(data, e, model) for e in data["experiments"]}
    assert all(v["ran_predicted_to_fit"] == v["ran"] for v in verdicts.values())
    refused = {(name, r["amp_rank"]) for name, v in verdicts.items() for r in v["failed_runs"] if not r["fits"]}
    assert {("homogeneous", 51), ("heterogeneous", 50)} <= refused and len(refused) >= 5  # of 11

