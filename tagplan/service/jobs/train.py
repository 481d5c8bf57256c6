"""A training job: a stored `TrainRequest` -> the GNN fine-tuned on uploaded traces -> its model card.

Only bundles uploaded to this service (under `<home>/traces`) are read; the calibration is an
inline object or a registry version, never a path (`requests.calibration_of`).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError
from tagplan.service.jobs import Progress
from tagplan.service.requests import TrainRequest, calibration_of, read_request, registry_root, shown, traces_root
from tagplan.service.settings import Settings


def run_train(data: Any, settings: Settings, progress: Progress) -> dict[str, Any]:
    """Fine-tune the active GNN on the request's bundles and register it; the model card as JSON."""
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.registry import Registry
    from tagplan.training.traces import finetune_on_traces  # torch: imported when a training job runs

    request = read_request(TrainRequest, data, "training request")
    root = traces_root(settings).resolve()
    for path in request.traces:
        if not Path(path).resolve().is_relative_to(root):
            raise SpecError(f"traces: {shown(path)} is not a trace bundle uploaded to this service")
    calibration = calibration_of(request.calibration, settings)
    progress(0.05, f"reading {len(request.traces)} trace bundles")
    bundles = [read_bundle(p) for p in request.traces]
    progress(0.2, "fine-tuning the GNN on the measured iterations")
    out_dir = settings.home / "training" / uuid.uuid4().hex
    card = finetune_on_traces(bundles, out_dir, registry=Registry(registry_root(settings)), calibration=calibration)
    progress(1.0, "registered")
    return dict(json.loads(json.dumps(card, default=str)))  # paths and dates as strings
