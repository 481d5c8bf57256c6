"""Calibration fitting: recovers known figures from records they generated, and applies to links."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tagplan.cost.calibration import (
    DEFAULT_CALIBRATION,
    GEMM_CURVE,
    Calibration,
    LinkFit,
    calibrated_cluster,
    link_key,
    scaled,
)
from tagplan.cost.comm import Collective, CommModel
from tagplan.datasets.traces.bundle import Bundle, CollectiveRecord, Manifest, OpRecord, host_fingerprint, now_iso
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType
from tagplan.training.calibrate import fit_calibration, predict_op_s
from tagplan.training.calibrations import load_calibration

DEVICE = DeviceSpec(name="test-accel", peak_flops_bf16=1e14, peak_flops_fp16=1e14, peak_flops_fp32=2e13,
                    mem_bytes=16 * 2**30, mem_bandwidth_Bps=1e12)
TRUTH = Calibration(name="truth", compute={"test-accel": {OpKind.MATMUL: scaled(GEMM_CURVE, 0.5)}},
                    memory_efficiency={"test-accel": 0.5}, launch_overhead_s=1e-5)


def op_records(calibration: Calibration) -> list[OpRecord]:
    """Square matmuls and layernorms of many sizes, timed by `calibration`'s own cost model."""
    records = []
    for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384):
        mm = OpRecord(device="test-accel", kind=OpKind.MATMUL, dtype=DType.BF16, flops=2.0 * n**3,
                      bytes_read=4.0 * n * n, bytes_written=2.0 * n * n, param_bytes=2.0 * n * n, time_s=1.0,
                      shape={"m": n, "k": n, "n": n})
        ln = OpRecord(device="test-accel", kind=OpKind.LAYERNORM, dtype=DType.BF16, flops=8.0 * n * 1024,
                      bytes_read=2.0 * n * 1024 * 8, bytes_written=2.0 * n * 1024 * 8, time_s=1.0,
                      shape={"rows": n * 8, "hidden": 1024})
        for r in (mm, ln):
            for phase in ("forward", "backward"):
                with_phase = r.model_copy(update={"phase": phase})
                records.append(with_phase.model_copy(update={"time_s": predict_op_s(with_phase, DEVICE, calibration)}))
    return records


def bundle(records: list) -> Bundle:  # type: ignore[type-arg]
    manifest = Manifest(created=now_iso(), source="test", fingerprint=host_fingerprint("test-accel"), device=DEVICE)
    return Bundle(manifest=manifest, records=tuple(records))


def test_fit_recovers_the_figures_that_made_the_records_and_reports_held_out_error() -> None:
    fit = fit_calibration([bundle(op_records(TRUTH))])
    cal = fit.calibration
    assert cal.launch_s("test-accel") == pytest.approx(1e-5, rel=0.5) and cal.launch_overhead_s == 4e-6
    assert cal.bandwidth_fraction("test-accel", OpKind.LAYERNORM) == pytest.approx(0.5, rel=0.15)
    summary = fit.summary()
    assert summary["ops_mape_before"] is not None and summary["ops_mape_after"] is not None
    assert summary["ops_mape_after"] < 0.15 < summary["ops_mape_before"]
    held = sum(r.held_out for r in fit.rows)
    assert 0 < held < len(op_records(TRUTH))  # some shapes were kept out of the fit
    assert {r.what for r in fit.rows} >= {"matmul forward", "matmul backward", "layernorm forward"}


def test_links_are_fitted_by_alpha_beta_and_replace_the_datasheet() -> None:
    alpha, bandwidth = 20e-6, 5e9
    records = []
    for size in (2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24):
        for kind, steps, bus in (("all_reduce", 2, 1.0), ("all_gather", 1, 0.5), ("p2p", 1, 1.0)):
            records.append(CollectiveRecord(collective=kind, backend="gloo", device="test-accel", ranks=2,
                                            bytes=size, time_s=steps * alpha + bus * size / bandwidth))
    fit = fit_calibration([bundle(records)])
    link = fit.calibration.links[link_key("test-accel", "intra")]
    assert link.latency_s == pytest.approx(alpha, rel=0.05) and link.bandwidth_Bps == pytest.approx(bandwidth, rel=0.05)
    assert all(r.mape_after < 0.01 for r in fit.rows)
    assert [r.mape_before for r in fit.rows] == [None]  # the defaults cost a link from a cluster, not a record
    stale = fit.calibration.model_copy(update={"links": {link_key("test-accel", "intra"): link.model_copy(
        update={"bandwidth_Bps": bandwidth / 2})}})
    refit = fit_calibration([bundle(records)], base=stale)  # the link fit it replaces is scored too
    [row] = refit.rows
    assert row.mape_before is not None and row.mape_before > 0.2 and row.mape_after < 0.01

    cluster = load_cluster("p3.8xlarge")
    measured = Calibration(links={link_key(cluster.nodes[0].device.name, "intra"): link})
    moved = calibrated_cluster(cluster, measured)
    assert moved.link(0, 1).bandwidth_Bps == pytest.approx(bandwidth) and moved.link(0, 3).latency_s == link.latency_s
    assert calibrated_cluster(cluster, DEFAULT_CALIBRATION) is cluster
    t = CommModel(moved).collective(Collective.ALL_REDUCE, (0, 1), 2**24).time_s
    assert t == pytest.approx(2 * alpha + 2**24 / bandwidth, rel=1e-3)


