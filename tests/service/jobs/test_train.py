"""A training job (`service/jobs/train.py`): only uploaded bundles, registered in the service's home."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.service.jobs import run_job
from tagplan.service.settings import Settings
from tagplan.service.vocabulary import JobKind

BUNDLE = Path(__file__).parents[2] / "fixtures" / "traces" / "cpu-quick"


def test_a_training_job_reads_only_uploaded_bundles(settings: Settings) -> None:
    elsewhere = settings.home / "training-data" / "cpu-quick"  # in the home, yet not an upload
    shutil.copytree(BUNDLE, elsewhere)
    for traces in ([str(BUNDLE)], [str(elsewhere)], [str(settings.home / "traces" / ".." / "training-data")]):
        with pytest.raises(SpecError, match="not a trace bundle uploaded"):
            run_job(JobKind.TRAIN, {"traces": traces}, settings, lambda _f, _m: None)
    with pytest.raises(SpecError, match="traces"):
        run_job(JobKind.TRAIN, {"traces": []}, settings, lambda _f, _m: None)
    uploaded = settings.home / "traces" / "1" / "cpu-quick"
    shutil.copytree(BUNDLE, uploaded)
    with pytest.raises(SpecError, match="calibration"):
        run_job(JobKind.TRAIN, {"traces": [str(uploaded)], "calibration": "/etc/calibration.json"}, settings,
                lambda _f, _m: None)


@pytest.mark.slow
def test_training_job_registers_a_version_in_the_service_home(settings: Settings) -> None:
    uploaded = settings.home / "traces" / "1" / "cpu-quick"
    shutil.copytree(BUNDLE, uploaded)
    messages: list[str] = []
    card = run_job(JobKind.TRAIN, {"traces": [str(uploaded)]}, settings, lambda _f, m: messages.append(m))
    assert card["version"] == "v0001" and (settings.home / "registry" / "versions" / "v0001" / "model.pt").exists()
    assert messages[-1] == "registered"


@pytest.mark.slow
def test_a_tenant_keeps_its_newest_versions_and_no_training_leftovers(settings: Settings) -> None:
    from tagplan.service.requests import tenant_registry

    uploaded = settings.home / "traces" / "7" / "cpu-quick"
    shutil.copytree(BUNDLE, uploaded)
    one = settings.model_copy(update={"max_versions_per_tenant": 1})
    cards = [run_job(JobKind.TRAIN, {"traces": [str(uploaded)]}, one, lambda _f, _m: None, tenant_id=7)
             for _ in range(2)]
    assert [c["version"] for c in cards] == ["v0001", "v0002"]
    registry = tenant_registry(one, 7)
    assert registry.versions() == sorted({"v0002", *([registry.active()] if registry.active() else [])})
    assert list((settings.home / "training").iterdir()) == []  # the fine-tuning's own copy is gone


def test_folders_killed_training_runs_left_are_swept(settings: Settings) -> None:
    import os
    import time

    from tagplan.service.jobs.train import sweep_training_dirs

    root = settings.home / "training"
    old, young = root / "tmpold", root / "tmpyoung"
    for folder in (old, young):
        folder.mkdir(parents=True)
        (folder / "model.pt").write_bytes(b"weights")
    long_ago = time.time() - 3 * settings.job_timeout_s
    os.utime(old, (long_ago, long_ago))
    assert sweep_training_dirs(settings) == 1
    assert sorted(p.name for p in root.iterdir()) == ["tmpyoung"]  # a running job's folder stays
