"""Metis profiles (DeviceType.X_tpT_bsB.json) -> layer records on the model's blocks; the simulator uses them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tagplan.cli import main
from tagplan.cost.simulator import Simulator
from tagplan.datasets.traces.bundle import LayerRecord, read_bundle
from tagplan.datasets.traces.importing import detect_kind, import_file, import_to_bundle
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import Workload
from tagplan.training.calibrate import fit_calibration

FIXTURES = Path(__file__).parent / "fixtures" / "metis"
TP1_BS1, TP1_BS4, TP2_BS1 = (FIXTURES / f"DeviceType.H100_{n}.json" for n in ("tp1_bs1", "tp1_bs4", "tp2_bs1"))
MODEL = "gpt?layers=4&hidden=1024&heads=16&vocab=8192"
MIB = 2**20


def _records(path: Path, **kw: object) -> list[LayerRecord]:
    kind, records = import_file(path, device="H100-SXM", model=MODEL, seq_len=1024, **kw)  # type: ignore[arg-type]
    assert kind == "metis"
    return [r for r in records if isinstance(r, LayerRecord)]


def _by_kind(records: list[LayerRecord]) -> dict[str, LayerRecord]:
    kinds = {b.hash: b.kind for b in load_model(MODEL, seq_len=1024).blocks}
    return {kinds[r.block_hash]: r for r in records}


def _write(path: Path, data: dict[str, object]) -> Path:
    path.write_text(json.dumps(data))
    return path


def _profile(times: list[float], memory: list[float] | None = None, **model: object) -> dict[str, object]:
    data: dict[str, object] = {"model": {"model_name": "GPT", **model},
                               "execution_time": {"total_time_ms": sum(times) + 3, "layer_compute_total_ms": times}}
    if memory is not None:
        data["execution_memory"] = {"layer_memory_total_mb": memory}
    return data


def test_each_layer_maps_onto_its_block_with_ms_split_into_seconds_and_mb_into_bytes() -> None:
    assert detect_kind(TP1_BS1) == "metis"
    records = _records(TP1_BS1)
    assert len(records) == 3  # the 6 Metis layers are 3 distinct blocks: embedding, 4 x block, head
    by_kind = _by_kind(records)
    block = by_kind["block"]
    # layer_compute_total_ms 6.0 is forward + backward: forward = 6.0 / 3 ms, backward = 2 x forward
    assert block.forward_s == pytest.approx(0.002) and block.backward_s == pytest.approx(0.004)
    assert block.peak_bytes == pytest.approx(610.5 * MIB) and block.activation_bytes is None
    assert (block.tp, block.micro_batch, block.seq_len, block.dtype.value) == (1, 1, 1024, "bf16")
    assert block.repeats == 4 and block.block_name == "metis layer[1-4]" and block.model == MODEL
    assert "forward = total / 3, backward = 2 x forward" in block.source and "bf16 assumed" in block.source
    assert by_kind["embedding"].forward_s == pytest.approx(0.0001) and by_kind["head"].backward_s == pytest.approx(
        0.0018)
    assert by_kind["head"].peak_bytes == pytest.approx(900.0 * MIB)
    big = _by_kind(_records(TP1_BS4))["block"]
    assert big.micro_batch == 4 and big.forward_s == pytest.approx(0.0072) and big.backward_s == pytest.approx(0.0144)
    assert _records(TP1_BS1, dtype="fp16")[0].dtype.value == "fp16"


def test_a_memory_list_of_the_wrong_length_is_left_out_and_tp_communication_is_stated() -> None:
    block = _by_kind(_records(TP2_BS1))["block"]
    assert block.tp == 2 and block.forward_s == pytest.approx(0.0012)
    assert block.peak_bytes is None
    assert "memory not imported: execution_memory.layer_memory_total_mb has 5 entries for 6 layers" in block.source
    assert "tensor-parallel communication" in block.source


def test_a_profile_of_more_layers_maps_first_middle_and_last_and_takes_the_median(tmp_path: Path) -> None:
    # as Metis's own samples: 10 layers (embedding, 8 decoders, head) of a model tagplan builds with 4 decoders
    times = [0.3, 6.0, 6.2, 5.9, 6.1, 6.0, 9.0, 6.0, 6.0, 2.7]
    path = _write(tmp_path / "DeviceType.A100_tp1_bs2.json", _profile(times, [100.0] * 10, num_layers=10))
    by_kind = _by_kind(_records(path))
    assert by_kind["block"].forward_s == pytest.approx(0.002) and by_kind["block"].repeats == 8
    assert by_kind["block"].micro_batch == 2 and by_kind["block"].block_name == "metis layer[1-8]"
    assert by_kind["head"].forward_s == pytest.approx(0.0009)


def test_bad_profiles_are_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="pass --seq"):
        import_file(TP1_BS1, device="H100-SXM", model=MODEL)
    with pytest.raises(SpecError, match="pass --model"):
        import_file(TP1_BS1, device="H100-SXM", seq_len=1024)
    renamed = shutil.copy(TP1_BS1, tmp_path / "h100.json")
    with pytest.raises(SpecError, match=r"h100.json: a Metis profile is named DeviceType.\{device\}_tp\{tp\}_bs\{bs\}"):
        _records(Path(renamed))
    negative = _write(tmp_path / "DeviceType.A100_tp1_bs1.json", _profile([0.3, -6.0, 6.0, 6.0, 6.0, 2.7]))
    with pytest.raises(SpecError, match=r"execution_time.layer_compute_total_ms\[1\] -6.0 is not a positive number"):
        _records(negative)
    counted = _write(tmp_path / "DeviceType.A100_tp1_bs2.json", _profile([0.3, 6.0, 6.0, 6.0, 6.0, 2.7], num_layers=8))
    with pytest.raises(SpecError, match=r"model\.num_layers 8 is not the 6 layers"):
        _records(counted)
    short = _write(tmp_path / "DeviceType.A100_tp1_bs4.json", _profile([0.3, 6.0]))
    with pytest.raises(SpecError, match=r"layer_compute_total_ms has 2 layers and .* has 6"):
        _records(short)
    missing = _write(tmp_path / "DeviceType.A100_tp2_bs4.json", {"model": {}, "execution_time": {"total_time_ms": 3}})
    with pytest.raises(SpecError, match=r"execution_time\.layer_compute_total_ms None is not a list"):
        _records(missing)


def test_a_profile_of_another_model_size_or_device_warns(tmp_path: Path) -> None:
    warnings: list[str] = []
    import_to_bundle([TP1_BS1], tmp_path / "b", device="A100-SXM-80GB", source="test", warn=warnings.append,
                     model="gpt?layers=4&hidden=768&heads=12&vocab=8192", seq_len=1024)
    assert any("parameters_per_layer_bytes[3] is 50384896" in w and "is --model the profiled model?" in w
               for w in warnings)
    assert any("the file says it measured 'H100'" in w for w in warnings)


def test_cli_import_writes_a_bundle_the_simulator_uses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "metis"
    files = [str(TP1_BS1), str(TP1_BS4), str(TP2_BS1)]
    args = ["traces", "import", *files, "--format", "metis", "--model", MODEL, "--device", "H100-SXM",
            "--out", str(out)]
    assert main([*args, "--json"]) == 2
    assert "pass --seq" in capsys.readouterr().err and not out.exists()
    assert main([*args, "--seq", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layer_records"] == 9
    bundle = read_bundle(out)
    assert bundle.manifest.fingerprint.device_type == "H100-SXM"
    calibration = fit_calibration([bundle]).calibration
    model = load_model(MODEL, seq_len=1024)
    sim = Simulator(model, load_cluster("dgx-h100:nodes=1"), Workload(global_batch=2, seq_len=1024),
                    calibration=calibration)
    stage = sim.simulate(Plan(stages=(Stage(layers=(0, 6), devices=(0,)),), micro_batches=1)).stages[0]
    # micro-batch 2 lies between the profiled 1 and 4 for every block
    assert stage.compute_source == ("block: layer profile (interpolated); embedding: layer profile (interpolated); "
                                    "head: layer profile (interpolated)")
    assert stage.forward_s >= 4 * (0.002 + (0.0072 - 0.002) / 3)
