"""Galvatron computation and memory profiles -> layer records on the model's blocks; the simulator uses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tagplan.cli import main
from tagplan.cost.simulator import Simulator
from tagplan.datasets.traces.bundle import LayerRecord, read_bundle
from tagplan.datasets.traces.galvatron import import_galvatron, pair_profiles
from tagplan.datasets.traces.importing import detect_kind, import_to_bundle
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, Workload
from tagplan.training.calibrate import fit_calibration

FIXTURES = Path(__file__).parent / "fixtures" / "galvatron"
COMPUTATION = FIXTURES / "computation_profiling_bf16_gpt-1024.json"
MEMORY = FIXTURES / "memory_profiling_bf16_gpt-1024.json"
MODEL = "gpt?layers=4&hidden=1024&heads=16&vocab=8192"
MIB = 2**20


def _write(path: Path, data: dict[str, object]) -> Path:
    path.write_text(json.dumps(data))
    return path


def _import(path: Path, **kw: object) -> list[LayerRecord]:
    return import_galvatron(path, model=kw.pop("model", MODEL), device="H100-SXM", **kw)  # type: ignore[arg-type]


def test_layer_type_times_become_micro_batch_seconds_with_activation_bytes() -> None:
    assert detect_kind(COMPUTATION) == "galvatron" and detect_kind(MEMORY) == "galvatron"
    assert pair_profiles([MEMORY, COMPUTATION]) == [(COMPUTATION, MEMORY)]
    records = _import(COMPUTATION, memory=MEMORY)
    block = load_model(MODEL, seq_len=1024).blocks[1]
    assert block.kind == "block" and {r.block_hash for r in records} == {block.hash}
    one, four = records  # layertype_other, layernum[..] and the memory profile's other_memory_* are not blocks
    # 2.0 ms forward per sample at bsz 1; 1.8 ms per sample at bsz 4 -> 7.2 ms for the micro-batch of 4
    assert (one.micro_batch, one.tp, one.seq_len, one.dtype.value) == (1, 1, 1024, "bf16")
    assert one.forward_s == pytest.approx(0.002) and one.backward_s == pytest.approx(0.004)
    assert four.micro_batch == 4
    assert four.forward_s == pytest.approx(0.0072) and four.backward_s == pytest.approx(0.0144)
    # tp_activation_per_bsz_dict["1"] = 48 MB per sample
    assert one.activation_bytes == pytest.approx(48 * MIB) and four.activation_bytes == pytest.approx(4 * 48 * MIB)
    assert one.peak_bytes is None and one.block_name == "layertype_0"
    assert "backward = 2 x forward" in one.source and "dtype from the file name" in one.source
    assert _import(COMPUTATION)[0].activation_bytes is None  # without the memory profile


def test_layer_types_map_onto_the_repeated_blocks_in_order(tmp_path: Path) -> None:
    # T5 as Galvatron numbers it: layer type 0 the encoder layers, 1 the decoder layers
    path = _write(tmp_path / "computation_profiling_fp16_t5.json",
                  {"layertype_0_bsz2_seq512": 1.5, "layertype_1_bsz2_seq512": 2.5})
    encoder, decoder = _import(path, model="t5")
    kinds = {b.hash: b.kind for b in load_model("t5", seq_len=512, dtype=DType.FP16).blocks}
    assert (kinds[encoder.block_hash], kinds[decoder.block_hash]) == ("encoder", "decoder")
    assert decoder.forward_s == pytest.approx(0.005) and decoder.dtype.value == "fp16"
    with pytest.raises(SpecError, match=r"layer types 0, 1 do not match the 1 repeated block\(s\)"):
        _import(path)


def test_bad_profiles_are_refused_naming_the_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="memory profile holds no times"):
        _import(MEMORY)
    with pytest.raises(SpecError, match="memory profile holds no times"):
        import_to_bundle([MEMORY], tmp_path / "b", device="H100-SXM", source="test", model=MODEL)
    assert not (tmp_path / "b").exists()
    negative = _write(tmp_path / "computation_profiling_bf16_x.json", {"layertype_0_bsz1_seq1024": -0.5})
    with pytest.raises(SpecError, match=r"layertype_0_bsz1_seq1024 -0\.5 is not a positive number of milliseconds"):
        _import(negative)
    unknown = _write(tmp_path / "computation_profiling_bf16_y.json",
                     {"layertype_0_bsz1_seq1024": 2.0, "layertype_0_batch1": 2.0})
    with pytest.raises(SpecError, match="key 'layertype_0_batch1' is not one of a Galvatron computation profile's"):
        _import(unknown)
    parts = _write(tmp_path / "computation_profiling_bf16_moe.json",
                   {"layernum[2]_bsz1_seq4096_mlp": 22.5, "layertype_0_bsz1_seq4096_mlp": 6.7})
    with pytest.raises(SpecError, match="only per-unit figures"):
        _import(parts)
    with pytest.raises(SpecError, match="the file name says dtype bf16, --dtype says fp16"):
        _import(COMPUTATION, dtype="fp16")
    memory = _write(tmp_path / "memory_profiling_bf16_gpt-1024.json",
                    {"layertype_0": {"1024": {"parameter_size": 48.0, "tp_activation_per_bsz_dict": {"1": -3.0}}}})
    with pytest.raises(SpecError, match=r"layertype_0.1024.tp_activation_per_bsz_dict\['1'\] -3.0 is not a number"):
        _import(COMPUTATION, memory=memory)


def test_a_memory_profile_of_another_model_size_warns(tmp_path: Path) -> None:
    warnings: list[str] = []
    import_to_bundle([COMPUTATION, MEMORY], tmp_path / "b", device="H100-SXM", source="test", warn=warnings.append,
                     model="gpt?layers=4&hidden=768&heads=12&vocab=8192")
    assert any("layertype_0.1024.parameter_size is 48.0508 MB" in w for w in warnings)


def test_cli_import_writes_a_bundle_the_simulator_uses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "galvatron"
    assert main(["traces", "import", str(COMPUTATION), str(MEMORY), "--format", "galvatron", "--model", MODEL,
                 "--device", "H100-SXM", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layer_records"] == 2
    calibration = fit_calibration([read_bundle(out)]).calibration
    model = load_model(MODEL, seq_len=1024)
    cluster = load_cluster("dgx-h100:nodes=1")
    sim = Simulator(model, cluster, Workload(global_batch=2, seq_len=1024), calibration=calibration)
    stage = sim.simulate(Plan(stages=(Stage(layers=(0, 6), devices=(0,)),), micro_batches=1)).stages[0]
    assert stage.compute_source == "block: layer profile (interpolated); embedding: ops; head: ops"
    # tp 2 was not profiled (Galvatron times tp 1): the op model, said so
    tp2 = sim.simulate(Plan(stages=(Stage(layers=(0, 6), devices=(0, 1), tp=2),), micro_batches=1)).stages[0]
    assert "block: ops (tp 2 outside the profiled degrees [1])" in tp2.compute_source
