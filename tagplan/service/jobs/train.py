"""A training job: a stored `TrainRequest` -> the GNN fine-tuned on uploaded traces -> its model card.

Only bundles the tenant uploaded to this service (under `<home>/traces/<tenant id>`) are read, and
every iteration record in them is checked again as on upload (`requests.check_bundle`: model and
cluster inline or SPECs naming no file, within the limits); the calibration is an inline object or
a registry version, never a path (`requests.calibration_of`).

The new version is registered in the tenant's own registry (`requests.tenant_registry`) and
becomes the tenant's active version only when it lowers the held-out error on the tenant's data;
the service-wide version every other tenant uses changes only by an admin's activation.
A tenant's registry keeps its newest `max_versions_per_tenant` versions and its active one; older ones
are deleted as a new one is registered (`Registry.prune`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError
from tagplan.service.jobs import Progress
from tagplan.service.requests import (
    TrainRequest,
    calibration_of,
    check_bundle,
    read_request,
    shown,
    tenant_registry,
    traces_root,
)
from tagplan.service.settings import Settings


def run_train(data: Any, settings: Settings, progress: Progress, *, tenant_id: int | None = None) -> dict[str, Any]:
    """Fine-tune the tenant's GNN on the request's bundles and register it for the tenant; the model card."""
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.traces import finetune_on_traces  # torch: imported when a training job runs

    request = read_request(TrainRequest, data, "training request")
    root = traces_root(settings).resolve()
    if tenant_id is not None:
        root = root / str(int(tenant_id))
    for path in request.traces:
        if not Path(path).resolve().is_relative_to(root):
            raise SpecError(f"traces: {shown(path)} is not a trace bundle uploaded to this service")
    calibration = calibration_of(request.calibration, settings)
    progress(0.05, f"reading {len(request.traces)} trace bundles")
    gone = [Path(p).name for p in request.traces if not Path(p).is_dir()]
    if gone:  # deleted (DELETE /v1/traces/{id}) after the run was queued
        raise SpecError(f"trace(s) {', '.join(gone)} were deleted after this training run was queued; submit it "
                        "again with traces that exist")
    bundles = [check_bundle(read_bundle(p), settings, f"bundle {i}") for i, p in enumerate(request.traces)]
    progress(0.2, "fine-tuning the GNN on the measured iterations")
    registry = tenant_registry(settings, tenant_id)
    (settings.home / "training").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.home / "training") as out_dir:  # the registry keeps a copy
        card = finetune_on_traces(bundles, Path(out_dir), registry=registry, calibration=calibration,
                                  names=[f"trace {Path(p).name}" for p in request.traces])
    if tenant_id is not None:
        registry.prune(settings.max_versions_per_tenant)
    progress(1.0, "registered")
    scope = "service-wide" if tenant_id is None else f"tenant {tenant_id}"
    return {**json.loads(json.dumps(card, default=str)), "registry": scope}  # paths and dates as strings


def sweep_training_dirs(settings: Settings, now_s: float | None = None) -> int:
    """Remove what killed training runs left under `<home>/training` (a job process killed by a cancel, its
    timeout or its memory cap never leaves its temporary directory); a folder older than twice the job timeout
    belongs to no running job. Returns how many were removed."""
    root, now_s = settings.home / "training", time.time() if now_s is None else now_s
    removed = 0
    try:
        entries = list(os.scandir(root))
    except OSError:  # no folder yet
        return 0
    for entry in entries:
        try:  # another worker's sweep, or a run ending, may remove an entry meanwhile
            stale = entry.is_dir() and now_s - entry.stat().st_mtime > 2 * settings.job_timeout_s
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed
