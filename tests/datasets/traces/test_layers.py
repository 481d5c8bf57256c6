"""Layer tables: the generic CSV form mapped onto a model's blocks; the simulator uses the records."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.cost.simulator import Simulator
from tagplan.datasets.traces.bundle import read_bundle
from tagplan.datasets.traces.importing import detect_kind, import_to_bundle
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import Workload
from tagplan.training.calibrate import fit_calibration

FIXTURE = Path(__file__).parent / "fixtures" / "layers.csv"
MODEL = "gpt?layers=4&hidden=1024&heads=16&vocab=8192"


def test_layer_table_maps_rows_onto_blocks_and_the_simulator_uses_them(tmp_path: Path) -> None:
    assert detect_kind(FIXTURE) == "layers"
    out = import_to_bundle([FIXTURE], tmp_path / "b", device="H100-SXM", source="test", model=MODEL)
    layers = read_bundle(out).layers()
    model = load_model(MODEL, seq_len=1024)
    kinds = {b.hash: b.kind for b in model.blocks}
    assert [kinds[r.block_hash] for r in layers] == ["block"] * 4 + ["embedding", "head"]
    calibration = fit_calibration([read_bundle(out)]).calibration
    cluster = load_cluster("dgx-h100:nodes=1")
    sim = Simulator(model, cluster, Workload(global_batch=2, seq_len=1024), calibration=calibration)
    plan = Plan(stages=(Stage(layers=(0, 6), devices=(0,)),), micro_batches=1)
    stage = sim.simulate(plan).stages[0]
    # micro-batch 2 interpolates the profiled 1 and 4; embedding and head were profiled at 1 only
    assert "block: layer profile (interpolated)" in stage.compute_source
    assert "head: ops (micro-batch 2 outside the profiled sizes 1-1)" in stage.compute_source
    block_s = 0.0020 + (0.0072 - 0.0020) / 3
    assert stage.forward_s > 4 * block_s
    default = Simulator(model, cluster, Workload(global_batch=2, seq_len=1024)).simulate(plan).stages[0]
    assert default.compute_source == "block: ops; embedding: ops; head: ops"


def test_a_layer_table_without_its_model_or_with_an_unknown_layer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="--model"):
        import_to_bundle([FIXTURE], tmp_path / "b", device="H100-SXM", source="test")
    bad = tmp_path / "bad.csv"
    bad.write_text("layer,micro_batch,seq_len,forward_s,backward_s\nrouter,1,1024,0.1,0.2\n")
    with pytest.raises(SpecError, match=r"bad.csv:2: layer 'router' matches no block"):
        import_to_bundle([bad], tmp_path / "c", device="H100-SXM", source="test", model=MODEL)
    assert not (tmp_path / "c").exists()
