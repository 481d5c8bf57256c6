"""The local testbed bundle (bench/data/testbed/) is the per-plan median of its measured sessions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bench_modules import BENCH, load_bench

from tagplan.datasets.traces.bundle import IterationRecord, Manifest, host_fingerprint, read_bundle, write_bundle
from tagplan.ir.workload import Workload


def _record(micro_batches: int, seconds: float) -> IterationRecord:
    plan = {"micro_batches": micro_batches, "stages": [{"layers": [0, 4], "devices": [0]}]}
    return IterationRecord(model="gpt?layers=2&hidden=64&heads=2&vocab=128", cluster="cpu", plan=plan,
                           workload=Workload(global_batch=8, seq_len=16), measured_s=seconds, repeats=5)


def test_a_merged_plan_takes_the_median_of_the_sessions_and_needs_every_session(tmp_path: Path) -> None:
    sessions = [tmp_path / "sessions" / name for name in ("a", "b", "c")]
    times = {1: (0.10, 0.30, 0.12), 2: (0.20, 0.18, 0.50), 4: (None, 0.40, 0.41)}  # m4 is missing in the first
    for index, directory in enumerate(sessions):
        records = [_record(m, seconds) for m, t in reversed(times.items()) if (seconds := t[index]) is not None]
        write_bundle(directory, Manifest(created="2026-01-01T00:00:00+00:00", source="test",
                                             fingerprint=host_fingerprint("cpu-test")), records)
    load_bench("testbed").merge_sessions(sessions, tmp_path / "merged")
    merged = read_bundle(tmp_path / "merged").iterations()
    assert [(r.plan["micro_batches"], r.measured_s, r.repeats) for r in merged] == [(2, 0.20, 15), (1, 0.12, 15)]


def test_only_one_machines_sessions_are_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # two sessions on one CPU, then one on another (a VM moved to other hardware): its times are not
    # more samples of the first machine's plans, and its device must not describe them
    machines = {"a": ("cpu-amd", 0.10), "b": ("cpu-amd", 0.12), "c": ("cpu-intel", 0.50)}
    for name, (device, seconds) in machines.items():
        write_bundle(tmp_path / "sessions" / name, Manifest(created="2026-01-01T00:00:00+00:00", source="test",
                                                            fingerprint=host_fingerprint(device)),
                     [_record(1, seconds)])
    testbed = load_bench("testbed")
    sessions = sorted((tmp_path / "sessions").iterdir())
    _, merged = testbed.merge_sessions(sessions, tmp_path / "most")
    bundle = read_bundle(tmp_path / "most")
    assert [p.name for p in merged] == ["a", "b"] and bundle.manifest.fingerprint.device_type == "cpu-amd"
    assert [r.measured_s for r in bundle.iterations()] == [pytest.approx(0.11)]
    _, merged = testbed.merge_sessions(sessions, tmp_path / "intel", device_type="cpu-intel")
    assert [p.name for p in merged] == ["c"] and read_bundle(tmp_path / "intel").iterations()[0].measured_s == 0.50
    with pytest.raises(SystemExit, match="no session given"):
        testbed.merge_sessions([], tmp_path / "none")
    with pytest.raises(SystemExit, match="no session ran on 'cpu-arm'"):
        testbed.merge_sessions(sessions, tmp_path / "arm", device_type="cpu-arm")
    # main keeps the bundle on its own machine and says which session it left out
    write_bundle(tmp_path, read_bundle(tmp_path / "intel").manifest, [])
    monkeypatch.setattr(sys, "argv", ["testbed.py", "--out", str(tmp_path), "--merge-only"])
    testbed.main()
    assert "not merged: a ran on cpu-amd, not on the testbed's cpu-intel" in capsys.readouterr().out
    assert read_bundle(tmp_path).iterations()[0].measured_s == 0.50


@pytest.mark.parametrize("folder", ["testbed", "testbed-intel"])
def test_the_committed_testbed_is_the_merge_of_its_committed_sessions(tmp_path: Path, folder: str) -> None:
    root = BENCH / "data" / folder
    sessions = sorted(p for p in (root / "sessions").iterdir() if p.is_dir())
    assert len(sessions) >= 2
    load_bench("testbed").merge_sessions(sessions, tmp_path)
    ours = [(r.model, r.plan, r.measured_s) for r in read_bundle(tmp_path).iterations()]
    assert ours == [(r.model, r.plan, r.measured_s) for r in read_bundle(root).iterations()]
    assert len(ours) >= 40


def test_a_session_written_before_a_plan_field_existed_names_the_same_plans(tmp_path: Path) -> None:
    old, new = _record(1, 0.10), _record(1, 0.20)
    stage = {**new.plan["stages"][0], "cp": 1, "recompute_layers": None, "zero": 0}  # as a newer Plan writes it
    new = new.model_copy(update={"plan": {**new.plan, "stages": [stage]}})
    for name, record in (("a", old), ("b", new)):
        write_bundle(tmp_path / "sessions" / name, Manifest(created="2026-01-01T00:00:00+00:00", source="test",
                                                            fingerprint=host_fingerprint("cpu-test")), [record])
    load_bench("testbed").merge_sessions(sorted((tmp_path / "sessions").iterdir()), tmp_path / "merged")
    assert [r.measured_s for r in read_bundle(tmp_path / "merged").iterations()] == [pytest.approx(0.15)]


def test_merging_without_a_measured_session_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["testbed.py", "--out", str(tmp_path), "--merge-only"])
    with pytest.raises(SystemExit, match="no measured session to merge"):
        load_bench("testbed").main()


def _sessions(root: Path, times: dict[str, list[float]]) -> list[IterationRecord]:
    """One session per name, plan k (k micro-batches) measured at times[name][k - 1]; the merged bundle."""
    for name, seconds in times.items():
        write_bundle(root / "sessions" / name, Manifest(created="2026-01-01T00:00:00+00:00", source="test",
                                                        fingerprint=host_fingerprint("cpu-test")),
                     [_record(k + 1, t) for k, t in enumerate(seconds)])
    load_bench("testbed").merge_sessions(sorted((root / "sessions").iterdir()), root)
    return read_bundle(root).iterations()


def test_sessions_that_differ_only_in_the_machines_speed_agree_fully(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # fidelity imports its sibling scripts
    agreement = load_bench("fidelity").sessions_agreement
    merged = _sessions(tmp_path, {"a": [0.1, 0.2, 0.3, 0.4], "b": [0.2, 0.4, 0.6, 0.8], "c": [0.15, 0.3, 0.45, 0.6]})
    out = agreement(tmp_path, merged)
    assert out["sessions"] == 3 and out["plans"] == 4
    assert out["pair_tau_median"] == pytest.approx(1.0) and out["pair_mape_median"] == pytest.approx(0.0)
    assert out["half_tau_median"] == pytest.approx(1.0) and out["half_regret_worst"] == pytest.approx(0.0)


def test_sessions_that_disagree_on_the_fastest_plan_show_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    agreement = load_bench("fidelity").sessions_agreement
    # session b finds plan 2 fastest where a and c find plan 1: a choice made on b runs 50% slower on a and c,
    # theirs twice as long as b's fastest on b
    merged = _sessions(tmp_path / "x", {"a": [0.1, 0.15, 0.3, 0.4], "b": [0.1, 0.05, 0.3, 0.4],
                                        "c": [0.1, 0.15, 0.3, 0.4]})
    out = agreement(tmp_path / "x", merged)
    assert out["pair_tau_range"][0] < 1.0 and out["pair_tau_range"][1] == pytest.approx(1.0)
    assert out["half_regret_worst"] == pytest.approx(1.0)
    # a scored plan some session did not measure: no agreement to report
    assert agreement(tmp_path / "x", [*merged, _record(9, 1.0)]) is None