def test_a_calibration_file_round_trips_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    fit = fit_calibration([bundle(op_records(TRUTH))])
    path = tmp_path / "calib.json"
    path.write_text(fit.calibration.model_dump_json())
    assert load_calibration(path) == fit.calibration
    broken = json.loads(path.read_text())
    broken["links"] = {"x/intra": {"bandwidth_Bps": -1, "latency_s": 0}}
    path.write_text(json.dumps(broken))
    with pytest.raises(SpecError, match="bandwidth_Bps"):
        load_calibration(path)
    with pytest.raises(SpecError, match="no op, collective, layer or iteration records"):
        fit_calibration([bundle([])])
    assert isinstance(LinkFit(bandwidth_Bps=1.0, latency_s=0.0), LinkFit)


def test_calibrating_on_the_committed_cpu_bundle_brings_the_simulator_to_the_measured_iterations() -> None:
    """Real data: op and collective records fit; the 12 measured training iterations are the check."""
    import numpy as np

    from tagplan.cost.simulator import Simulator
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.iteration_fit import rebuild_record

    measured = read_bundle(Path(__file__).parents[1] / "fixtures" / "traces" / "cpu-quick")
    fit = fit_calibration([measured.model_copy(update={"records": tuple(measured.ops() + measured.collectives())})])
    summary = fit.summary()
    assert summary["ops_mape_after"] < summary["ops_mape_before"]

    def error(calibration: Calibration) -> float:
        ratios = []
        for i, record in enumerate(measured.iterations()):
            model, cluster, plan = rebuild_record(record, f"record {i}")
            sim = Simulator(model, cluster, record.workload, calibration=calibration)
            ratios.append(sim.simulate(plan).iteration_time_s / record.measured_s)
        return float(np.mean(np.abs(np.array(ratios) - 1.0)))

    before, after = error(DEFAULT_CALIBRATION), error(fit.calibration)
    assert after < 0.25 < before  # measured on the committed bundle: about 140% -> 6%


def test_a_power_capped_device_is_fitted_against_its_sustained_peak_not_capped_twice() -> None:
    capped = DEVICE.model_copy(update={"sustained_peak_fraction": 0.5})
    records = [r.model_copy(update={"time_s": predict_op_s(r, capped, TRUTH)}) for r in op_records(TRUTH)]
    manifest = Manifest(created=now_iso(), source="test", fingerprint=host_fingerprint("test-accel"), device=capped)
    fit = fit_calibration([Bundle(manifest=manifest, records=tuple(records))])
    assert fit.summary()["ops_mape_after"] < 0.15  # counted twice, every GEMM would come out 2x too slow
    curve = fit.calibration.curve("test-accel", OpKind.MATMUL)
    assert curve is not None and curve.at(2.0 * 8192**3) == pytest.approx(scaled(GEMM_CURVE, 0.5).at(2.0 * 8192**3),
                                                                           rel=0.1)


def test_an_op_record_is_predicted_as_kernel_time_without_the_iteration_fit_on_top() -> None:
    """Op records time kernels (CUDA events): the compute scale and the host's dispatch floor, which an
    iteration fit adds, must not enter the op predictions a re-calibration is compared by."""
    fitted = TRUTH.model_copy(update={"compute_scale": {"test-accel": 3.0}, "host_dispatch_s": {"test-accel": 1e-3}})
    for record in op_records(TRUTH):
        assert predict_op_s(record, DEVICE, fitted) == pytest.approx(record.time_s, rel=1e-12)
