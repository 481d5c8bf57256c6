"""Fine-tuning on measured iterations: lowers held-out error, registers, never activates a worse model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.datasets.traces.bundle import Bundle, IterationRecord, read_bundle
from tagplan.errors import SpecError
from tagplan.training.iteration_fit import rebuild_record
from tagplan.training.registry import Registry
from tagplan.training.traces import TraceFinetune, finetune_on_traces

BUNDLE = Path(__file__).parents[1] / "fixtures" / "traces" / "cpu-quick"


@pytest.fixture(scope="module")
def measured() -> Bundle:
    bundle = read_bundle(BUNDLE)
    assert len(bundle.iterations()) >= 6, "the committed CPU bundle holds measured iterations"
    return bundle


def test_fine_tuning_on_measured_iterations_lowers_held_out_error(measured: Bundle, tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry")
    card = finetune_on_traces([measured], tmp_path / "run", registry=registry)
    held = card["metrics"]["held_out"]
    assert held["mape_after"] < held["mape_before"]
    assert card["improved"] and card["activated"]
    assert registry.versions() == [card["version"]] and registry.active() == card["version"]
    assert registry.card(card["version"])["data"]["held_out"] == card["data"]["held_out"] >= 1


def test_a_worse_model_is_registered_but_never_activated(measured: Bundle, tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry")
    card = finetune_on_traces([measured], tmp_path / "run", registry=registry,
                              config=TraceFinetune(epochs=3, lr=3.0, anchor=0.0))
    assert not card["improved"] and not card["activated"]
    assert card["version"] in registry.versions() and registry.active() is None  # the packaged default stays


def test_a_record_that_does_not_load_is_named(measured: Bundle) -> None:
    record = measured.iterations()[0]
    bad = IterationRecord.model_validate({**record.model_dump(), "model": "gpt?layers=0"})
    with pytest.raises(SpecError, match="record 7"):
        rebuild_record(bad, "bundle 0 iteration record 7")
    with pytest.raises(SpecError, match="at least 2 iteration records"):
        finetune_on_traces([Bundle(manifest=measured.manifest, records=())], Path("/nonexistent"),
                           registry=Registry(Path("/nonexistent/registry")))


def test_an_iteration_faster_than_the_devices_peak_is_refused(measured: Bundle, tmp_path: Path) -> None:
    # what a service upload holds: records that no `traces import` checked against the model
    records = list(measured.records)
    first = next(i for i, r in enumerate(records) if isinstance(r, IterationRecord))
    records[first] = records[first].model_copy(update={"measured_s": 1e-9})
    forged = Bundle(manifest=measured.manifest, records=tuple(records))
    with pytest.raises(SpecError, match=rf"^trace t1: record {first + 1} of records.jsonl: measured_s 1e-09 s is "
                                        r"shorter"):
        finetune_on_traces([forged], tmp_path / "run", registry=Registry(tmp_path / "registry"), names=["trace t1"])
    assert not (tmp_path / "registry").exists()
